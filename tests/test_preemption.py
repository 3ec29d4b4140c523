"""PreemptionHandler in one process: the signals set the flag, nothing else happens.
Agreement across ranks and SIGTERM to real training runs (single process and torchrun)
are in test_checkpoint_e2e.py; SIGTERM through the two-node launcher in
test_launch_two_node.py. Ctrl-C (SIGINT) runs in a child process here, since a
second Ctrl-C must raise KeyboardInterrupt; one short ``train.py`` run with two
data-loader workers gets Ctrl-C as a terminal sends it, to its whole process group.
Stop signals sent to a loader's process group leave its workers serving batches."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from mhar_titan.checkpoint import is_complete, read_marker, step_folders
from mhar_titan.preemption import PreemptionHandler
from helpers import PATIENCE_S, ROOT, read_metrics
from train_common import debug_argv

pytestmark = pytest.mark.processes  # waits on child processes and signals

# A loop of "steps" that stops when should_stop() says so, like the trainer.
# "Saving" lasts until the test closes the child's stdin (after its second Ctrl-C, if any): an
# event, not a duration, so the second Ctrl-C lands inside it however slow the machine is.
CHILD = textwrap.dedent("""
    import sys, time
    from mhar_titan.preemption import PreemptionHandler
    handler = PreemptionHandler()
    print("ready", flush=True)
    deadline = time.monotonic() + 900  # a hang guard (the signal is sent right after "ready")
    while not handler.should_stop():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    print("stopped on", handler.received.name, flush=True)
    sys.stdin.read()  # "saving": a second Ctrl-C lands here
    print("saved", flush=True)
""")


def run_child(n_sigint: int) -> subprocess.CompletedProcess:
    proc = subprocess.Popen([sys.executable, "-c", CHILD], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"
    proc.send_signal(signal.SIGINT)
    if n_sigint == 2:
        assert proc.stdout.readline() == "stopped on SIGINT\n"
        proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=PATIENCE_S)  # closes stdin: the save ends, if still running
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_first_ctrl_c_stops_like_sigterm_and_says_how_to_abort():
    res = run_child(1)
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == ["stopped on SIGINT", "saved"]  # after "ready"
    notice = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(notice) == 1 and "press Ctrl-C again to abort without saving" in notice[0]


def test_second_ctrl_c_raises_keyboard_interrupt():
    res = run_child(2)
    assert res.returncode == -signal.SIGINT  # Python's exit after an uncaught KeyboardInterrupt
    assert "saved" not in res.stdout and "KeyboardInterrupt" in res.stderr


def test_ctrl_c_to_train_py_saves_a_complete_checkpoint_and_exits_0(tmp_path):
    # Two loader workers in the same process group: the terminal's Ctrl-C reaches them too.
    argv = debug_argv(tmp_path, "ctrl_c", "--training.steps=500", "--checkpoint.enable=true",
                      "--checkpoint.interval=1000", "--data.num_workers=2")
    proc = subprocess.Popen([sys.executable, "train.py", *argv], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    metrics = tmp_path / "ctrl_c" / "metrics.jsonl"
    deadline = time.monotonic() + PATIENCE_S
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()[-3000:]
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C does: the whole foreground process group
    out, _ = proc.communicate(timeout=PATIENCE_S)
    assert proc.returncode == 0, out[-3000:]
    assert "DataLoader worker" not in out
    assert "press Ctrl-C again to abort without saving" in out and "Traceback" not in out
    steps = step_folders(tmp_path / "ctrl_c" / "checkpoints")
    assert len(steps) == 1 and 2 <= min(steps) < 500
    (step, folder), = steps.items()
    assert is_complete(folder) and read_marker(folder)["step"] == step
    rows = read_metrics(metrics.parent)
    assert max(r["step"] for r in rows if "loss" in r) == step  # saved the last finished step


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_signal_sets_should_stop_and_restore_reinstalls_previous(sig):
    previous = signal.getsignal(sig)
    handler = PreemptionHandler()
    try:
        assert handler.should_stop() is False
        os.kill(os.getpid(), sig)  # the process survives: the handler only records it
        assert handler.should_stop() is True
        assert handler.received == sig
    finally:
        handler.restore()
    assert signal.getsignal(sig) is previous


def test_only_the_chosen_signals_are_handled():
    handler = PreemptionHandler(signals=(signal.SIGUSR1,))
    try:
        assert signal.getsignal(signal.SIGTERM) is not handler._on_signal
        os.kill(os.getpid(), signal.SIGUSR1)
        assert handler.should_stop()
    finally:
        handler.restore()


# A loader with two workers in its own process group; the "training step" needs 3 more batches
# after the stop signal, as a step with gradient accumulation 3 would. "ready" is an event, not a
# moment: it is printed once each worker has served a batch (the DataLoader takes batches from the
# workers in turn), so both have run their init and handle stop signals; the test waits for it.
LOADER_CHILD = textwrap.dedent("""
    import sys
    from mhar_titan.data import DataConfig, build_tokenizer, build_train_loader
    from mhar_titan.preemption import PreemptionHandler
    cfg = DataConfig(files=[sys.argv[1]], num_workers=2)
    loader = build_train_loader(cfg, build_tokenizer(cfg), dp_rank=0, dp_world=1, local_batch_size=2,
                                seq_len=16, seed=0)
    handler = PreemptionHandler()
    it = iter(loader)
    for _ in range(cfg.num_workers):  # one batch from every worker
        next(it)
    print("ready", flush=True)
    while not handler.should_stop():
        next(it)
    for _ in range(3):
        next(it)
    state = loader.state_dict()
    print("finished the step after", handler.received.name, "at batch", loader.batches_done, flush=True)
""")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])  # SIGINT: the Ctrl-C test above
def test_stop_signal_to_the_process_group_leaves_loader_workers_serving(sig):
    proc = subprocess.Popen([sys.executable, "-c", LOADER_CHILD, str(ROOT / "data/shakespeare/validation-00000-of-00001.parquet")],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    assert proc.stdout.readline() == "ready\n"  # blocks until the child says so: no timing
    os.killpg(proc.pid, sig)
    out, err = proc.communicate(timeout=PATIENCE_S)  # a hang guard only; the child ends on its own
    assert proc.returncode == 0, err[-3000:]
    assert out.startswith(f"finished the step after {sig.name} at batch "), err[-3000:]
    assert "DataLoader worker" not in err


@pytest.mark.slow  # a training process and two signals
def test_a_second_ctrl_c_aborts_train_py_in_one_line_naming_what_was_saved(tmp_path):
    """The second Ctrl-C (sent once the first one's notice is printed, while the step it finishes
    runs) ends train.py without saving, in one line naming the newest complete checkpoint, not a
    traceback; the process dies of SIGINT as Python's own abort does, and the run folder is unlocked."""
    argv = debug_argv(tmp_path, "abort", "--training.steps=500", "--checkpoint.enable=true",
                      "--checkpoint.interval=1", "--checkpoint.keep_latest_k=0", "--training.local_batch_size=16",
                      "--training.seq_len=128")  # a step of seconds: the second Ctrl-C lands inside it
    proc = subprocess.Popen([sys.executable, "train.py", *argv], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    run = tmp_path / "abort"
    deadline = time.monotonic() + PATIENCE_S
    while not any(is_complete(p) for p in step_folders(run / "checkpoints").values()):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGINT)
    lines = []
    for line in proc.stdout:  # the event: the first Ctrl-C's notice
        lines.append(line)
        if "press Ctrl-C again to abort without saving" in line:
            break
    os.killpg(proc.pid, signal.SIGINT)
    out = "".join(lines) + proc.stdout.read()
    proc.wait(timeout=PATIENCE_S)
    assert proc.returncode == -signal.SIGINT, out[-3000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out
    aborted = [line for line in out.splitlines() if line.startswith("training aborted")]
    newest = max(s for s, p in step_folders(run / "checkpoints").items() if is_complete(p))
    assert aborted == [f"training aborted at step {aborted[0].split()[4]} (Ctrl-C): nothing more was saved; the "
                       f"newest complete checkpoint is {run / 'checkpoints' / f'step-{newest}'}: the same command "
                       f"resumes from step {newest}"], out[-2000:]
    from mhar_titan.components.run_folder import RunFolder
    from mhar_titan.config import load_config

    folder = RunFolder(load_config(None, argv))
    folder.lock()  # the aborted run let go of it
    folder.unlock()
