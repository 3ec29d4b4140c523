"""A stop signal during long work inside the training loop (validation, the ``[eval]`` tasks) ends
that work before its next forward, saves the step's checkpoint and stops the run (exit status 0),
and the resumed run does the stopped evaluation first, then trains exactly as a run that was never
stopped: the same losses and the same validation and evaluation rows (``mhar_titan.preemption``).

The signal is real (``os.kill`` of this process with SIGTERM, recorded by the trainer's handler) and
is sent at a chosen point of the work (when a validation batch is read, or when the evaluation's
budget clock is read before a forward): events, not durations, so the verdict does not depend on
the machine's speed."""
from __future__ import annotations

import os
import signal

import pytest

from helpers import ROOT, metric_losses, read_metrics
from train_common import debug_cfg

from mhar_titan.checkpoint import is_complete, step_folders
from mhar_titan.train import Trainer, check_config, run_training

pytestmark = pytest.mark.processes  # sends signals

COMMON = ("--training.steps=4", "--checkpoint.enable=true", "--checkpoint.interval=100")


def _stopped_run(cfg, arm) -> Trainer:
    """Train ``cfg`` after ``arm(trainer)`` set up the signal; returns the closed trainer."""
    trainer = Trainer(cfg, check_config(cfg))
    try:
        arm(trainer)
        trainer.train()
    finally:
        trainer.close()
    return trainer


def _val_losses(run_dir) -> dict:
    return {r["step"]: r["val_loss"] for r in read_metrics(run_dir) if "val_loss" in r}


def _assert_saved_at(run_dir, step: int) -> None:
    steps = step_folders(run_dir / "checkpoints")
    assert list(steps) == [step] and is_complete(steps[step])


def test_stop_signal_during_validation_ends_it_within_one_forward_and_the_resume_is_exact(tmp_path, capsys):
    args = (*COMMON, "--validation.enable=true", "--validation.freq=2", "--validation.sequences=6",
            "--validation.local_batch_size=1")
    run_training(debug_cfg(tmp_path, "straight", *args))
    read = []

    def arm(trainer):
        source = trainer.val_loader[""]

        class SignalOnSecondBatch:  # the validation set, sending SIGTERM as its second batch is read
            def __iter__(self):
                for i, batch in enumerate(source):
                    read.append(i)
                    if i == 1:
                        os.kill(os.getpid(), signal.SIGTERM)
                    yield batch

        trainer.val_loader[""] = SignalOnSecondBatch()

    capsys.readouterr()
    stopped = _stopped_run(debug_cfg(tmp_path, "stopped", *args), arm)
    out = capsys.readouterr().out
    assert stopped.preempted and stopped.state.step == 2
    assert read == [0, 1]  # the signal came as batch 1 was read: it was not scored, nor anything after it
    assert "| validation stopped | stop signal: not logged; the resumed run does it first" in out
    assert "| preempted | signal SIGTERM | checkpoint saved" in out
    _assert_saved_at(tmp_path / "stopped", 2)
    assert not [r for r in read_metrics(tmp_path / "stopped") if "val_loss" in r]  # the partial loss is not logged

    run_training(debug_cfg(tmp_path, "stopped", *args))  # the resume: step 2's validation first
    assert metric_losses(tmp_path / "stopped") == metric_losses(tmp_path / "straight")  # bitwise, steps 1-4
    assert _val_losses(tmp_path / "stopped") == _val_losses(tmp_path / "straight")
    assert sorted(_val_losses(tmp_path / "straight")) == [2, 4]


@pytest.mark.lm_eval
def test_stop_signal_during_in_training_evaluation_ends_it_within_one_forward(tmp_path, monkeypatch, capsys):
    pytest.importorskip("lm_eval")
    monkeypatch.chdir(ROOT)  # the task YAML files name their data relative to the repository root
    args = (*COMMON, "--eval.enable=true", "--eval.tasks=shakespeare_choice", "--eval.include_path=eval_tasks",
            "--eval.freq=2", "--eval.limit=3", "--eval.local_batch_size=1", "--eval.time_budget_s=1e9")
    run_training(debug_cfg(tmp_path, "straight", *args))
    reads = []

    def arm(trainer):
        clock = trainer.downstream.clock

        def signalling_clock():  # read at the evaluation's start, then before every forward
            reads.append(clock())
            if len(reads) == 3:  # before the second forward
                os.kill(os.getpid(), signal.SIGTERM)
            return reads[-1]

        trainer.downstream.clock = signalling_clock

    capsys.readouterr()
    stopped = _stopped_run(debug_cfg(tmp_path, "stopped", *args), arm)
    out = capsys.readouterr().out
    assert stopped.preempted and stopped.state.step == 2
    assert len(reads) == 3  # no forward after the one the signal followed
    assert "| [eval] stopped | stop signal: not logged; the resumed run does it first" in out
    _assert_saved_at(tmp_path / "stopped", 2)
    assert not [r for r in read_metrics(tmp_path / "stopped") if any(k.startswith("eval/") for k in r)]

    run_training(debug_cfg(tmp_path, "stopped", *args))  # the resume
    assert metric_losses(tmp_path / "stopped") == metric_losses(tmp_path / "straight")  # bitwise, steps 1-4

    def evals(name):  # step -> the task metrics (eval/seconds differs from run to run)
        return {r["step"]: {k: v for k, v in r.items() if k.startswith("eval/shakespeare")}
                for r in read_metrics(tmp_path / name) if "eval/sequences" in r}

    assert evals("stopped") == evals("straight") and sorted(evals("straight")) == [2, 4]  # step 2's done first


# three 2-rank torchrun trainings: about a minute on 2 busy cores
def test_a_signal_on_one_rank_stops_every_rank_within_the_same_validation_forward(tmp_path, torchrun):
    import json

    proc = torchrun(ROOT / "tests" / "preemption_long_work_worker.py", tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"read-{r}.json").read_text()) for r in (0, 1)]
    # rank 0 got no signal: it stopped at the same batch as rank 1, after one forward of its 6
    assert ranks == [{"read": [0, 1], "step": 2, "preempted": True}] * 2
    assert metric_losses(tmp_path / "stopped") == metric_losses(tmp_path / "straight")  # the resume is exact
    assert _val_losses(tmp_path / "stopped") == _val_losses(tmp_path / "straight")  # step 2's done first
