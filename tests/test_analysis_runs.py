"""Commands on real run folders: two tiny debug runs (baseline and MHAR, same seed and data
order) trained here, then the comparison table and plot, the heatmap command on the MHAR
checkpoint, perplexity and the sample printer."""
import json
import math
import re
import shlex

import numpy as np
import pytest
import torch

from helpers import assert_not_blank, decode_heatmap_cell, read_metrics, read_png, site_sources
from train_common import ROOT, SAMPLE, debug_argv

from mhar_titan.analysis.__main__ import main as analysis_main
from mhar_titan.analysis.compare import comparison_table, read_run
from mhar_titan.analysis.heatmap import plot_routing_heatmaps
from mhar_titan.analysis.plots import pyplot
from mhar_titan.analysis.routing import routing_summary
from mhar_titan.data import build_validation_loader
from mhar_titan.eval.__main__ import main as eval_main
from mhar_titan.eval.load import load_run
from mhar_titan.generate import main as generate_main
from mhar_kernels.reference import route_reference
from mhar_titan.train import main as train_main

pytestmark = pytest.mark.skipif(not (SAMPLE / "validation-00000-of-00001.parquet").exists(),
                                reason="run `python -m mhar_titan.data.prepare_shakespeare --out data/shakespeare`")

STEPS = 6


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Run folders of debug_baseline and debug_mhar: 6 steps of 2 x 32 tokens, validation every
    2 steps, a checkpoint at the end."""
    root = tmp_path_factory.mktemp("runs")
    for name in ("debug_baseline", "debug_mhar"):
        argv = debug_argv(root, name, f"--training.steps={STEPS}", "--training.local_batch_size=2",
                          "--validation.enable=true", "--validation.freq=2", "--validation.sequences=2",
                          "--checkpoint.enable=true", f"--checkpoint.interval={STEPS}",
                          config=ROOT / "train_configs" / f"{name}.toml")
        assert train_main(argv) == 0
    return root


def test_compare_two_runs_tail_means_from_their_jsonl(runs, tmp_path, capsys):
    out = tmp_path / "cmp"
    assert analysis_main(["compare", str(runs / "debug_baseline"), str(runs / "debug_mhar"), "-k", "2",
                          "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    recomputed = {}
    for name in ("debug_baseline", "debug_mhar"):
        vals = [r["val_loss"] for r in read_metrics(runs / name) if "val_loss" in r]
        assert len(vals) == STEPS // 2
        recomputed[name] = float(np.mean(vals[-2:]))
    rows = {r.name: r for r in comparison_table([read_run(runs / n) for n in recomputed], "debug_baseline", k=2)}
    for name, mean in recomputed.items():
        assert rows[name].tail_mean == pytest.approx(mean, rel=1e-12) and rows[name].evals == 2
    assert rows["debug_mhar"].delta == pytest.approx(recomputed["debug_mhar"] - recomputed["debug_baseline"])
    assert rows["debug_mhar"].paired is True and rows["debug_baseline"].baseline
    table = (out / "comparison.md").read_text()
    assert f"| debug_mhar | {recomputed['debug_mhar']:.4f} | 2 | " in table and "| yes |" in table
    assert f"| debug_baseline | {recomputed['debug_baseline']:.4f} | 2 | baseline |" in printed
    assert_not_blank(out / "loss_vs_tokens.png")
    # tokens axis: 2 x 32 tokens per step
    assert read_run(runs / "debug_mhar").tokens_per_step == 64
    # k larger than the number of evaluations: all of them, and the count says so
    (row,) = [r for r in comparison_table([read_run(runs / "debug_mhar")], k=11)]
    assert row.evals == STEPS // 2


def test_heatmap_command_on_the_checkpoint_plots_the_models_mean_weights(runs, tmp_path):
    run = runs / "debug_mhar"
    out = tmp_path / "heat"
    assert analysis_main(["heatmap", str(run), "--batches", "1", "--out", str(out)]) == 0
    assert_not_blank(out / f"routing_step{STEPS}.png")
    data = json.loads((out / f"routing_step{STEPS}.json").read_text())
    loaded = load_run(run)
    (x, _), = build_validation_loader(loaded.data_config, loaded.tokenizer, dp_rank=0, dp_world=1,
                                      local_batch_size=2, seq_len=32, sequences=2)
    trace = []
    with torch.no_grad():
        trace.extend(site_sources(loaded.model, x))
    assert len(data["sites"]) == len(trace) == 9
    for s, sources in enumerate(trace):
        _, w = route_reference(sources, loaded.model.routing.query[s], loaded.model.routing.key_norm[s], 8,
                               return_weights=True)
        expected = w.double().mean((1, 2)).T.numpy()  # (H, N)
        assert np.allclose(data["sites"][s]["mean_weights"], expected, rtol=0, atol=1e-12)
    assert "| final | 9 |" in (out / f"routing_step{STEPS}.md").read_text()
    # the PNG itself: the same figure drawn here has the same pixels, and its cells decode to the means
    title = f"debug_mhar, step {STEPS}: routing weight vs uniform"
    heat = plot_routing_heatmaps(routing_summary(loaded.model, [x]), tmp_path / "again.png", title=title, dpi=200)
    pixels = read_png(out / f"routing_step{STEPS}.png")
    assert np.array_equal(pixels, read_png(heat.path))
    step = (heat.vmax - heat.vmin) / (pyplot().get_cmap(heat.cmap).N - 1)
    first = next(iter(heat.panels))  # the mean over heads (all heads when they agree)
    for s, site in enumerate(data["sites"]):
        mean = np.mean(site["mean_weights"], axis=0)
        for col, value in enumerate(np.log2(mean * len(mean))):
            got = decode_heatmap_cell(pixels, heat, first, s, col)
            assert abs(got - np.clip(value, heat.vmin, heat.vmax)) <= 3 * step
    pyplot().close(heat.figure)


def test_perplexity_command_matches_the_trainers_last_validation(runs, capsys):
    run = runs / "debug_mhar"
    assert eval_main(["perplexity", str(run)]) == 0
    result = json.loads(capsys.readouterr().out)
    last_val = [r["val_loss"] for r in read_metrics(run) if "val_loss" in r][-1]
    assert result["step"] == STEPS and result["tokens"] == 2 * 32
    assert result["loss"] == pytest.approx(last_val, rel=1e-5)
    assert eval_main(["perplexity", str(run / "missing")]) == 2
    capsys.readouterr()
    window = load_run(run).args.max_seq_len  # a longer --seq-len: one line naming it and the limit
    for command in (eval_main, analysis_main):
        argv = ["perplexity" if command is eval_main else "heatmap", str(run), "--seq-len", str(window + 1)]
        assert command(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--seq-len" in err[0] and f"max_seq_len {window}" in err[0], err


RATE = re.compile(r"--- (\d+) new tokens in \d+\.\d\d s: \d+\.\d tokens/s \((KV cache|no cache), cpu\) ---")


def _sample(out: str) -> str:
    """The sample of generate's output (its last line, the tokens-per-second line, checked and dropped)."""
    head, last = out.rstrip("\n").rsplit("\n", 1)
    assert RATE.fullmatch(last), last
    return head + "\n"


def test_generate_prints_a_greedy_sample_from_the_latest_checkpoint(runs, capsys):
    run = runs / "debug_mhar"
    assert generate_main([str(run), "--prompt", "ROMEO:", "--tokens", "5"]) == 0
    out = capsys.readouterr().out
    assert RATE.fullmatch(out.rstrip("\n").rsplit("\n", 1)[1]).group(1) == "5"  # tokens/s of the 5 new tokens
    first = _sample(out)
    assert f"step-{STEPS}" in first and "\nROMEO:" in first
    assert generate_main([str(run), "--prompt", "ROMEO:", "--tokens", "5"]) == 0
    assert _sample(capsys.readouterr().out) == first  # greedy: the same text again
    # the training command line names the same run folder (as `make train` calls it)
    assert generate_main(["--config", str(ROOT / "train_configs" / "debug_mhar.toml"), f"--job.dump_folder={runs}",
                          "--optimizer.lr", "1e-3", "--prompt", "ROMEO:", "--tokens", "5"]) == 0
    assert _sample(capsys.readouterr().out) == first
    assert generate_main([str(runs / "nowhere")]) == 2
    assert "does not exist" in capsys.readouterr().err
    # the KV cache changes nothing; a stop string cuts the sample before it
    assert generate_main([str(run), "--prompt", "ROMEO:", "--tokens", "5", "--no-cache"]) == 0
    assert _sample(capsys.readouterr().out) == first
    text = first.split("\nROMEO:", 1)[1][:-1]  # the sample without print's newline
    assert text
    stop = text[-2:]
    assert generate_main([str(run), "--prompt", "ROMEO:", "--tokens", "5", "--stop", stop]) == 0
    assert _sample(capsys.readouterr().out).split("\nROMEO:", 1)[1] == text[:text.index(stop)] + "\n"
    # the same stop string spelt with backslash escapes (as a shell passes "\u0041"): the same cut
    escaped = "".join(f"\\u{ord(c):04x}" for c in stop)
    assert generate_main([str(run), "--prompt", "ROMEO:", "--tokens", "5", "--stop", escaped]) == 0
    assert _sample(capsys.readouterr().out).split("\nROMEO:", 1)[1] == text[:text.index(stop)] + "\n"
    with pytest.raises(SystemExit) as exit_:
        generate_main([str(run), "--tokens", "3", "--temperature", "0.8", "--top-p", "1.5"])
    assert exit_.value.code == 2 and "argument --top-p" in capsys.readouterr().err


def test_the_documented_sampling_line_stops_at_a_blank_line(runs, capsys):
    """docs/ANALYSIS.md's ``generate ... --stop "\\n\\n"`` as written (split as the shell splits it, on
    the fixture's run): its sample is the one without ``--stop`` cut before the first blank line."""
    line = next(line for line in (ROOT / "docs" / "ANALYSIS.md").read_text().splitlines()
                if line.startswith("python -m mhar_titan.generate") and "--stop" in line)
    argv = shlex.split(line, comments=True)[3:]
    assert "\\n\\n" in argv  # the shell hands over backslash, n, backslash, n
    argv = [str(runs / "debug_mhar") if a == "outputs/debug_mhar" else a for a in argv]
    assert generate_main(argv) == 0
    cut = _sample(capsys.readouterr().out)
    at = argv.index("--stop")
    assert generate_main(argv[:at] + argv[at + 2:]) == 0
    whole = _sample(capsys.readouterr().out)
    header, sample = whole.split("\n", 1)
    assert cut == header + "\n" + (sample[:sample.index("\n\n")] + "\n" if "\n\n" in sample else sample)


def test_generate_warns_when_the_prompt_is_longer_than_the_context(runs, capsys):
    """A prompt past ``max_seq_len`` is kept to its last ``max_seq_len`` tokens, with a warning naming both."""
    run = runs / "debug_mhar"
    window = load_run(run).args.max_seq_len
    assert generate_main([str(run), "--prompt", " a" * (window + 8), "--tokens", "2"]) == 0
    err = capsys.readouterr().err
    assert "warning: --prompt is" in err and f"max_seq_len {window:,}" in err and f"last {window:,}" in err
    assert generate_main([str(run), "--prompt", "ab", "--tokens", "2"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_runs_with_another_seed_are_not_paired(runs, tmp_path):
    other = tmp_path / "debug_mhar_seed7"
    other.mkdir()
    (other / "metrics.jsonl").write_text((runs / "debug_mhar" / "metrics.jsonl").read_text())
    config = (runs / "debug_mhar" / "config.toml").read_text()
    assert "seed = 42" in config
    (other / "config.toml").write_text(config.replace("seed = 42", "seed = 7"))
    rows = comparison_table([read_run(runs / "debug_baseline"), read_run(runs / "debug_mhar"), read_run(other)], k=2)
    assert [r.paired for r in rows] == [True, True, False]
    assert rows[2].tail_mean == rows[1].tail_mean  # same metrics file, only the data order differs


def test_runs_of_other_lengths_are_not_paired_and_a_short_tail_is_reported(runs, tmp_path, capsys):
    """Same config and data order, but the copy stopped at step 4 of 6: not paired (the row says
    steps and tokens_seen differ); -k 11 over 3 evaluations is reported in the table and on stderr."""
    short = tmp_path / "debug_mhar_short"
    short.mkdir()
    kept = [line for line in (runs / "debug_mhar" / "metrics.jsonl").read_text().splitlines()
            if line.strip() and json.loads(line)["step"] <= 4]
    (short / "metrics.jsonl").write_text("\n".join(kept) + "\n")
    (short / "config.toml").write_text((runs / "debug_mhar" / "config.toml").read_text())
    rows = comparison_table([read_run(runs / "debug_mhar"), read_run(short)], k=2)
    assert rows[1].paired is False and rows[1].unpaired == "steps 4 vs 6; tokens_seen 256 vs 384"
    out = tmp_path / "cmp"
    assert analysis_main(["compare", str(runs / "debug_baseline"), str(short), "--out", str(out)]) == 0
    captured = capsys.readouterr()
    table = (out / "comparison.md").read_text()
    assert "| 3 of 11 |" in table and "| 2 of 11 |" in table and "no (steps 4 vs 6; tokens_seen 256 vs 384)" in table
    assert "Note: debug_mhar_short has 2 of the 11 evaluations asked (-k 11)" in table
    warnings = [line for line in captured.err.splitlines() if line.startswith("python -m mhar_titan.analysis compare: "
                                                                            "warning: ")]
    assert len(warnings) == 3 and "debug_mhar_short is not paired with the baseline: steps 4 vs 6" in warnings[-1]


def test_commands_refuse_what_they_cannot_do(runs, capsys):
    assert analysis_main(["probe", str(runs / "debug_mhar")]) == 2  # H = 8: the probe needs H = 1
    assert "single-head" in capsys.readouterr().err
    assert analysis_main(["heatmap", str(runs / "debug_baseline")]) == 2
    assert "no routing" in capsys.readouterr().err
    assert analysis_main(["compare", str(runs / "debug_mhar"), "--baseline", "nope"]) == 2
    assert "baseline 'nope'" in capsys.readouterr().err
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        assert eval_main(["lm-eval", str(runs / "debug_mhar"), "--tasks", "lambada_openai"]) == 2
        assert "pip install lm-eval" in capsys.readouterr().err
    else:  # a stock task offline (the tests run with HF_DATASETS_OFFLINE): one line pointing at local YAML tasks
        assert eval_main(["lm-eval", str(runs / "debug_mhar"), "--tasks", "lambada_openai", "--limit", "1"]) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
        assert len(err) == 1 and err[0].startswith("python -m mhar_titan.eval lm-eval: error: lm-eval could not "
                                                   "download the data of task(s) lambada_openai"), err
        assert "local YAML file" in err[0] and "--include-path DIR" in err[0]


def test_trainers_routing_entropy_equals_the_analysis_value_on_its_checkpoint(runs):
    """The trainer (FSDP-wrapped model, no explicit unshard) logs at the last step the entropy of
    the step's first sequence; the plain model loaded from the last checkpoint gives the same."""
    from mhar_titan.analysis.routing import routing_entropy
    from mhar_titan.data.loader import build_train_loader

    run = runs / "debug_mhar"
    logged = [r["routing_entropy"] for r in read_metrics(run) if r["step"] == STEPS and "routing_entropy" in r]
    loaded = load_run(run)
    cfg = loaded.cfg
    loader = build_train_loader(cfg.data, loaded.tokenizer, dp_rank=0, dp_world=1, local_batch_size=2,
                                seq_len=32, seed=cfg.debug.seed)
    batches = iter(loader)
    for _ in range(STEPS):
        x, _ = next(batches)
    fresh = sum(math.log(n) for n in range(1, 10)) / 9
    assert logged[0] == pytest.approx(routing_entropy(loaded.model, x[:1]), rel=1e-5)
    assert abs(logged[0] - fresh) > 1e-4  # trained queries: not the uniform value
    baseline_rows = read_metrics(runs / "debug_baseline")
    assert any("loss" in r for r in baseline_rows) and not any("routing_entropy" in r for r in baseline_rows)


def test_no_analysis_command_replaces_earlier_results_unless_asked(runs, tmp_path, capsys):
    """compare writes a folder per comparison, named after its runs (a later one-run compare leaves
    the two-run figure alone); any command whose outputs exist refuses in one line naming
    --overwrite and --out, writes nothing, and replaces them with --overwrite."""
    base, mhar = runs / "debug_baseline", runs / "debug_mhar"
    assert analysis_main(["compare", str(base), str(mhar), "-k", "2"]) == 0
    both = runs / "comparison" / "debug_baseline_vs_debug_mhar"
    before = {p.name: p.read_bytes() for p in both.iterdir()}
    assert set(before) == {"loss_vs_tokens.png", "comparison.md"}
    assert analysis_main(["compare", str(mhar), "-k", "2"]) == 0
    assert (runs / "comparison" / "debug_mhar" / "comparison.md").is_file()
    assert {p.name: p.read_bytes() for p in both.iterdir()} == before
    capsys.readouterr()
    assert analysis_main(["compare", str(base), str(mhar), "-k", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"python -m mhar_titan.analysis compare: error: {both / 'comparison.md'} already exists (and 1 "
                   "more of its outputs): it holds the results of an earlier run of this command, which are kept "
                   "(nothing was written); pass --overwrite to replace them, or --out DIR to write elsewhere")
    assert {p.name: p.read_bytes() for p in both.iterdir()} == before
    assert analysis_main(["compare", str(base), str(mhar), "-k", "1", "--overwrite", "--format", "pdf"]) == 0
    assert sorted(p.name for p in both.iterdir()) == ["comparison.md", "loss_vs_tokens.pdf"]  # no stale png
    assert "(last 1, nats per token)" in (both / "comparison.md").read_text()
    # heatmap and probe: the same rule for <run>/analysis (or --out), checked before the model loads
    out = tmp_path / "heat"
    assert analysis_main(["heatmap", str(mhar), "--batches", "1", "--out", str(out)]) == 0
    heat = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    assert analysis_main(["heatmap", str(mhar), "--batches", "2", "--out", str(out)]) == 2
    assert "pass --overwrite to replace them" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == heat
    assert analysis_main(["heatmap", str(mhar), "--batches", "2", "--out", str(out), "--overwrite"]) == 0
    (out / f"probe_step{STEPS}.md").write_text("an earlier probe\n")
    assert analysis_main(["probe", str(mhar), "--out", str(out)]) == 2  # refused before it finds H = 8
    assert f"probe_step{STEPS}.md already exists" in capsys.readouterr().err
    assert (out / f"probe_step{STEPS}.md").read_text() == "an earlier probe\n"
