"""Hyper-Connections and mHC under the real trainer (`train.py`, debug flavor, CPU): 2 ranks (FSDP2,
gloo; the connection's parameters in the root unit, the n-stream state a block input) give the
losses of 1 rank within 1e-5 over 5 steps, and a run killed with SIGKILL once its step-2 checkpoint
is complete resumes from it and logs the uninterrupted run's losses bit for bit."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import PATIENCE_S, ROOT, metric_losses
from train_common import debug_argv

pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.processes]

FAMILIES = {"hyper": ["--model.residual=hyper"], "mhc": ["--model.residual=mhc"]}
STEPS = ["--training.steps=5", "--debug.deterministic=true", "--checkpoint.enable=true",
         "--checkpoint.interval=2", "--checkpoint.keep_latest_k=0"]
ONE_RANK = ["--training.local_batch_size=8", "--training.global_batch_size=8"]
TWO_RANKS = ["--training.local_batch_size=4", "--training.global_batch_size=8"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def train(root: Path, name: str, family: str, *extra: str, ranks: int = 1) -> subprocess.CompletedProcess:
    launcher = [str(Path(sys.executable).with_name("torchrun")), "--standalone", f"--nproc_per_node={ranks}"] \
        if ranks > 1 else [sys.executable]
    argv = debug_argv(root, name, *FAMILIES[family], *STEPS, *extra)
    proc = subprocess.run([*launcher, "train.py", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=PATIENCE_S, env=ENV)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def killed_after_step_2(root: Path, name: str, family: str) -> None:
    """Start the 1-rank run and SIGKILL it once its step-2 checkpoint is complete."""
    argv = debug_argv(root, name, *FAMILIES[family], *STEPS, *ONE_RANK)
    proc = subprocess.Popen([sys.executable, "train.py", *argv], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=ENV)
    done = root / name / "checkpoints" / "step-2" / "complete.json"
    try:
        deadline = time.monotonic() + PATIENCE_S
        while not done.exists():
            assert proc.poll() is None, "the run ended before its step-2 checkpoint"
            assert time.monotonic() < deadline, "the run never completed its step-2 checkpoint"
            time.sleep(0.1)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_two_ranks_equal_one_and_a_killed_run_resumes_bit_for_bit(tmp_path, family):
    train(tmp_path, "one", family, *ONE_RANK)
    reference = metric_losses(tmp_path / "one")
    assert len(reference) == 5 and reference[-1] < reference[0]
    train(tmp_path, "two", family, *TWO_RANKS, ranks=2)
    two = metric_losses(tmp_path / "two")
    assert len(two) == 5 and max(abs(a - b) for a, b in zip(two, reference)) <= 1e-5, (two, reference)
    killed_after_step_2(tmp_path, "killed", family)
    resumed = train(tmp_path, "killed", family, *ONE_RANK)
    assert "(resumed at 2)" in resumed.stdout and "loaded checkpoint" in resumed.stderr
    assert metric_losses(tmp_path / "killed") == reference  # bitwise, steps before and after the kill
