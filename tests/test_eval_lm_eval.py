"""lm-eval the way its users run it (issue 24, acceptance 3): our ``eval lm-eval`` command on the
local YAML tasks shipped in eval_tasks/, and lm-eval's own ``hf`` model on the folder the export
command writes, answer every request with the same log-likelihood (within 1e-4 nats).

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
    assert eval_main(["lm-eval", str(checkpoint), "--tasks", ",".join(TASKS), "--include-path", "eval_tasks",
                      "--output-path", str(out), "--log-samples", "--batch-size", "4"]) == 0
    table = capsys.readouterr().out
    header = next(line for line in table.splitlines() if "Tasks" in line)  # lm-eval's markdown table
    assert "|Metric|" in header.replace(" ", "") and "shakespeare_choice" in table and "word_perplexity" in table
    assert len(list(out.rglob("results_*.json"))) == 1
    ours = {}
    for task in TASKS:
        (path,) = out.rglob(f"samples_{task}_*.jsonl")
        ours[task] = loglikelihoods([json.loads(line) for line in path.read_text().splitlines()])

    assert convert_main(["export", str(checkpoint), str(tmp_path / "hf")]) == 0  # tokenizer from the checkpoint
    results = lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={tmp_path / 'hf'},trust_remote_code=True,dtype=float32", tasks=TASKS,
        task_manager=TaskManager(include_path=["eval_tasks"], include_defaults=False), log_samples=True, batch_size=4, device="cpu")
    for task in TASKS:
        theirs = loglikelihoods(results["samples"][task])
        assert sorted(theirs) == sorted(ours[task]) and len(theirs) >= 4
        for doc, values in ours[task].items():
            assert values == pytest.approx(theirs[doc], abs=1e-4), (task, doc)


def test_the_command_refuses_bad_task_options_before_loading(tmp_path, capsys):
    run = tmp_path / "missing_run"
    assert eval_main(["lm-eval", str(run), "--tasks", "shakespeare_choice", "--log-samples"]) == 2
    assert "--log-samples writes the samples under --output-path" in capsys.readouterr().err
    assert eval_main(["lm-eval", str(run), "--tasks", "x", "--include-path", str(tmp_path / "nowhere")]) == 2
    assert "is not a folder of lm-eval task YAML files" in capsys.readouterr().err
