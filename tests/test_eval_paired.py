"""Paired downstream evaluation (``python -m mhar_titan.eval paired``): the exact McNemar p-value and
the bootstrap interval against values computed independently here (exact binomial sums with
integers, the exact bootstrap distribution of a tiny sample by enumeration), on hand-made paired
answers with ties, all-equal answers and tiny samples; the refusal of different example sets;
the command on two real debug checkpoints and a local task (marked ``lm_eval``)."""
from __future__ import annotations

import itertools
import json
import math
from fractions import Fraction

import numpy as np
import pytest

pytest.importorskip("scipy")

from mhar_titan.eval.paired import (  # noqa: E402
    ExampleSetError, bootstrap_interval, mcnemar_p, pair_results, pair_task,
)


def exact_mcnemar(b: int, c: int) -> Fraction:
    """Two-sided exact binomial test of b vs c discordant pairs at p = 1/2, in exact fractions: the
    probability of an outcome at most as likely as the observed one (symmetric: twice the smaller tail)."""
    n = b + c
    if n == 0:
        return Fraction(1)
    observed = math.comb(n, b)
    return min(Fraction(1), Fraction(sum(math.comb(n, k) for k in range(n + 1) if math.comb(n, k) <= observed), 2**n))


def samples(values, metric="acc", docs=None, prompt="p"):
    """lm-eval per-example logs of one task: one row per value (document i, filter "none")."""
    docs = docs if docs is not None else range(len(values))
    return [{"doc_id": i, "doc_hash": f"doc{i}", "prompt_hash": f"{prompt}{i}", "target_hash": f"t{i}",
             "filter": "none", "metrics": [metric], metric: v} for i, v in zip(docs, values)]


# hand-made paired answers (1 = right): A, B, and the discordant counts read off them by hand
ANSWERS = {
    "B better": ([1, 0, 0, 1, 0, 0, 1, 0, 0, 0, 1, 0], [1, 1, 1, 1, 0, 1, 1, 1, 0, 1, 1, 1], 0, 6),
    "ties": ([1, 0, 1, 0, 1, 1], [0, 1, 0, 1, 1, 1], 2, 2),
    "all equal": ([1, 0, 1, 1, 0], [1, 0, 1, 1, 0], 0, 0),
    "one example": ([0], [1], 0, 1),
    "two examples": ([1, 0], [0, 0], 1, 0),
    "A always right": ([1] * 6, [0] * 6, 6, 0),
}


@pytest.mark.parametrize("case", ANSWERS)
def test_discordant_counts_and_mcnemar_p_of_hand_made_answers(case):
    a, b, a_only, b_only = ANSWERS[case]
    (row,) = pair_task("t", samples(a), samples(b), {}, {}, resamples=2000)
    assert (row.n, row.a_only, row.b_only) == (len(a), a_only, b_only)
    assert row.a == sum(a) / len(a) and row.b == sum(b) / len(b) and row.diff == pytest.approx(row.b - row.a)
    assert row.p_value == pytest.approx(float(exact_mcnemar(b_only, a_only)), rel=1e-12)
    assert row.paired and row.note == ""


@pytest.mark.parametrize("b,c", [(0, 0), (3, 3), (0, 1), (1, 9), (9, 1), (2, 10), (12, 30), (0, 25), (40, 41)])
def test_mcnemar_p_equals_the_exact_binomial_sum(b, c):
    assert mcnemar_p(b, c) == pytest.approx(float(exact_mcnemar(c, b)), rel=1e-12)
    assert mcnemar_p(b, c) == mcnemar_p(c, b)  # symmetric
    if b == c:
        assert mcnemar_p(b, c) == 1.0


def test_mcnemar_refuses_negative_counts():
    with pytest.raises(ValueError, match="must be >= 0"):
        mcnemar_p(-1, 3)


def exact_bootstrap_quantiles(d: list[int], level: float) -> tuple[float, float, float]:
    """The exact bootstrap distribution of the mean of n draws with replacement from ``d`` (values
    in {-1, 0, 1}), by enumerating the multinomial counts of +1 and -1 draws; returns its
    (1-level)/2 and (1+level)/2 quantiles and the smallest distance of its CDF from those levels."""
    n = len(d)
    p_plus, p_minus = Fraction(d.count(1), n), Fraction(d.count(-1), n)
    p_zero = 1 - p_plus - p_minus
    pmf = {}
    for k_plus in range(n + 1):
        for k_minus in range(n + 1 - k_plus):
            k_zero = n - k_plus - k_minus
            ways = math.factorial(n) // (math.factorial(k_plus) * math.factorial(k_minus) * math.factorial(k_zero))
            mass = ways * p_plus**k_plus * p_minus**k_minus * p_zero**k_zero
            mean = Fraction(k_plus - k_minus, n)
            pmf[mean] = pmf.get(mean, 0) + mass
    support = sorted(pmf)
    cdf = list(itertools.accumulate(pmf[v] for v in support))
    lo_level, hi_level = Fraction(1, 2) - Fraction(level) / 2, Fraction(1, 2) + Fraction(level) / 2
    lo = next(v for v, c in zip(support, cdf) if c >= lo_level)
    hi = next(v for v, c in zip(support, cdf) if c >= hi_level)
    margin = min(min(abs(c - lo_level), abs(c - hi_level)) for c in cdf)
    return float(lo), float(hi), float(margin)


@pytest.mark.parametrize("d", [[1, -1, 0], [1, 0, 0, 1, -1], [1, 0, 1, 0, -1, 0, 1, 1, 0, 0],
                               [1, 0, 0, -1, 1, 1, 0, 0, 1, -1, 0, 1]])
def test_bootstrap_interval_lands_on_the_exact_bootstrap_quantiles(d):
    """With many resamples the percentile interval is the exact bootstrap distribution's quantiles,
    computed here by enumeration (cases chosen so that no CDF value lies within 0.004 of 2.5% or
    97.5%: 100,000 resamples put the empirical CDF within 0.0005, one standard deviation)."""
    lo, hi, margin = exact_bootstrap_quantiles(d, 0.95)
    assert margin > 0.004
    assert bootstrap_interval(d, resamples=100_000, seed=3) == pytest.approx((lo, hi), abs=1e-12)


def test_bootstrap_interval_is_seeded_and_degenerate_where_it_must_be():
    d = [1, 0, -1, 1, 1, 0, 0, 1, -1, 1]
    assert bootstrap_interval(d, 5000, seed=7) == bootstrap_interval(d, 5000, seed=7)
    assert bootstrap_interval([0, 0, 0, 0], 100) == (0.0, 0.0)  # all-equal answers
    assert bootstrap_interval([-1, -1, -1], 100) == (-1.0, -1.0)
    assert bootstrap_interval([1], 100) == (1.0, 1.0)  # one example
    low, high = bootstrap_interval(d, 5000)
    assert low <= np.mean(d) <= high
    with pytest.raises(ValueError, match="no paired example"):
        bootstrap_interval([], 100)


def test_a_per_example_metric_that_is_not_binary_is_paired_without_mcnemar():
    a, b = [0.5, 0.25, 1.0, 0.0], [0.75, 0.25, 1.0, 0.5]
    (row,) = pair_task("t", samples(a, "f1_like"), samples(b, "f1_like"), {}, {}, resamples=2000)
    assert row.paired and row.p_value is None and row.a_only is None and "no McNemar" in row.note
    assert row.diff == pytest.approx(0.1875)
    assert (row.ci_low, row.ci_high) == bootstrap_interval(np.subtract(b, a), 2000, 0)


def test_a_corpus_level_metric_is_reported_unpaired_and_says_so():
    """Perplexity-type metrics log (log-likelihood, words) pieces per example; lm-eval aggregates them."""
    a = samples([[-10.0, 3], [-12.0, 4]], "word_perplexity")
    b = samples([[-9.0, 3], [-11.5, 4]], "word_perplexity")
    (row,) = pair_task("t", a, b, {"word_perplexity,none": 25.0}, {"word_perplexity,none": 20.0})
    assert not row.paired and row.n == 0 and (row.a, row.b, row.diff) == (25.0, 20.0, -5.0)
    assert row.p_value is None and row.ci_low is None and "unpaired" in row.note


def test_different_example_sets_are_refused_naming_the_difference():
    with pytest.raises(ExampleSetError, match=r"different example sets \(4 examples in A, 3 in B; 1 only in A"):
        pair_task("choice", samples([1, 0, 1, 1]), samples([1, 0, 1]), {}, {})
    with pytest.raises(ExampleSetError, match="doc_id 2 filter 'none' only in A"):
        pair_task("choice", samples([1, 0, 1]), samples([1, 0, 1], docs=[0, 1, 5]), {}, {})
    other_doc = samples([1, 0, 1])
    other_doc[1]["doc_hash"] = "changed"
    with pytest.raises(ExampleSetError, match="doc_id 1 has different documents"):
        pair_task("choice", samples([1, 0, 1]), other_doc, {}, {})
    with pytest.raises(ExampleSetError, match="different prompts"):
        pair_task("choice", samples([1, 0, 1]), samples([1, 0, 1], prompt="fewshot"), {}, {})
    with pytest.raises(ValueError, match="run B has no per-example results of task other"):
        pair_results({"samples": {"other": []}, "results": {}}, {"samples": {}, "results": {}}, ["other"])


# --------------------------------------------------------------------------- the command


@pytest.mark.lm_eval
def test_the_command_on_two_debug_checkpoints_prints_the_table_and_refuses_other_examples(tmp_path, monkeypatch,
                                                                                            capsys):
    """Two checkpoints of one real debug run (steps 2 and 4), the local multiple-choice and perplexity
    tasks: the table, its JSON, the same rows again from the scored folders, and a refusal when one
    side scored fewer examples."""
    pytest.importorskip("lm_eval")
    from helpers import ROOT
    from train_common import debug_cfg

    from mhar_titan.eval.__main__ import main as eval_main
    from mhar_titan.train import run_training

    monkeypatch.chdir(ROOT)  # the task YAML files name their data relative to the repository root
    cfg = debug_cfg(tmp_path, "run", "--training.steps=4", "--checkpoint.enable=true", "--checkpoint.interval=2",
                    "--checkpoint.keep_latest_k=0", config=ROOT / "train_configs" / "debug_baseline.toml")
    run_training(cfg)
    run = tmp_path / "run"
    capsys.readouterr()
    out = tmp_path / "paired"
    argv = ["paired", str(run), str(run), "--step-a", "2", "--step-b", "4", "--include-path", "eval_tasks",
            "--tasks", "shakespeare_choice,shakespeare_rolling", "--output-path", str(out), "--batch-size", "4"]
    assert eval_main(argv) == 0
    table = capsys.readouterr().out
    rows = json.loads((out / "paired.json").read_text())["rows"]
    choice = next(r for r in rows if r["task"] == "shakespeare_choice" and r["metric"] == "acc")
    assert choice["paired"] and choice["n"] == 8 and 0 <= choice["p_value"] <= 1
    assert choice["p_value"] == pytest.approx(float(exact_mcnemar(choice["b_only"], choice["a_only"])))
    line = next(ln for ln in table.splitlines() if ln.startswith("| shakespeare_choice | acc |"))
    assert f"| {choice['a_only']} | {choice['b_only']} | {choice['p_value']:.4g} |" in line
    assert "step-2" in table and "step-4" in table and "McNemar" in table
    rolling = [r for r in rows if r["task"] == "shakespeare_rolling"]
    assert {r["metric"] for r in rolling} == {"word_perplexity", "byte_perplexity", "bits_per_byte"}
    assert all(not r["paired"] and "unpaired" in r["note"] for r in rolling)
    assert "| shakespeare_rolling | bits_per_byte |" in table and "unpaired: a corpus-level metric" in table

    # the scored folders pair again without a model: the same rows
    again = tmp_path / "again"
    assert eval_main(["paired", str(out / "a"), str(out / "b"), "--tasks", "shakespeare_choice,shakespeare_rolling",
                      "--output-path", str(again)]) == 0
    assert json.loads((again / "paired.json").read_text())["rows"] == rows

    # one side scored on 5 examples only: refused, exit 2, one line naming the task
    fewer = tmp_path / "fewer"
    capsys.readouterr()
    assert eval_main(["paired", str(run), str(out / "b"), "--step-a", "2", "--include-path", "eval_tasks",
                      "--tasks", "shakespeare_choice", "--limit", "5", "--output-path", str(fewer)]) == 2
    err = capsys.readouterr().err
    assert "task shakespeare_choice: the runs were scored on different example sets (5 examples in A, 8 in B" in err
    assert not (fewer / "paired.json").exists()


def test_the_command_refuses_missing_runs_before_loading(tmp_path, capsys):
    from mhar_titan.eval.__main__ import main as eval_main

    assert eval_main(["paired", str(tmp_path / "nope"), str(tmp_path), "--tasks", "x"]) == 2
    assert "RUN_A" in capsys.readouterr().err


@pytest.mark.lm_eval
def test_an_exported_folder_pairs_with_its_checkpoint_answer_for_answer(tmp_path, monkeypatch, capsys):
    """RUN_B an exported Hugging Face folder (Qwen3 layout: the debug flavor has q/k norm; its own
    tokenizer files), RUN_A the checkpoint it came from:
    the same model, so every answer agrees (no discordant example, p = 1, interval [0, 0])."""
    pytest.importorskip("lm_eval")
    pytest.importorskip("transformers")
    from helpers import ROOT, trained_like_debug

    from mhar_titan.convert.__main__ import main as convert_main
    from mhar_titan.convert.dcp_io import save_model_dcp
    from mhar_titan.eval.__main__ import main as eval_main
    from mhar_titan.models import FAMILIES

    monkeypatch.chdir(ROOT)
    checkpoint = save_model_dcp(trained_like_debug(dict(FAMILIES["baseline"]), 50_304),
                                tmp_path / "run" / "checkpoints" / "step-0", tokenizer="gpt2")
    assert convert_main(["export", str(checkpoint), str(tmp_path / "llama"), "--format", "hf"]) == 0
    capsys.readouterr()
    assert eval_main(["paired", str(checkpoint), str(tmp_path / "llama"), "--tasks", "shakespeare_choice",
                      "--include-path", "eval_tasks", "--output-path", str(tmp_path / "out")]) == 0
    (row,) = json.loads((tmp_path / "out" / "paired.json").read_text())["rows"]
    assert (row["n"], row["a_only"], row["b_only"], row["p_value"]) == (8, 0, 0, 1.0)
    assert row["a"] == row["b"] and (row["ci_low"], row["ci_high"]) == (0.0, 0.0)
    assert "llama" in capsys.readouterr().out


def test_an_earlier_comparison_is_kept_unless_asked(tmp_path, capsys):
    """paired's output folder (default paired_eval/) holding an earlier comparison: refused before
    anything is loaded, naming --overwrite and --output-path; the files are untouched."""
    from mhar_titan.eval.__main__ import main as eval_main

    out = tmp_path / "paired"
    (out / "a").mkdir(parents=True)
    (out / "a" / "results_2026-01-01T00-00-00.json").write_text("{}")
    (out / "paired.json").write_text('{"rows": []}\n')
    for run in ("run_a", "run_b"):  # run folders (not scored ones): their results would go to a/ and b/
        (tmp_path / run).mkdir()
    assert eval_main(["paired", str(tmp_path / "run_a"), str(tmp_path / "run_b"), "--tasks", "x",
                      "--output-path", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"python -m mhar_titan.eval paired: error: {out / 'paired.json'} already exists (and 1 "
                          "more of its outputs)") and "--overwrite" in err and "--output-path DIR" in err
    assert (out / "paired.json").read_text() == '{"rows": []}\n' and len(list((out / "a").iterdir())) == 1
