"""lm-eval the way its users run it (issue 24, acceptance 3; issue 32): our ``eval lm-eval`` command
on the local YAML tasks shipped in eval_tasks/, and lm-eval's own ``hf`` model on the folder the
export command writes, answer every request with the same log-likelihood (within 1e-4 nats) and
generate the same text (lm-eval batches and left-pads the prompts of ``shakespeare_continue``);
the results file is where ``--output-path`` says, printed, and names the run, checkpoint, step
and family.

Marked ``lm_eval``; needs the ``lm-eval`` extra (installed by ``make setup`` / ``.ci/run``).
"""
from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.lm_eval
lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("transformers")

from helpers import ROOT, trained_like_debug  # noqa: E402
from mhar_titan.convert.__main__ import main as convert_main  # noqa: E402
from mhar_titan.convert.dcp_io import save_model_dcp  # noqa: E402
from mhar_titan.eval.__main__ import main as eval_main  # noqa: E402
from mhar_titan.models import FAMILIES  # noqa: E402

TASKS = ["shakespeare_choice", "shakespeare_rolling"]
GENERATION = "shakespeare_continue"


def loglikelihoods(samples: list[dict]) -> dict[int, list[float]]:
    """doc_id -> the log-likelihood of each of its requests (lm-eval's ``resps``)."""
    out = {}
    for sample in samples:
        out[int(sample["doc_id"])] = [float(r[0][0] if isinstance(r[0], (list, tuple)) else r[0])
                                      for r in sample["resps"]]
    return out


@pytest.mark.parametrize("family", ["mhar H=8", "baseline"])
def test_our_adapter_and_lm_evals_hf_model_give_equal_loglikelihoods(tmp_path, monkeypatch, capsys, family):
    from lm_eval.tasks import TaskManager

    monkeypatch.chdir(ROOT)  # the task YAML files name their data relative to the repository root
    checkpoint = save_model_dcp(trained_like_debug(dict(FAMILIES[family]), 384), tmp_path / "run" / "checkpoints"
                                / "step-0", tokenizer="bytes")
    out = tmp_path / "results"
    assert eval_main(["lm-eval", str(checkpoint), "--tasks", ",".join(TASKS + [GENERATION]), "--include-path",
                      "eval_tasks", "--output-path", str(out), "--log-samples", "--batch-size", "4"]) == 0
    table = capsys.readouterr().out
    header = next(line for line in table.splitlines() if "Tasks" in line)  # lm-eval's markdown table
    assert "|Metric|" in header.replace(" ", "") and "shakespeare_choice" in table and "word_perplexity" in table
    (results_file,) = out.rglob("results_*.json")
    assert results_file.parent == out / "run_step-0"  # <run>_step-<N>, not a random name
    printed = [line for line in table.splitlines() if line.startswith(("results: ", "samples: "))]
    assert printed[0] == f"results: {results_file}"
    assert sorted(printed[1:]) == sorted(f"samples: {p}" for p in out.rglob("samples_*.jsonl")) and len(printed) == 4
    ours = {}
    for task in TASKS + [GENERATION]:
        (path,) = out.rglob(f"samples_{task}_*.jsonl")
        ours[task] = [json.loads(line) for line in path.read_text().splitlines()]

    assert convert_main(["export", str(checkpoint), str(tmp_path / "hf")]) == 0  # tokenizer from the checkpoint
    results = lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={tmp_path / 'hf'},trust_remote_code=True,dtype=float32",
        tasks=TASKS + [GENERATION], task_manager=TaskManager(include_path=["eval_tasks"], include_defaults=False),
        log_samples=True, batch_size=4, device="cpu")
    for task in TASKS:
        theirs, mine = loglikelihoods(results["samples"][task]), loglikelihoods(ours[task])
        assert sorted(theirs) == sorted(mine) and len(theirs) >= 4
        for doc, values in mine.items():
            assert values == pytest.approx(theirs[doc], abs=1e-4), (task, doc)
    # generation: prompts of 1 to 60 characters, batched by lm-eval (4 per batch, left padded)
    theirs = {s["doc_id"]: s["resps"][0][0] for s in results["samples"][GENERATION]}
    mine = {s["doc_id"]: s["resps"][0][0] for s in ours[GENERATION]}
    assert len(theirs) == 6 and theirs == mine and any(theirs.values())


def test_the_results_file_is_where_the_user_said_and_names_the_run(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    run = tmp_path / "my_run"
    checkpoint = save_model_dcp(trained_like_debug(dict(FAMILIES["block H=8"]), 384), run / "checkpoints" / "step-0",
                                tokenizer="bytes")
    target = tmp_path / "scores" / "block.json"
    target.parent.mkdir()
    assert eval_main(["lm-eval", str(run), "--tasks", GENERATION, "--include-path", "eval_tasks", "--limit", "2",
                      "--output-path", str(target)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"results: {target}"
    assert sorted(p.name for p in target.parent.iterdir()) == ["block.json"]
    results = json.loads(target.read_text())
    config = results["config"]
    assert config["model"] == "mhar_titan" and results["model_name"] == str(checkpoint)
    assert config["model_args"] == {"run": str(run), "checkpoint": str(checkpoint), "step": 0, "device": "cpu",
                                    "batch_size": 8}
    assert config["family"] == "block H=8" and config["tokenizer"] == "bytes"
    assert config["model_arguments"]["routing_granularity"] == "block"
    # a .json path that is a folder is refused before the model is loaded
    (tmp_path / "folder.json").mkdir()
    assert eval_main(["lm-eval", str(tmp_path / "no_run"), "--tasks", GENERATION, "--include-path", "eval_tasks",
                      "--output-path", str(tmp_path / "folder.json")]) == 2
    assert "folder.json is a folder; name a new .json file" in capsys.readouterr().err


def test_the_command_refuses_bad_task_options_before_loading(tmp_path, capsys):
    run = tmp_path / "missing_run"
    assert eval_main(["lm-eval", str(run), "--tasks", "shakespeare_choice", "--log-samples"]) == 2
    assert "--log-samples writes the samples under --output-path" in capsys.readouterr().err
    assert eval_main(["lm-eval", str(run), "--tasks", "x", "--include-path", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert f"--include-path {tmp_path / 'nowhere'} not found: pass a folder of lm-eval task YAML files" in err


def test_a_task_too_small_to_tell_models_apart_is_warned(tmp_path, monkeypatch, capsys):
    """shakespeare_choice has 8 examples (its accuracy prints 0 +/- 0 or 0.25 +/- 0.16): the command
    warns in one line."""
    monkeypatch.chdir(ROOT)
    checkpoint = save_model_dcp(trained_like_debug(dict(FAMILIES["baseline"]), 384), tmp_path / "run" / "checkpoints"
                                / "step-0", tokenizer="bytes")
    assert eval_main(["lm-eval", str(checkpoint), "--tasks", "shakespeare_choice", "--include-path", "eval_tasks"]) == 0
    warned = [line for line in capsys.readouterr().err.splitlines() if "warning:" in line]
    assert warned == ["python -m mhar_titan.eval lm-eval: warning: shakespeare_choice scored 8 examples, too few to tell "
                      "models apart: an accuracy from 8 examples is uncertain by up to +/-0.35 (95%), and its stderr is "
                      "0 whenever every example agrees; score at least 100 (a larger limit, or a larger task such as "
                      "shakespeare_next_line, 400 examples)"]  # enough examples, no warning: test_eval.py
