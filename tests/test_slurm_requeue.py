"""Acceptance 4: slurm/train.sbatch on a real (one-node) SLURM cluster started by the test.

sbatch the real batch script (debug_mhar, 1 node, 1 CPU worker, checkpoints on), send
the time-limit warning with `scancel --signal=USR1 --batch`, and check that the trap
stopped the training step with a checkpoint, that the job was requeued (same id,
Restarts=1), and that the requeued attempt resumed from that checkpoint and completed.
"""
from __future__ import annotations

import os
import subprocess
import time

import pytest

from slurm_cluster import LocalSlurmCluster, missing_requirements
from helpers import PATIENCE_S, ROOT, read_metrics
from slurm_tools import launch_env



STEPS = 8


@pytest.fixture
def cluster(tmp_path):
    reason = missing_requirements()
    if reason:
        if os.environ.get("CI"):
            pytest.fail(reason + " -- CI must provide it")
        pytest.skip(reason)
    if not list((ROOT / "data" / "shakespeare").glob("train-*.parquet")):
        pytest.skip("data/shakespeare is missing: run python -m mhar_titan.data.prepare_shakespeare --out data/shakespeare")
    c = LocalSlurmCluster(tmp_path / "slurm")
    c.start()
    try:
        yield c
    finally:
        c.stop()


def wait_until(predicate, timeout: float, what: str, context) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}\n{context()}"
        time.sleep(0.1)


def logged_steps(run_dir) -> list[int]:
    return [r["step"] for r in read_metrics(run_dir) if "loss" in r]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.processes
def test_usr1_warning_checkpoints_requeues_and_resumes(cluster, tmp_path):
    from mhar_titan.checkpoint import is_complete

    out, logs = tmp_path / "out", tmp_path / "logs"
    run_dir = out / "debug_mhar"
    env = launch_env(LOG_DIR=str(logs), NPROC_PER_NODE="1", OMP_NUM_THREADS="1", SLURM_CONF=str(cluster.conf))
    batch_log = tmp_path / "batch.out"
    submit = subprocess.run(
        ["sbatch", "--parsable", "--nodes=1", "--gpus-per-node=0", f"--output={batch_log}",
         "slurm/train.sbatch", "train_configs/debug_mhar.toml",
         f"--training.steps={STEPS}", f"--job.dump_folder={out}", "--training.seq_len=32",
         "--training.local_batch_size=2", "--metrics.log_freq=1", "--validation.enable=false",
         "--checkpoint.enable=true", "--checkpoint.interval=0"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=PATIENCE_S,
    )
    assert submit.returncode == 0, submit.stderr
    job = submit.stdout.strip().split(";")[0]

    def context() -> str:
        node_logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted(logs.glob("node-*.log")))
        batch = batch_log.read_text(errors="replace") if batch_log.exists() else "(no batch log)"
        return f"--- batch log\n{batch}\n--- node logs\n{node_logs}\n--- scontrol\n" + subprocess.run(
            ["scontrol", "show", "job", job], env=env, capture_output=True, text=True).stdout

    # 1. the first attempt trains; then the time-limit warning arrives
    wait_until(lambda: 1 in logged_steps(run_dir), PATIENCE_S, "step 1 of the first attempt", context)
    r = subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr

    # 2. the trap stops the step with a checkpoint and requeues the job (held until its begin time)
    wait_until(lambda: cluster.job_field(job, "Restarts") == "1" and cluster.job_field(job, "JobState") == "PENDING",
               PATIENCE_S, "the job to be requeued", context)
    saved = sorted(int(p.name.split("-")[1]) for p in (run_dir / "checkpoints").glob("step-*"))
    assert len(saved) == 1 and 1 <= saved[0] < STEPS, (saved, context())
    stop_step = saved[0]
    assert is_complete(run_dir / "checkpoints" / f"step-{stop_step}")
    batch = batch_log.read_text()
    assert "got SIGUSR1: sending SIGTERM to the training step" in batch
    assert f"requeuing job {job}" in batch

    # 3. released, the same job id starts again and resumes from the checkpoint. Release only
    # once the node is idle and a new second has begun: slurmd revokes the old attempt's job
    # credential with one-second resolution, and a start in that same second is refused
    # ("Job credential revoked"), which fails the job instead of running attempt 2.
    wait_until(lambda: cluster.node_state() == "idle", PATIENCE_S, "the node to be idle after the requeue", context)
    time.sleep(2.0)
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=env, check=True,
                   capture_output=True)
    wait_until(lambda: cluster.job_field(job, "JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"),
               PATIENCE_S, "the requeued attempt to finish", context)
    assert cluster.job_field(job, "JobState") == "COMPLETED", context()
    assert cluster.job_field(job, "ExitCode") == "0:0", context()
    batch = batch_log.read_text()
    assert "attempt 2:" in batch and "training step ended with exit code 0" in batch
    node_log = (logs / "node-0.log").read_text()
    assert f"loaded checkpoint {run_dir / 'checkpoints' / f'step-{stop_step}'}" in node_log
    assert logged_steps(run_dir) == list(range(1, STEPS + 1))
    assert is_complete(run_dir / "checkpoints" / f"step-{STEPS}")


# --- clean preemption or crash: the decision after an attempt (no cluster needed) -------------------

def next_action(status="", rc=0, sig="", restarts=0, crashes=0, max_requeues=50, max_retries=1) -> list[str]:
    script = f'source "{ROOT}/slurm/lib.sh"; next_action "$@"'
    r = subprocess.run(["bash", "-c", script, "next_action", status, str(rc), sig, str(restarts), str(crashes),
                        str(max_requeues), str(max_retries)], capture_output=True, text=True, check=True)
    action, code, reason = r.stdout.strip().split(" ", 2)
    return [action, code]


@pytest.mark.parametrize("args, expected", [
    # torchrun exits 1 after forwarding the SIGTERM, the trainer saved: requeue
    (dict(status="preempted", rc=1, sig="USR1"), ["requeue", "0"]),
    (dict(status="preempted", rc=1, sig="USR1", restarts=50), ["stop", "1"]),  # MAX_REQUEUES reached
    (dict(status="", rc=0, sig="USR1"), ["requeue", "0"]),  # the warning came before training started
    (dict(status="completed", rc=0), ["stop", "0"]),
    (dict(status="completed", rc=1, sig="USR1"), ["stop", "0"]),  # finished anyway
    (dict(status="bad_input", rc=2), ["stop", "2"]),  # never retried
    (dict(status="bad_input", rc=1, sig="USR1"), ["stop", "2"]),
    (dict(status="health", rc=1), ["stop", "1"]),
    (dict(status="", rc=1), ["requeue", "1"]),  # a crash: retried once by default
    (dict(status="", rc=-9 % 256), ["requeue", "247"]),
    (dict(status="", rc=1, crashes=1), ["stop", "1"]),  # ... and then the job stops
    (dict(status="", rc=0, crashes=3, max_retries=3), ["stop", "1"]),
    (dict(status="", rc=137, sig="USR1"), ["requeue", "137"]),  # killed while stopping: a crash
    (dict(status="preempted", rc=0, sig="TERM"), ["stop", "0"]),  # SLURM requeues what it preempts
    (dict(status="preempted", rc=1, sig=""), ["stop", "0"]),  # a stop signal from outside this job
])
def test_next_action_tells_a_clean_preemption_from_a_crash(args, expected):
    assert next_action(**args) == expected


def test_trainer_exit_status_file_is_read_by_the_launcher(tmp_path, monkeypatch):
    from mhar_titan.exit_status import FILE_NAME, read_exit_status, write_exit_status

    launcher_file = tmp_path / "launcher_status"
    monkeypatch.setenv("MHAR_EXIT_STATUS_FILE", str(launcher_file))
    write_exit_status(tmp_path, "preempted", 0, step=12)
    assert read_exit_status(tmp_path / FILE_NAME) == {"status": "preempted", "exit_code": "0", "step": "12"}
    field = subprocess.run(["bash", "-c", f'source "{ROOT}/slurm/lib.sh"; exit_status_field "$1" status', "x",
                            str(launcher_file)], capture_output=True, text=True, check=True).stdout
    assert field == "preempted\n"
    with pytest.raises(ValueError, match="unknown exit status"):
        write_exit_status(tmp_path, "fine", 0)


FAKE_TORCHRUN = """#!/usr/bin/env bash
# stands in for "python -m torch.distributed.run ... train.py": the trainer's status, then torchrun's code
if [[ -n "$FAKE_STATUS" ]]; then printf 'status=%s\\nexit_code=0\\n' "$FAKE_STATUS" >"$MHAR_EXIT_STATUS_FILE"; fi
exit "$FAKE_RC"
"""


@pytest.mark.parametrize("status, torchrun_rc, expected", [
    ("preempted", 1, 0), ("completed", 0, 0), ("bad_input", 1, 2), ("health", 1, 1), ("", 1, 1), ("", 134, 134),
])
def test_run_train_sh_exits_with_the_trainers_code_not_torchruns(tmp_path, status, torchrun_rc, expected):
    fake = tmp_path / "python"
    fake.write_text(FAKE_TORCHRUN)
    fake.chmod(0o755)
    r = subprocess.run(["bash", str(ROOT / "scripts" / "run_train.sh")], capture_output=True, text=True,
                       env=launch_env(PYTHON=str(fake), NGPU="1", FAKE_STATUS=status, FAKE_RC=str(torchrun_rc),
                                      TMPDIR=str(tmp_path)), timeout=PATIENCE_S)
    assert r.returncode == expected, r.stderr
    assert not list(tmp_path.glob("mhar-exit-status.*"))  # the temporary status file is removed
