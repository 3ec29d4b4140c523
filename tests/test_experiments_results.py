"""Sweep results on constructed run folders with known values: tail means, paired differences,
their mean and standard error over seeds, tokens, throughput; byte-for-byte reruns."""
import dataclasses
import json
import math

import pytest

from mhar_titan.config import to_toml
from mhar_titan.experiments.__main__ import main as experiments_main
from mhar_titan.experiments.results import collect, mean_and_se, write_results
from mhar_titan.experiments.sweep import load_sweep
from train_common import DEBUG_MHAR, ROOT

TOKENS_PER_STEP = 8 * 64
# validation losses per run (steps 1..6); the last 3 are the tail (tail_evals = 3)
VAL = {
    "baseline_s1": [5.0, 4.0, 3.0, 2.0, 2.2, 2.4],  # tail mean 2.2
    "baseline_s2": [5.0, 4.0, 3.0, 2.5, 2.5, 2.5],  # 2.5
    "baseline_s3": [5.0, 4.0, 9.0, 1.0, 2.0, 3.0],  # 2.0
    "mhar_h4_s1": [5.0, 4.0, 3.0, 2.0, 2.1, 2.2],   # 2.1 -> paired diff -0.1
    "mhar_h4_s2": [5.0, 4.0, 3.0, 2.2, 2.3, 2.4],   # 2.3 -> -0.2
    "mhar_h4_s3": [5.0, 4.0, 3.0, 1.5, 2.0, 2.5],   # 2.0 -> 0.0
}
SPEEDS = [999.0, 100.0, 300.0, 200.0, 400.0, 500.0]  # tokens/s of steps 1..6: median after step 1 = 300


def constructed_sweep(tmp_path):
    path = tmp_path / "sweep.toml"
    path.write_text(f"""
[sweep]
name = "known"
base = "{DEBUG_MHAR}"
dump_folder = "{tmp_path / 'runs'}"
seeds = [1, 2, 3]
tail_evals = 3
[families]
baseline = "baseline"
attnres = "attn_res H=1"
mhar = {{ residual = "attn_res", routing_heads = [4] }}
""")
    sweep = load_sweep(path)
    for run in sweep.runs:
        if run.name not in VAL:
            continue  # attnres: not run
        run.run_dir.mkdir(parents=True)
        (run.run_dir / "config.toml").write_text(to_toml(run.config))
        rows = []
        for step, (val, speed) in enumerate(zip(VAL[run.name], SPEEDS), 1):
            rows.append({"step": step, "loss": val + 0.1, "tokens_seen": step * TOKENS_PER_STEP, "tokens_per_s": speed})
            rows.append({"step": step, "val_loss": val})
        (run.run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return sweep


def test_mean_and_standard_error():
    mean, se = mean_and_se([-0.1, -0.2, 0.0])
    assert mean == pytest.approx(-0.1) and se == pytest.approx(0.1 / math.sqrt(3))
    assert mean_and_se([2.0])[0] == 2.0 and math.isnan(mean_and_se([2.0])[1])
    with pytest.raises(ValueError):
        mean_and_se([])


def test_paired_differences_on_known_run_folders(tmp_path):
    sweep = constructed_sweep(tmp_path)
    results, groups = collect(sweep)
    by_name = {r.run.name: r for r in results}
    assert by_name["baseline_s1"].tail_mean == pytest.approx(2.2) and by_name["baseline_s1"].evals == 3
    assert by_name["mhar_h4_s2"].paired_delta == pytest.approx(-0.2) and by_name["mhar_h4_s2"].paired is True
    assert by_name["mhar_h4_s3"].paired_delta == pytest.approx(0.0)
    assert by_name["mhar_h4_s1"].throughput == 300.0
    assert by_name["mhar_h4_s1"].curves.tokens_seen == 6 * TOKENS_PER_STEP
    assert by_name["attnres_s1"].curves is None
    mhar = next(g for g in groups if g.family == "mhar_h4")
    assert (mhar.seeds, mhar.paired_seeds) == (3, 3)
    assert mhar.tail_mean == pytest.approx((2.1 + 2.3 + 2.0) / 3)
    assert mhar.delta_mean == pytest.approx(-0.1) and mhar.delta_se == pytest.approx(0.1 / math.sqrt(3))
    assert [g.family for g in groups] == ["baseline", "mhar_h4"]


def test_results_command_writes_the_same_bytes_twice(tmp_path):
    sweep = constructed_sweep(tmp_path)
    out = tmp_path / "results"
    assert experiments_main(["results", str(sweep.path), "--out", str(out)]) == 0
    first = {p.name: p.read_bytes() for p in out.iterdir()}
    assert set(first) == {"RESULTS.md", "loss_vs_tokens.png"}
    text = first["RESULTS.md"].decode()
    assert "| mhar_h4 | - | 3 | 2.1333 | -0.1000 | 0.0577 | 3 |" in text
    assert "| mhar_h4_s2 | 2 | 2.3000 | 3 | -0.2000 | yes | 3,072 | 300 |" in text
    assert "| attnres_s1 | 1 | not run |" in text
    assert b"matplotlib" not in first["loss_vs_tokens.png"]  # no version metadata
    for p in out.iterdir():
        p.unlink()
    assert experiments_main(["results", str(sweep.path), "--out", str(out)]) == 0
    assert {p.name: p.read_bytes() for p in out.iterdir()} == first
    assert experiments_main(["results", str(sweep.path), "--out", str(out), "--overwrite"]) == 0
    assert {p.name: p.read_bytes() for p in out.iterdir()} == first
    write_results(sweep, out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == first


def test_results_without_runs_names_the_run_command_for_that_folder(tmp_path, capsys):
    sweep = constructed_sweep(tmp_path)
    empty = tmp_path / "no_runs_yet"
    empty.mkdir()
    out = tmp_path / "results"
    assert experiments_main(["results", str(sweep.path), "--dump-folder", str(empty), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert f"no run of sweep known has metrics under {empty}" in err and "\n" not in err
    assert err.endswith(f"run it first: python -m mhar_titan.experiments run {sweep.path} --dump-folder {empty}")
    assert not out.exists()  # nothing written


def test_the_study_plot_draws_the_seed_mean_with_a_standard_error_band_at_column_width(tmp_path):
    from mhar_titan.analysis.compare import comparison_table, plot_comparison
    from mhar_titan.analysis.plots import pyplot
    from mhar_titan.experiments.results import group_curves

    results, _ = collect(constructed_sweep(tmp_path))
    curves = {c.name: c for c in group_curves(results)}
    mhar = curves["mhar_h4"]
    assert mhar.seeds == 3 and mhar.tokenizer == "gpt2"
    step4 = [VAL[f"mhar_h4_s{s}"][3] for s in (1, 2, 3)]  # 2.0, 2.2, 1.5
    mean, se = mean_and_se(step4)
    assert dict(mhar.val)[4] == pytest.approx(mean)
    assert [b for b in mhar.val_band if b[0] == 4] == [(4, pytest.approx(mean - se), pytest.approx(mean + se))]
    fig = plot_comparison(list(curves.values()), comparison_table(list(curves.values()), "baseline", 3),
                          tmp_path / "p.png")
    train_ax, val_ax, diff_ax = fig.axes
    assert len(val_ax.collections) == 2  # one band per family (both have 3 seeds)
    assert val_ax.get_ylabel() == "loss (nats per token)" and diff_ax.get_ylabel() == "difference (nats per token)"
    # the difference panel: mhar_h4 - baseline paired seed by seed, mean and band of -/+ 1 SE over the seeds
    (diff_line, zero) = diff_ax.lines
    assert list(zero.get_ydata()) == [0, 0]
    for k, step in enumerate(range(1, 7)):
        per_seed = [VAL[f"mhar_h4_s{s}"][step - 1] - VAL[f"baseline_s{s}"][step - 1] for s in (1, 2, 3)]
        mean, se = mean_and_se(per_seed)
        assert diff_line.get_xdata()[k] == step * TOKENS_PER_STEP
        assert diff_line.get_ydata()[k] == pytest.approx(mean, abs=1e-12)
    band, = diff_ax.collections
    ys = band.get_paths()[0].vertices[:, 1]
    step3 = mean_and_se([VAL[f"mhar_h4_s{s}"][2] - VAL[f"baseline_s{s}"][2] for s in (1, 2, 3)])  # -2.0 +/- 2.0
    assert step3 == (pytest.approx(-2.0), pytest.approx(2.0)) and ys.min() == pytest.approx(-4.0)
    # one legend, below the panels, named for the runs; each family one colour in every panel
    legend, = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == ["baseline, 3 seeds", "mhar_h4, 3 seeds"]
    assert all(ax.get_legend() is None for ax in fig.axes)
    assert train_ax.lines[1].get_color() == val_ax.lines[1].get_color() == diff_line.get_color()
    assert train_ax.lines[0].get_color() == zero.get_color() != diff_line.get_color()  # 0 = the baseline
    assert diff_ax.get_title() == "validation loss minus baseline's\n(band +/- 1 SE over paired seeds)"
    assert diff_ax.get_xlabel() == "tokens seen"
    width = fig.get_size_inches()[0]
    texts = [t for ax in fig.axes for t in (*ax.get_xticklabels(), *ax.get_yticklabels(), ax.title, ax.xaxis.label,
                                            ax.yaxis.label) if t.get_text()]
    texts += list(legend.get_texts())
    assert width <= 3.5 + 1e-9 and min(t.get_fontsize() for t in texts) * 3.5 / width >= 8
    pyplot().close(fig)
    # a single run has no band; the byte tokenizer's losses are drawn in bits per byte
    one = dataclasses.replace(results[0].curves, tokenizer="bytes")
    fig = plot_comparison([one], comparison_table([one]), tmp_path / "b.png")
    val_ax = fig.axes[1]
    assert val_ax.get_ylabel() == "loss (bits per byte)" and not val_ax.collections
    assert val_ax.lines[0].get_ydata()[-1] == pytest.approx(one.val[-1][1] / math.log(2))
    pyplot().close(fig)


def test_the_comparison_plot_takes_fixed_y_ranges(tmp_path, capsys):
    from mhar_titan.analysis.compare import comparison_table, plot_comparison
    from mhar_titan.analysis.plots import pyplot
    from mhar_titan.experiments.results import group_curves

    sweep = constructed_sweep(tmp_path)
    curves = group_curves(collect(sweep)[0])
    rows = comparison_table(curves, "baseline", 3)
    auto = plot_comparison(curves, rows, tmp_path / "auto.png")
    assert auto.axes[0].get_ylim() != auto.axes[1].get_ylim()  # each loss panel its own range by default
    pyplot().close(auto)
    fig = plot_comparison(curves, rows, tmp_path / "fixed.png", ylim=(1.5, 6.0), diff_ylim=(-0.5, 0.25))
    train_ax, val_ax, diff_ax = fig.axes
    assert train_ax.get_ylim() == val_ax.get_ylim() == (1.5, 6.0) and diff_ax.get_ylim() == (-0.5, 0.25)
    pyplot().close(fig)
    for bad in ((2.0, 1.0), (0.0, float("nan")), (1.0,)):
        with pytest.raises(ValueError, match="ylim must be"):
            plot_comparison(curves, rows, tmp_path / "bad.png", ylim=bad)
    assert not (tmp_path / "bad.png").exists()
    # the results command: the same ranges from its flags; a bad range is refused before anything is read
    out = tmp_path / "results"
    assert experiments_main(["results", str(sweep.path), "--out", str(out), "--ylim", "1.5", "6",
                             "--diff-ylim", "-0.5", "0.25"]) == 0
    assert (out / "loss_vs_tokens.png").stat().st_size > 10_000
    capsys.readouterr()
    assert experiments_main(["results", str(sweep.path), "--out", str(tmp_path / "never"), "--ylim", "3", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("python -m mhar_titan.experiments results: error: --ylim must be two finite numbers with "
                   "LOW < HIGH, got 3 1") and not (tmp_path / "never").exists()


def test_arms_at_equal_wall_clock_time_from_the_logged_throughput(tmp_path):
    """experiments.timing on two hand-written run folders of the study sweep (seed 1): the
    timeline sums each logged row's tokens over its tokens/s (baseline 10, 15, 20 s; DenseFormer,
    twice as slow from step 2: 10, 15, 35 s); at equal time (T = 20 s, the baseline's end) the
    DenseFormer run's loss is interpolated between its evaluations (2.9 at 15 s, 1.8 at 35 s:
    2.625), the baseline's is its last (2.0): +0.625, while at equal steps the tail means give
    -0.15; tokens/s medians 30 and 15, ratio 0.50."""
    import json

    from mhar_titan.experiments.results import collect
    from mhar_titan.experiments.sweep import load_sweep
    from mhar_titan.experiments.timing import arm_timing, timeline, timing_lines

    sweep = load_sweep(ROOT / "train_configs" / "sweeps" / "study_bytes.toml", dump_folder=tmp_path)
    logs = {"baseline_s1": [(1, 100, 10, None), (2, 200, 20, 3.0), (4, 400, 40, 2.0)],
            "dense_s1": [(1, 100, 10, None), (2, 200, 20, 2.9), (4, 400, 10, 1.8)]}
    for name, rows in logs.items():
        (tmp_path / name).mkdir()
        lines = []
        for step, seen, rate, val in rows:
            lines.append({"step": step, "loss": 5.0 - step / 10, "tokens_seen": seen, "tokens_per_s": rate})
            if val is not None:
                lines.append({"step": step, "val_loss": val})
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert timeline(tmp_path / "dense_s1") == [(1, 10.0), (2, 15.0), (4, 35.0)]
    results, groups = collect(sweep)
    timing = {a.family: a for a in arm_timing(sweep, results)}
    assert set(timing) == {"baseline", "dense"}
    dense = timing["dense"]
    assert (dense.tokens_per_s, dense.speed_ratio, dense.seconds, dense.paired_seeds) == (15, 0.5, 20.0, 1)
    assert dense.delta_mean == pytest.approx(0.625) and math.isnan(dense.delta_se)  # one seed: no standard error
    steps = {g.family: (g.delta_mean, g.delta_se) for g in groups}
    assert steps["dense"][0] == pytest.approx(-0.15)
    table = "\n".join(timing_lines(sweep, results, {("dense", ""): steps["dense"]}))
    assert "| dense | - | 15 | 0.50 | -0.1500 | n/a | +0.6250 | n/a | 20 | 1 |" in table
    assert "| baseline | - | 30 | - | baseline |" in table
    # in the results' loss unit (a factor from nats per token), named in the header
    table = "\n".join(timing_lines(sweep, results, {("dense", ""): steps["dense"]}, "bits per byte", 2.0))
    assert "| dense | - | 15 | 0.50 | -0.3000 | n/a | +1.2500 | n/a | 20 | 1 |" in table
    assert "diff at equal steps (bits per byte)" in table
