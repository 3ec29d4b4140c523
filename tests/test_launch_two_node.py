"""Acceptance 2 and 3: two "nodes" on loopback, launched exactly as slurm/train.sbatch does.

Each node is `slurm/torchrun_node.sh` (one `torchrun --nnodes=2 --node_rank=i
--nproc_per_node=1 --rdzv_backend=c10d --rdzv_endpoint=127.0.0.1:PORT`) with the
variables SLURM sets inside an `srun` task; gloo; `debug_mhar` with window sharding.

- A 5-step two-node run finishes on both nodes with the same losses as one process
  started by the single-node launcher `NGPU=1 scripts/run_train.sh` (global batch 4:
  2 ranks x 2, or 1 rank x 2 x 2 micro-batches).
- SIGTERM to both launchers: both workers save one complete checkpoint and exit 0
  (each writes its own exit status through tests/ckpt_train_entry.py, since torchrun's
  status then reports the signal); the same command again resumes from that checkpoint
  and finishes, again with both workers exiting 0.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import pytest

from helpers import PATIENCE_S, ROOT, read_metrics
from slurm_tools import free_port, launch_env

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.processes]

NODE = ROOT / "slurm" / "torchrun_node.sh"
CONFIG = "train_configs/debug_mhar.toml"
SMALL = ["--training.seq_len=32", "--training.local_batch_size=2", "--training.global_batch_size=4",
         "--metrics.log_freq=1", "--validation.enable=false",
         # every step of these runs is inside the warmup, so the LR of step s does not depend on
         # training.steps and a 5-step and an 8-step run must have the same first 5 losses
         "--lr_scheduler.warmup_steps=20"]


@pytest.fixture(scope="module", autouse=True)
def _shakespeare_sample():
    if not list((ROOT / "data" / "shakespeare").glob("train-*.parquet")):
        msg = "data/shakespeare is missing: run python -m mhar_titan.data.prepare_shakespeare --out data/shakespeare"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)


def start_nodes(tmp, tag: str, overrides: list[str], port: int,
                **extra_env: str) -> list[tuple[subprocess.Popen, object]]:
    """Two node launchers with SLURM-like task variables (plus `extra_env`); returns (process, log file) pairs."""
    procs = []
    for node in range(2):
        env = launch_env(
            RDZV_ENDPOINT=f"127.0.0.1:{port}", SLURM_JOB_ID="4242", SLURM_JOB_NUM_NODES="2", SLURM_NNODES="2",
            SLURM_NODEID=str(node), SLURM_PROCID=str(node), SLURM_LOCALID="0", SLURM_NTASKS="2",
            SLURM_JOB_NODELIST="localhost", NPROC_PER_NODE="1", OMP_NUM_THREADS="1",
            TORCHRUN_LOG_DIR=str(tmp / f"{tag}-torchrun-{node}"), **extra_env,
        )
        log = open(tmp / f"{tag}-node{node}.log", "w")
        p = subprocess.Popen(["bash", str(NODE), CONFIG, *overrides], cwd=ROOT, env=env,
                             stdout=log, stderr=subprocess.STDOUT)
        procs.append((p, log))
    return procs


def wait_nodes(procs, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    codes = []
    try:
        for p, log in procs:
            codes.append(p.wait(max(1.0, deadline - time.monotonic())))
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()
    return codes


def exit_entry_env(tmp, tag: str) -> dict[str, str]:
    """Run tests/ckpt_train_entry.py (train.py that writes rank<R>.rc) with its exit folder under `tmp`."""
    exit_dir = tmp / f"{tag}-exit"
    exit_dir.mkdir()
    return {"TRAIN_SCRIPT": str(ROOT / "tests" / "ckpt_train_entry.py"), "CKPT_EXIT_DIR": str(exit_dir)}


def worker_exit_codes(tmp, tag: str) -> dict[str, str]:
    """{"rank0.rc": "0", ...}: the exit status each worker wrote (missing: it died before returning)."""
    return {p.name: p.read_text() for p in sorted((tmp / f"{tag}-exit").iterdir())}


def read_text(path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


def worker_logs(tmp, tag: str) -> list[str]:
    """stdout+stderr of every worker (torchrun --log-dir), one string per worker."""
    out = []
    for node in range(2):
        files = sorted((tmp / f"{tag}-torchrun-{node}").rglob("*.log"))
        assert files, f"no worker logs under {tmp / f'{tag}-torchrun-{node}'}"
        by_rank: dict = {}
        for f in files:
            by_rank.setdefault(f.parent, []).append(f.read_text(errors="replace"))
        out += ["\n".join(v) for v in by_rank.values()]
    return out


@pytest.fixture(scope="module")
def single_process_losses(tmp_path_factory):
    """The reference: one worker, started by the single-node launcher (NGPU=1 scripts/run_train.sh)."""
    tmp = tmp_path_factory.mktemp("single")
    r = subprocess.run(["bash", str(ROOT / "scripts" / "run_train.sh"), "--training.steps=5",
                        f"--job.dump_folder={tmp}", *SMALL], cwd=tmp,
                       env=launch_env(NGPU="1", CONFIG=str(ROOT / CONFIG), OMP_NUM_THREADS="1"),
                       capture_output=True, text=True, timeout=PATIENCE_S)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "[rank0]:" in r.stdout + r.stderr and "| 1 rank " in r.stdout + r.stderr  # the start line
    return losses(tmp / "debug_mhar")


def test_two_nodes_on_loopback_match_single_process(tmp_path, single_process_losses):
    procs = start_nodes(tmp_path, "run", ["--training.steps=5", f"--job.dump_folder={tmp_path / 'out'}", *SMALL],
                        free_port())
    codes = wait_nodes(procs, timeout=PATIENCE_S)
    logs = [read_text(tmp_path / f"run-node{i}.log") for i in range(2)]
    assert codes == [0, 0], "\n\n".join(x[-4000:] for x in logs)
    for i, log in enumerate(logs):  # both nodes joined one 2-node rendezvous with one worker each
        assert f"--nnodes=2 --node_rank={i} --nproc_per_node=1 --rdzv_backend=c10d" in log
    assert "| 2 ranks " in logs[0]  # the start line of the one 2-rank job
    two_node = losses(tmp_path / "out" / "debug_mhar")
    assert sorted(two_node) == [1, 2, 3, 4, 5]
    assert two_node == pytest.approx(single_process_losses, rel=0, abs=2e-5)


def test_sigterm_on_both_launchers_checkpoints_and_relaunch_resumes(tmp_path, single_process_losses):
    from mhar_titan.checkpoint import is_complete

    steps = 8
    overrides = [f"--training.steps={steps}", f"--job.dump_folder={tmp_path / 'out'}", *SMALL,
                 "--checkpoint.enable=true", "--checkpoint.interval=0"]
    run_dir = tmp_path / "out" / "debug_mhar"
    ckpt_root = run_dir / "checkpoints"

    procs = start_nodes(tmp_path, "first", overrides, free_port(), **exit_entry_env(tmp_path, "first"))
    deadline = time.monotonic() + PATIENCE_S
    while not (run_dir / "metrics.jsonl").exists() or 1 not in losses(run_dir):
        assert all(p.poll() is None for p, _ in procs), read_text(tmp_path / "first-node0.log")[-4000:]
        assert time.monotonic() < deadline, "training did not reach step 1"
        time.sleep(0.05)
    for p, _ in procs:  # the launchers are torchrun itself (torchrun_node.sh execs it)
        p.send_signal(signal.SIGTERM)
    wait_nodes(procs, timeout=PATIENCE_S)
    node_logs = [read_text(tmp_path / f"first-node{i}.log") for i in range(2)]
    everything = "\n".join(node_logs)
    # both workers returned from main() with status 0 (torchrun's own status reports the signal)
    assert worker_exit_codes(tmp_path, "first") == {"rank0.rc": "0", "rank1.rc": "0"}, everything[-4000:]

    saved = sorted(int(p.name.split("-")[1]) for p in ckpt_root.glob("step-*"))
    assert len(saved) == 1 and 1 <= saved[0] < steps, (saved, everything[-4000:])
    stop_step = saved[0]
    folder = ckpt_root / f"step-{stop_step}"
    assert is_complete(folder)
    assert sorted(p.name for p in folder.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]  # both workers wrote
    # torchrun forwarded SIGTERM and both workers finished on their own: no SIGKILL, no traceback.
    for log in node_logs:
        assert "closing signal SIGTERM" in log
        assert "forcefully exiting" not in log and "Unable to shutdown" not in log
    assert re.search(rf"step +{stop_step}/\d+ \| preempted \|", everything)
    for text in worker_logs(tmp_path, "first"):
        assert "Traceback" not in text, text[-3000:]

    procs = start_nodes(tmp_path, "again", overrides, free_port(), **exit_entry_env(tmp_path, "again"))
    codes = wait_nodes(procs, timeout=PATIENCE_S)
    again = [read_text(tmp_path / f"again-node{i}.log") for i in range(2)]
    assert codes == [0, 0], "\n\n".join(x[-4000:] for x in again)
    assert worker_exit_codes(tmp_path, "again") == {"rank0.rc": "0", "rank1.rc": "0"}
    assert f"loaded checkpoint {folder}" in again[0]
    resumed = losses(run_dir)
    assert sorted(resumed) == list(range(1, steps + 1))  # steps 1..k from the first run, k+1.. from the second
    # the resumed steps continue exactly (same data position, optimizer and RNG state)
    assert {s: resumed[s] for s in range(1, 6)} == pytest.approx(single_process_losses, rel=0, abs=2e-5)
    assert is_complete(ckpt_root / f"step-{steps}")
