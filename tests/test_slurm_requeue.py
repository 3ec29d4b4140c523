"""Acceptance 4: slurm/train.sbatch on a real (one-node) SLURM cluster started by the test.

sbatch the real batch script (debug_mhar, 1 node, 1 CPU worker, checkpoints on), send
the time-limit warning with `scancel --signal=USR1 --batch`, and check that the trap
stopped the training step with a checkpoint, that the job was requeued (same id,
Restarts=1), and that the requeued attempt resumed from that checkpoint and completed.
"""
from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from slurm_cluster import LocalSlurmCluster, missing_requirements
from slurm_tools import ROOT, launch_env

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

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
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if '"loss"' in line]


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
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=30,
    )
    assert submit.returncode == 0, submit.stderr
    job = submit.stdout.strip().split(";")[0]

    def context() -> str:
        node_logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted(logs.glob("node-*.log")))
        batch = batch_log.read_text(errors="replace") if batch_log.exists() else "(no batch log)"
        return f"--- batch log\n{batch}\n--- node logs\n{node_logs}\n--- scontrol\n" + subprocess.run(
            ["scontrol", "show", "job", job], env=env, capture_output=True, text=True).stdout

    # 1. the first attempt trains; then the time-limit warning arrives
    wait_until(lambda: 1 in logged_steps(run_dir), 180, "step 1 of the first attempt", context)
    r = subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr

    # 2. the trap stops the step with a checkpoint and requeues the job (held until its begin time)
    wait_until(lambda: cluster.job_field(job, "Restarts") == "1" and cluster.job_field(job, "JobState") == "PENDING",
               120, "the job to be requeued", context)
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
    wait_until(lambda: cluster.node_state() == "idle", 60, "the node to be idle after the requeue", context)
    time.sleep(2.0)
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=env, check=True,
                   capture_output=True)
    wait_until(lambda: cluster.job_field(job, "JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"),
               240, "the requeued attempt to finish", context)
    assert cluster.job_field(job, "JobState") == "COMPLETED", context()
    assert cluster.job_field(job, "ExitCode") == "0:0", context()
    batch = batch_log.read_text()
    assert "attempt 2:" in batch and "training step ended with exit code 0" in batch
    node_log = (logs / "node-0.log").read_text()
    assert f"loaded checkpoint {run_dir / 'checkpoints' / f'step-{stop_step}'}" in node_log
    assert logged_steps(run_dir) == list(range(1, STEPS + 1))
    assert is_complete(run_dir / "checkpoints" / f"step-{STEPS}")
