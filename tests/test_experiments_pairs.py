"""The "heads or temperature?" arms on constructed run folders with known values: any pair's
paired difference B - A (table, printed rows, the figure's difference panel with its band over
seeds), the arms named in the results and in `analysis compare`, and the learned routing
temperature's trajectory plotted against the fixed scales."""
import json
import math

import pytest

from mhar_titan.analysis.__main__ import main as analysis_main
from mhar_titan.analysis.compare import (comparison_table, mean_and_se, pair_rows, plot_comparison, plot_temperatures,
                                         read_run)
from mhar_titan.analysis.plots import pyplot
from mhar_titan.config import to_toml
from mhar_titan.experiments.__main__ import main as experiments_main
from mhar_titan.experiments.results import collect, group_curves, group_pairs, pair_results
from mhar_titan.experiments.sweep import load_sweep
from mhar_titan.metrics import TEMPERATURE_KEYS
from train_common import DEBUG_MHAR

TOKENS_PER_STEP = 8 * 64
SEEDS = (1, 2, 3)
# validation losses of steps 1..4 per family and seed; tail_evals = 2 (the last two)
VAL = {
    "baseline": {1: [5.0, 4.0, 3.0, 3.0], 2: [5.0, 4.0, 3.2, 3.0], 3: [5.0, 4.0, 2.8, 3.0]},
    "attnres": {1: [5.0, 3.9, 2.9, 2.9], 2: [5.0, 3.9, 3.1, 2.9], 3: [5.0, 3.9, 2.7, 2.9]},
    "attnres_tau": {1: [5.0, 3.8, 2.7, 2.7], 2: [5.0, 3.8, 3.0, 2.8], 3: [5.0, 3.8, 2.6, 2.8]},
    "mhar": {1: [5.0, 3.8, 2.7, 2.7], 2: [5.0, 3.8, 2.9, 2.7], 3: [5.0, 3.8, 2.6, 2.8]},
    "mhar_learned": {1: [5.0, 3.7, 2.6, 2.6], 2: [5.0, 3.7, 2.9, 2.6], 3: [5.0, 3.7, 2.5, 2.7]},
}
# learned temperature (mean, min, max over sites and heads) at steps 1..4, per seed
TEMPERATURE = {1: [(1.0, 1.0, 1.0), (0.9, 0.8, 1.0), (0.8, 0.6, 1.0), (0.7, 0.5, 1.1)],
               2: [(1.0, 1.0, 1.0), (0.95, 0.9, 1.0), (0.85, 0.7, 1.0), (0.75, 0.4, 1.0)],
               3: [(1.0, 1.0, 1.0), (0.92, 0.85, 1.0), (0.86, 0.65, 1.2), (0.74, 0.55, 1.05)]}


def tail(values, k=2):
    return sum(values[-k:]) / k


def constructed_sweep(tmp_path, pairs='[["attnres", "attnres_tau"], ["attnres_tau", "mhar"]]', grid=""):
    """The sweep's run folders with the metrics of ``VAL`` (and, at the grid point lr 3e-3, 1.0 more
    loss for attnres_tau), ``TEMPERATURE`` for the learned arm."""
    path = tmp_path / "sweep.toml"
    path.write_text(f"""
[sweep]
name = "temperature"
base = "{DEBUG_MHAR}"
dump_folder = "{tmp_path / 'runs'}"
seeds = [1, 2, 3]
tail_evals = 2
pairs = {pairs}
{grid}
[families]
baseline = "baseline"
attnres = "attn_res H=1"
attnres_tau = {{ family = "attn_res H=1", routing_logit_scale = "match_heads:8" }}
mhar = "mhar H=8"
mhar_learned = {{ family = "mhar H=8", routing_temperature = "learned" }}
""")
    sweep = load_sweep(path)
    for run in sweep.runs:
        run.run_dir.mkdir(parents=True)
        (run.run_dir / "config.toml").write_text(to_toml(run.config))
        rows = []
        shift = 1.0 if run.family == "attnres_tau" and dict(run.point).get("optimizer.lr") == 3e-3 else 0.0
        for step, val in enumerate((v + shift for v in VAL[run.family][run.seed]), 1):
            row = {"step": step, "loss": val + 0.1, "tokens_seen": step * TOKENS_PER_STEP, "tokens_per_s": 100.0}
            if run.family == "mhar_learned":
                row.update(zip(TEMPERATURE_KEYS, TEMPERATURE[run.seed][step - 1]))
            rows += [row, {"step": step, "val_loss": val}]
        (run.run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return sweep


def test_pairs_are_tabulated_seed_by_seed_and_printed_with_the_arms(tmp_path, capsys):
    sweep = constructed_sweep(tmp_path)
    results, _ = collect(sweep)
    tau, heads = pair_results(sweep, results, sweep.pairs)
    per_seed = [tail(VAL["attnres_tau"][s]) - tail(VAL["attnres"][s]) for s in SEEDS]
    assert per_seed == pytest.approx([-0.2, -0.1, -0.1])
    assert (tau.a, tau.b, tau.seeds, tau.paired) == ("attnres", "attnres_tau", 3, True)
    assert (tau.delta_mean, tau.delta_se) == (pytest.approx(-0.4 / 3), pytest.approx(0.1 / 3))
    per_seed = [tail(VAL["mhar"][s]) - tail(VAL["attnres_tau"][s]) for s in SEEDS]
    assert per_seed == pytest.approx([0.0, -0.1, 0.0])
    assert (heads.delta_mean, heads.delta_se) == (pytest.approx(-0.1 / 3), pytest.approx(0.1 / 3))

    out = tmp_path / "results"
    assert experiments_main(["results", str(sweep.path), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    written = (out / "RESULTS.md").read_text()
    for text in (printed, written):
        assert "| attnres_tau | attn_res H=1 + routing_logit_scale=match_heads:8 |" in text
        assert "| mhar_learned | mhar H=8 + routing_temperature=learned |" in text
        assert "| attnres_tau - attnres | - | 3 | -0.1333 | 0.0333 | yes |" in text
        assert "| mhar - attnres_tau | - | 3 | -0.0333 | 0.0333 | yes |" in text
        assert "| attnres_tau | - | 3 | 2.7667 | -0.2333 | 0.0333 | 3 |" in text  # vs the baseline, as before
        assert "| mhar_learned_s2 | 2 | 2.7500 | 2 | -0.3500 | yes | 2,048 | 100 |" in text
    assert "![learned routing temperature against tokens](routing_temperature.png)" in written
    assert {p.name for p in out.iterdir()} == {"RESULTS.md", "loss_vs_tokens.png", "routing_temperature.png"}

    # --pair replaces the sweep's pairs (in the same folder: only with --overwrite); a pair naming no
    # family is refused before anything is written
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert experiments_main(["results", str(sweep.path), "--out", str(out), "--pair", "mhar", "mhar_learned"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"python -m mhar_titan.experiments results: error: {out / 'RESULTS.md'} already exists (and 2 more "
                   "of its outputs): it holds the results of an earlier run of this command, which are kept (nothing "
                   "was written); pass --overwrite to replace them, or --out DIR to write elsewhere")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert experiments_main(["results", str(sweep.path), "--out", str(out), "--pair", "mhar", "mhar_learned",
                             "--overwrite"]) == 0
    text = (out / "RESULTS.md").read_text()
    assert "| mhar_learned - mhar | - | 3 | -0.0833 | 0.0167 | yes |" in text and "attnres_tau - attnres" not in text
    capsys.readouterr()
    for bad, message in ((["mhar", "nope"], "--pair: 'nope' is none of ['baseline', 'attnres', 'attnres_tau', "
                                            "'mhar', 'mhar_learned']"),
                         (["mhar", "mhar"], "--pair: pair ['mhar', 'mhar'] compares mhar with itself")):
        assert experiments_main(["results", str(sweep.path), "--out", str(tmp_path / "never"), "--pair", *bad]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("python -m mhar_titan.experiments results: error: ") and message in err
        assert "\n" not in err and not (tmp_path / "never").exists()


def test_pairs_of_a_grid_are_taken_at_each_grid_point(tmp_path):
    sweep = constructed_sweep(tmp_path, grid='[sweep.grid]\n"optimizer.lr" = [1e-3, 3e-3]')
    results, _ = collect(sweep)
    assert group_pairs(results, sweep.pairs) == [("attnres_lr0.001", "attnres_tau_lr0.001"),
                                                 ("attnres_lr0.003", "attnres_tau_lr0.003"),
                                                 ("attnres_tau_lr0.001", "mhar_lr0.001"),
                                                 ("attnres_tau_lr0.003", "mhar_lr0.003")]
    rows = {(p.b, p.point_tag): p for p in pair_results(sweep, results, sweep.pairs)}
    assert rows["attnres_tau", "lr0.001"].delta_mean == pytest.approx(-0.4 / 3)
    assert rows["attnres_tau", "lr0.003"].delta_mean == pytest.approx(1.0 - 0.4 / 3)  # tau 1.0 worse at lr 3e-3
    assert rows["mhar", "lr0.003"].delta_mean == pytest.approx(-1.0 - 0.1 / 3)
    assert rows["mhar", "lr0.001"].delta_se == pytest.approx(0.1 / 3) and rows["mhar", "lr0.003"].seeds == 3


def test_the_difference_panel_draws_any_pair_with_its_seed_band(tmp_path):
    sweep = constructed_sweep(tmp_path)
    curves = group_curves(collect(sweep)[0])
    rows = comparison_table(curves, "baseline", 2)
    fig = plot_comparison(curves, rows, tmp_path / "p.png", pairs=[("attnres", "attnres_tau"), ("mhar", "baseline")])
    diff_ax = fig.axes[2]
    tau_line, base_line, zero = diff_ax.lines
    legend, = fig.legends  # one legend, below the panels
    assert [t.get_text() for t in legend.get_texts()][-3:] == [
        "attnres_tau - attnres (difference panel), 3 paired seeds",
        "baseline - mhar (difference panel), 3 paired seeds",
        "0 = no difference"]
    assert diff_ax.get_title() == "validation loss, B - A\n(band +/- 1 SE over paired seeds)"
    assert list(zero.get_ydata()) == [0, 0]
    # B - A in B's colour: the colour B's own loss curves have in the panels above
    val_colors = {name: line.get_color() for name, line in zip([c.name for c in curves], fig.axes[1].lines)}
    assert tau_line.get_color() == val_colors["attnres_tau"] and base_line.get_color() == val_colors["baseline"]
    for line, (a, b) in ((tau_line, ("attnres", "attnres_tau")), (base_line, ("mhar", "baseline"))):
        assert list(line.get_xdata()) == [step * TOKENS_PER_STEP for step in (1, 2, 3, 4)]
        for k in range(4):
            mean, _ = mean_and_se([VAL[b][s][k] - VAL[a][s][k] for s in SEEDS])
            assert line.get_ydata()[k] == pytest.approx(mean, abs=1e-12)
    # the band of attnres_tau - attnres at step 3: per seed -0.2, -0.1, -0.1 -> mean -/+ SE
    mean, se = mean_and_se([-0.2, -0.1, -0.1])
    band = diff_ax.collections[0].get_paths()[0].vertices
    at_step3 = sorted(y for x, y in band if x == 3 * TOKENS_PER_STEP)
    assert at_step3[0] == pytest.approx(mean - se) and at_step3[-1] == pytest.approx(mean + se)
    pyplot().close(fig)
    with pytest.raises(ValueError, match="pairs: 'mhar_h8' is none of"):
        plot_comparison(curves, rows, tmp_path / "bad.png", pairs=[("mhar_h8", "attnres")])
    assert not (tmp_path / "bad.png").exists()


def test_the_learned_temperature_is_plotted_against_the_fixed_scales(tmp_path):
    sweep = constructed_sweep(tmp_path)
    curves = {c.name: c for c in group_curves(collect(sweep)[0])}
    learned = curves["mhar_learned"]
    # over seeds: the mean of the means, the least min, the largest max
    assert learned.temperature[3] == (4, pytest.approx((0.7 + 0.75 + 0.74) / 3), 0.4, 1.1)
    assert learned.temperature[2] == (3, pytest.approx((0.8 + 0.85 + 0.86) / 3), 0.6, 1.2)
    assert (curves["attnres_tau"].logit_scale, curves["mhar"].logit_scale) == (pytest.approx(8 ** -0.5), 1.0)
    assert curves["baseline"].logit_scale is None and learned.logit_scale is None
    assert not curves["mhar"].temperature
    fig = plot_temperatures(list(curves.values()), tmp_path / "t.png")
    ax, = fig.axes
    mean_line, tau_level, one_level = ax.lines
    assert list(mean_line.get_xdata()) == [step * TOKENS_PER_STEP for step in (1, 2, 3, 4)]
    assert list(mean_line.get_ydata()) == pytest.approx([t[1] for t in learned.temperature])
    band = ax.collections[0].get_paths()[0].vertices
    assert band[:, 1].min() == pytest.approx(0.4) and band[:, 1].max() == pytest.approx(1.2)
    assert list(tau_level.get_ydata()) == pytest.approx([8 ** -0.5] * 2) and list(one_level.get_ydata()) == [1.0, 1.0]
    legend, = fig.legends  # below the panel
    assert [t.get_text() for t in legend.get_texts()] == [
        "mhar_learned, 3 seeds", "fixed 0.354: attnres_tau", "fixed 1: attnres, mhar"]
    # the learned arm has the colour it has in the loss figure of the same curves
    loss = plot_comparison(list(curves.values()), comparison_table(list(curves.values()), "baseline", 2),
                           tmp_path / "p.png")
    assert mean_line.get_color() == loss.axes[1].lines[list(curves).index("mhar_learned")].get_color()
    pyplot().close(loss)
    pyplot().close(fig)
    with pytest.raises(ValueError, match="no run logged a learned routing temperature"):
        plot_temperatures([curves["mhar"]], tmp_path / "none.png")


def test_analysis_compare_names_the_arms_tabulates_pairs_and_plots_the_temperature(tmp_path, capsys):
    sweep = constructed_sweep(tmp_path)
    runs = {r.name: r.run_dir for r in sweep.runs if r.seed == 2}
    out = tmp_path / "cmp"
    argv = ["compare", *map(str, runs.values()), "-k", "2", "--out", str(out),
            "--pair", "attnres_s2", "attnres_tau_s2", "--pair", "attnres_tau_s2", "mhar_s2"]
    assert analysis_main(argv) == 0
    printed = capsys.readouterr().out
    table = (out / "comparison.md").read_text()
    for text in (printed, table):
        assert "| attnres_tau_s2 | 2.9000 | 2 | -0.2000 | yes | attn_res H=1 + routing_logit_scale='match_heads:8' |" \
            in text
        assert "| mhar_learned_s2 | 2.7500 | 2 | -0.3500 | yes | mhar H=8 + routing_temperature='learned' |" in text
        assert "| baseline_s2 | 3.1000 | 2 | baseline | - | baseline |" in text
        assert "| attnres_tau_s2 - attnres_s2 | -0.1000 | 2, 2 | yes |" in text
        assert "| mhar_s2 - attnres_tau_s2 | -0.1000 | 2, 2 | yes |" in text
    assert "![learned routing temperature against tokens](routing_temperature.png)" in table
    assert {p.name for p in out.iterdir()} == {"comparison.md", "loss_vs_tokens.png", "routing_temperature.png"}
    rows = pair_rows([read_run(runs["mhar_s2"]), read_run(runs["mhar_learned_s2"])], [("mhar_s2", "mhar_learned_s2")],
                     k=2)
    assert rows[0].delta == pytest.approx(-0.05) and rows[0].paired is True
    assert read_run(runs["mhar_learned_s2"]).temperature[-1] == (4, *TEMPERATURE[2][-1])
    # a pair naming no run is refused before anything is read or written
    assert analysis_main(["compare", *map(str, runs.values()), "--out", str(tmp_path / "never"),
                          "--pair", "attnres_s2", "attnres_s9"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("python -m mhar_titan.analysis compare: error: --pair: 'attnres_s9' is none of")
    assert "\n" not in err and not (tmp_path / "never").exists()


def test_results_report_the_share_of_the_mhar_gap_the_temperature_recovers(tmp_path, capsys):
    """attnres_tau (the single head at 1/sqrt(8)) recovers, seed by seed, X = tau - attnres of the
    gap Y = mhar - attnres: the share mean(X) / mean(Y) with its delta-method SE over the seeds."""
    from mhar_titan.experiments.results import temperature_families, temperature_shares

    sweep = constructed_sweep(tmp_path)
    assert temperature_families(sweep) == [("attnres_tau", "attnres", "mhar")]  # mhar_learned has 8 heads
    x = [tail(VAL["attnres_tau"][s]) - tail(VAL["attnres"][s]) for s in SEEDS]
    y = [tail(VAL["mhar"][s]) - tail(VAL["attnres"][s]) for s in SEEDS]
    assert x == pytest.approx([-0.2, -0.1, -0.1]) and y == pytest.approx([-0.2, -0.2, -0.1])
    n, mx, my = 3, sum(x) / 3, sum(y) / 3
    r = mx / my
    var = lambda a, m: sum((v - m) ** 2 for v in a) / (n - 1)  # noqa: E731
    cov = sum((a - mx) * (b - my) for a, b in zip(x, y)) / (n - 1)
    se = math.sqrt((var(x, mx) - 2 * r * cov + r * r * var(y, my)) / n) / abs(my)
    assert (r, se) == (pytest.approx(0.8), pytest.approx(0.18330, abs=1e-5))
    share, = temperature_shares(sweep, collect(sweep)[0])
    assert (share.arm, share.reference, share.target, share.seeds) == ("attnres_tau", "attnres", "mhar", 3)
    assert (share.gap, share.recovered) == (pytest.approx(my), pytest.approx(mx))
    assert (share.share, share.share_se) == (pytest.approx(r), pytest.approx(se)) and share.resolved
    out = tmp_path / "results"
    assert experiments_main(["results", str(sweep.path), "--out", str(out)]) == 0
    for text in (capsys.readouterr().out, (out / "RESULTS.md").read_text()):
        assert ("| attnres_tau | attnres | mhar | - | 3 | -0.1667 | 0.0333 | -0.1333 | 0.0333 | 80% | 18% |  |"
                in text)


def test_an_unresolved_gap_is_flagged_and_one_seed_has_no_band():
    from mhar_titan.experiments.results import ShareResult, _share

    assert _share([0.1], [0.2]) == (pytest.approx(0.5), None)
    assert _share([0.1, 0.1], [0.0, 0.0]) == (None, None)  # no gap: no share
    r, se = _share([-0.01, 0.02, 0.0], [0.01, -0.01, 0.02])
    assert r == pytest.approx((0.01 / 3) / (0.02 / 3)) and se > 1  # a gap within its noise: a huge SE
    gap, gap_se = mean_and_se([0.01, -0.01, 0.02])
    assert not ShareResult("t", "r", "m", "", 3, gap, gap_se, 0.0, 0.0, r, se).resolved
