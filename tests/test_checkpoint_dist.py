"""CheckpointManager under FSDP2 on gloo with the debug-flavor MHAR model (3 torchrun
launches + 2 single-process runs of tests/ckpt_fsdp_worker.py, about 1.5 min on 2 cores).

Shows: resharding 2 -> 1 -> 2 ranks restores every model and optimizer tensor bitwise;
an async save on its gloo group overlaps training and equals a synchronous save; keys
of activation-checkpointed blocks are the plain model's; SIGKILL in the middle of a
save leaves the previous checkpoint loadable and the next start names the skipped
folder; should_stop() agrees across ranks.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_checkpoint import assert_same_checkpoint

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "ckpt_fsdp_worker.py"
PY = sys.executable
TORCHRUN = str(Path(PY).with_name("torchrun"))

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def launch(phase: str, out: Path, nproc: int | None) -> dict:
    cmd = [PY, str(WORKER), phase, str(out)]
    if nproc is not None:
        cmd = [TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", *cmd[1:]]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    report = out / f"{phase}.json"
    assert report.is_file(), f"{phase} failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads(report.read_text())


@pytest.fixture(scope="module")
def reshard_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("reshard")
    return out, launch("save2", out, 2), launch("load1", out, 1), launch("load2", out, 2)


def test_reshard_restores_every_tensor(reshard_runs):
    _, _, load1, load2 = reshard_runs
    for report in (load1, load2):  # saved at 2 ranks -> loaded at 1; saved at 1 -> loaded at 2
        assert report["loaded_step"] == 3 and report["train_state_step"] == 3
        assert report["n_tensors"] > 40
        assert report["mismatched"] == []


def test_keys_are_the_plain_models(reshard_runs):
    _, save2, _, _ = reshard_runs
    from mhar_titan.models.args import ModelArgs
    from mhar_titan.models.model import Transformer
    import torch

    with torch.device("meta"):
        plain = Transformer(ModelArgs.from_flavor("debug", vocab_size=512, max_seq_len=16,
                                                  residual="attn_res", routing_heads=2))
    assert save2["keys"] == sorted(plain.state_dict())


def test_async_save_on_gloo_group_equals_sync_save(reshard_runs, tmp_path):
    out, save2, _, _ = reshard_runs
    assert save2["steps_done_in_flight"] == [True, True]  # steps 5 and 6 ran during the save
    assert save2["step4_complete"]
    assert_same_checkpoint(out / "a" / "checkpoints" / "step-4", out / "sync" / "checkpoints" / "step-4", tmp_path)


def test_should_stop_agrees_across_ranks(reshard_runs):
    _, save2, _, _ = reshard_runs
    assert save2["stop_before_signal"] is False
    assert save2["stop_after_signal"] is True and save2["rank0_received"] is False


def test_sigkill_during_save_keeps_previous_checkpoint(tmp_path):
    proc = subprocess.Popen([PY, str(WORKER), "kill", str(tmp_path)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "blocked").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "worker never reached the blocked save"
            time.sleep(0.2)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    step4 = tmp_path / "checkpoints" / "step-4"
    assert any(step4.glob("*.distcp")) and not (step4 / "complete.json").exists()  # really mid-save

    proc = subprocess.run([PY, str(WORKER), "resume", str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "resume.json").read_text())
    assert report["resumed_step"] == 2 and report["train_state_step"] == 2
    assert f"skipping incomplete checkpoint folder {step4}" in proc.stderr
    assert report["step4_complete"]  # the step was saved again, completely
