"""In-training downstream evaluation (``[eval]``, ``components/downstream.py``): its numbers at the last
step equal a standalone ``python -m mhar_titan.eval lm-eval`` of the saved checkpoint (accuracies
exactly, log-likelihood metrics within 1e-6 relative) on 1 and 2 ranks; they reach the JSONL file,
TensorBoard and wandb; the training losses are bitwise those of the same run without it; the time
budget admits zero or a counted number of forwards on a clock the test controls; model mode and
random generators are untouched. Marked ``lm_eval``."""
from __future__ import annotations

import json
import pathlib

import pytest
import torch

pytestmark = pytest.mark.lm_eval
pytest.importorskip("lm_eval")

from helpers import ROOT, metric_losses, read_metrics  # noqa: E402
from train_common import debug_cfg  # noqa: E402

from mhar_titan.eval.__main__ import main as eval_main  # noqa: E402
from mhar_titan.train import Trainer, run_training  # noqa: E402

TASKS = ["shakespeare_choice", "shakespeare_rolling"]
PERPLEXITIES = ("word_perplexity", "byte_perplexity", "bits_per_byte")


def eval_args(*extra):
    return ["--eval.enable=true", f"--eval.tasks={','.join(TASKS)}", "--eval.include_path=eval_tasks",
            "--eval.local_batch_size=4", *extra]


def standalone(checkpoint: pathlib.Path, out: pathlib.Path, batch_size: int = 8) -> dict:
    """The command's results of the tasks on a checkpoint: {"eval/<task>/<metric>": value}."""
    assert eval_main(["lm-eval", str(checkpoint), "--tasks", ",".join(TASKS), "--include-path", "eval_tasks",
                      "--output-path", str(out), "--batch-size", str(batch_size)]) == 0
    (path,) = out.rglob("results_*.json")
    results = json.loads(path.read_text())["results"]
    return {f"eval/{task}/{key.split(',')[0]}": float(v) for task in TASKS for key, v in results[task].items()
            if key.endswith(",none") and "_stderr" not in key}


def assert_equal_to_standalone(logged: dict, reference: dict) -> None:
    assert {k for k in logged if k.count("/") == 2} == set(reference)
    for key, value in reference.items():
        if key.endswith("/acc"):
            assert logged[key] == value, key  # accuracies exactly
        else:
            assert logged[key] == pytest.approx(value, rel=1e-6, abs=0), key  # log-likelihood metrics


@pytest.mark.slow  # two 4-step debug runs, two evaluations and a standalone one: ~23 s CPU, 125 s wall on busy cores
def test_last_step_equals_standalone_loss_curve_unchanged_and_every_sink_gets_it(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from test_metrics import read_wandb_history

    monkeypatch.chdir(ROOT)  # the task YAML files name their data relative to the repository root
    common = ["--training.steps=4", "--checkpoint.enable=true", "--checkpoint.interval=4"]
    run_training(debug_cfg(tmp_path, "plain", *common))
    run_training(debug_cfg(tmp_path, "evaluated", *common, *eval_args("--eval.freq=3"),
                           "--metrics.enable_tensorboard=true", "--metrics.enable_wandb=true"))
    assert metric_losses(tmp_path / "evaluated") == metric_losses(tmp_path / "plain")  # bitwise
    assert len(metric_losses(tmp_path / "plain")) == 4
    rows = {r["step"]: r for r in read_metrics(tmp_path / "evaluated") if "eval/sequences" in r}
    assert sorted(rows) == [3, 4]  # every eval.freq steps and the last
    last = rows[4]
    assert last["eval/tasks_over_budget"] == 0 and last["eval/sequences"] >= 24 + 4  # 8 x 3 choices, 4 passages
    assert_equal_to_standalone(last, standalone(tmp_path / "evaluated" / "checkpoints" / "step-4", tmp_path / "sa"))
    assert rows[3]["eval/shakespeare_choice/acc"] in {i / 8 for i in range(9)}

    acc = EventAccumulator(str(tmp_path / "evaluated" / "tb"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("eval/shakespeare_choice/acc")] == \
        [(s, pytest.approx(rows[s]["eval/shakespeare_choice/acc"])) for s in (3, 4)]
    history = {r["_step"]: r for r in read_wandb_history(str(tmp_path / "evaluated")) if "eval/sequences" in r}
    assert history[4]["eval/shakespeare_rolling/bits_per_byte"] == last["eval/shakespeare_rolling/bits_per_byte"]


def test_the_time_budget_admits_zero_or_a_counted_number_of_forwards(tmp_path, monkeypatch):
    """The clock is the number of evaluation forwards so far: a budget of b units admits exactly
    ceil(b) forwards, whatever the machine's speed. Model mode and random generators come back."""
    monkeypatch.chdir(ROOT)
    trainer = Trainer(debug_cfg(tmp_path, "budget", *eval_args()))
    try:
        forwards = [0]
        trainer.model.register_forward_hook(lambda m, i, o: forwards.__setitem__(0, forwards[0] + (not m.training)))
        trainer.downstream.clock = lambda: float(forwards[0])
        budget = trainer.downstream.cfg
        trainer.model.train()
        rng = torch.get_rng_state()

        full = trainer.downstream.evaluate(trainer.model)
        assert trainer.model.training and torch.equal(torch.get_rng_state(), rng)
        assert full["eval/tasks_over_budget"] == 0
        choice_forwards = 24 // 4  # 8 questions x 3 choices in forwards of 4

        cases = {0.0: (0, 0, 2), 2.5: (3, 12, 2), choice_forwards + 1.5: (choice_forwards + 2, None, 1)}
        for seconds, (n_forwards, sequences, over) in cases.items():
            budget.time_budget_s = seconds
            forwards[0] = 0
            row = trainer.downstream.evaluate(trainer.model)
            assert forwards[0] == n_forwards, seconds
            assert row["eval/tasks_over_budget"] == over, seconds
            if sequences is not None:
                assert row["eval/sequences"] == sequences
            logged = {k for k in row if k.count("/") == 2}
            if over == 1:  # the first task within the budget: logged, the same numbers
                assert logged == {"eval/shakespeare_choice/acc"}
                assert row["eval/shakespeare_choice/acc"] == full["eval/shakespeare_choice/acc"]
                assert row["eval/sequences"] > 24
            else:
                assert logged == set()
            assert trainer.model.training and torch.equal(torch.get_rng_state(), rng)
    finally:
        trainer.close()


def test_a_generation_task_or_a_missing_task_folder_is_refused_before_the_model_is_built(tmp_path, monkeypatch):
    from mhar_titan.components.downstream import DownstreamEvalError

    monkeypatch.chdir(ROOT)
    folder = tmp_path / "tasks"
    folder.mkdir()
    (folder / "gen.yaml").write_text(
        "task: local_gen\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: "
        f"{ROOT / 'eval_tasks' / 'shakespeare' / 'choice.jsonl'}\ntest_split: test\noutput_type: generate_until\n"
        "doc_to_text: '{{context}}'\ndoc_to_target: '{{answer}}'\nmetric_list:\n  - metric: exact_match\n")
    built = []
    monkeypatch.setattr("mhar_titan.train.build_model", lambda *a: built.append(a))
    with pytest.raises(DownstreamEvalError, match="task local_gen is a generate_until task; in training only"):
        Trainer(debug_cfg(tmp_path, "gen", "--eval.enable=true", "--eval.tasks=local_gen",
                          f"--eval.include_path={folder}"))
    with pytest.raises(DownstreamEvalError, match=r"\[eval\]: eval.include_path .*nowhere not found: pass a folder of "
                       "lm-eval task YAML files"):
        Trainer(debug_cfg(tmp_path, "missing", *eval_args(f"--eval.include_path={tmp_path / 'nowhere'}")))
    (tmp_path / "a_file").write_text("not a folder\n")  # a file where the folder goes is named so
    with pytest.raises(DownstreamEvalError, match=r"\[eval\]: eval.include_path .*a_file is a file, not a folder"):
        Trainer(debug_cfg(tmp_path, "file", *eval_args(f"--eval.include_path={tmp_path / 'a_file'}")))
    assert built == []


# two 2-rank torchrun trainings with evaluation: about 60 s on 2 busy cores
def test_two_ranks_equal_standalone_and_leave_the_losses_unchanged(tmp_path, monkeypatch, torchrun):
    proc = torchrun(ROOT / "tests" / "downstream_eval_worker.py", tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert metric_losses(tmp_path / "evaluated") == metric_losses(tmp_path / "plain")
    (last,) = [r for r in read_metrics(tmp_path / "evaluated") if "eval/sequences" in r]
    assert last["step"] == 4 and last["eval/tasks_over_budget"] == 0
    monkeypatch.chdir(ROOT)
    assert_equal_to_standalone(last, standalone(tmp_path / "evaluated" / "checkpoints" / "step-4", tmp_path / "sa"))
