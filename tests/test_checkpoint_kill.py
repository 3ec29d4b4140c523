"""Acceptance 3: SIGKILL in the middle of a save leaves the previous checkpoint loadable,
and the next start resumes from it and names the skipped folder (tests/ckpt_kill_worker.py)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from helpers import PATIENCE_S, ROOT

pytestmark = pytest.mark.processes  # waits on a child process, then kills it
WORKER = ROOT / "tests" / "ckpt_kill_worker.py"


def test_sigkill_during_save_keeps_previous_checkpoint(tmp_path):
    proc = subprocess.Popen([sys.executable, str(WORKER), "kill", str(tmp_path)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + PATIENCE_S
        while not (tmp_path / "blocked").exists():
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "the worker never reached the blocked save"
            time.sleep(0.2)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stderr.close()
    step2, step4 = (tmp_path / "checkpoints" / f"step-{s}" for s in (2, 4))
    assert (step2 / "complete.json").is_file()
    assert any(step4.glob("*.distcp")) and not (step4 / "complete.json").exists()  # killed mid-save

    proc = subprocess.run([sys.executable, str(WORKER), "resume", str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=PATIENCE_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "resume.json").read_text())
    assert report["resumed_step"] == 2
    assert report["lr_after"] == [1e-2]  # the schedule continued from step 2: (4 + 1) / 4 capped at 1
    assert f"skipping incomplete checkpoint folder {step4}" in proc.stderr
    assert report["step4_complete"]  # step 4 was saved again, completely
