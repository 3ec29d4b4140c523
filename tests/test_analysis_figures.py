"""The run and sweep figures as a paper needs them, on constructed run folders: one colour per arm
in every panel, figure and command (analysis.colors), legends outside the data, PDF and SVG on
request with the same bytes for the same runs, and one loss unit between the tables and the plots."""
import glob
import math
import re

import pytest
from helpers import ROOT
from test_experiments_pairs import VAL, constructed_sweep

from mhar_titan.analysis.__main__ import main as analysis_main
from mhar_titan.analysis.colors import PALETTE, arm_colors, curve_styles, preferred_color
from mhar_titan.analysis.compare import comparison_table, model_of, plot_comparison, plot_temperatures
from mhar_titan.analysis.plots import pyplot
from mhar_titan.experiments.__main__ import main as experiments_main
from mhar_titan.experiments.results import collect, group_curves
from mhar_titan.experiments.sweep import load_sweep


def test_the_shipped_sweeps_arms_each_have_their_own_colour():
    """Every arm of every shipped sweep keeps the colour of its name: no two collide, so no figure
    moves one to another colour, and a family-table row has its reserved colour."""
    arms = sorted({model_of(run.config)[0] for path in glob.glob(str(ROOT / "train_configs/sweeps/*.toml"))
                   for run in load_sweep(path).runs})
    assert len(arms) >= 8 and "baseline" in arms and "mhar H=8" in arms
    preferred = {arm: preferred_color(arm) for arm in arms}
    assert len(set(preferred.values())) == len(arms), preferred
    assert arm_colors(arms) == {arm: PALETTE[k] for arm, k in preferred.items()}
    assert arm_colors(["baseline"]) == {"baseline": "#000000"}  # the zero line's colour
    # a set of arms gets the same colours in any order; curves of one arm share it, in other line styles
    assert arm_colors(arms[::-1]) == arm_colors(arms)
    assert curve_styles([("a_lr1", "mhar H=8"), ("b", "baseline"), ("a_lr2", "mhar H=8")]) == [
        (PALETTE[2], "-"), (PALETTE[0], "-"), (PALETTE[2], "--")]


def _line_colors(ax) -> list[str]:
    from matplotlib.colors import to_hex

    return [to_hex(line.get_color()) for line in ax.lines]


def test_an_arm_has_one_colour_in_every_panel_figure_and_command(tmp_path):
    """The sweep's loss figure, its temperature figure and a comparison of two of its run folders
    (other runs, another order) draw each arm in the same colour."""
    from matplotlib.colors import to_hex

    sweep = constructed_sweep(tmp_path)
    curves = group_curves(collect(sweep)[0])
    arms = {c.name: c.arm for c in curves}
    fig = plot_comparison(curves, comparison_table(curves, "baseline", 2), tmp_path / "sweep.png")
    train_ax, val_ax, diff_ax = fig.axes
    sweep_colors = dict(zip((c.name for c in curves), _line_colors(val_ax)))
    assert _line_colors(train_ax) == _line_colors(val_ax)
    assert _line_colors(diff_ax)[:-1] == [sweep_colors[c.name] for c in curves if c.name != "baseline"]
    assert to_hex(diff_ax.lines[-1].get_color()) == sweep_colors["baseline"]  # the zero line is the baseline
    assert len(set(sweep_colors.values())) == len(curves)
    pyplot().close(fig)
    temps = plot_temperatures(curves, tmp_path / "t.png")
    assert _line_colors(temps.axes[0])[0] == sweep_colors["mhar_learned"]
    pyplot().close(temps)
    # analysis compare of two run folders, the learned arm first: the same colours as in the sweep's figure
    runs = [run.run_dir for run in sweep.runs if run.seed == 1 and run.family in ("mhar_learned", "attnres_tau")]
    out = tmp_path / "cmp"
    assert analysis_main(["compare", *map(str, runs[::-1]), "--out", str(out)]) == 0
    from mhar_titan.analysis.compare import read_run

    read = [read_run(p) for p in runs[::-1]]
    fig = plot_comparison(read, comparison_table(read), tmp_path / "cmp.png")
    for run, color in zip(read, _line_colors(fig.axes[1])):
        family = next(f for f, a in arms.items() if a == run.arm)
        assert color == sweep_colors[family], (run.name, family)
    pyplot().close(fig)


def _overlaps(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def test_no_legend_covers_data(tmp_path):
    """Every legend of the loss and temperature figures lies outside every panel."""
    sweep = constructed_sweep(tmp_path)
    curves = group_curves(collect(sweep)[0])
    figures = [plot_comparison(curves, comparison_table(curves, "baseline", 2), tmp_path / "a.png"),
               plot_comparison(curves, comparison_table(curves, "baseline", 2), tmp_path / "b.png",
                               pairs=[("attnres", "attnres_tau"), ("attnres_tau", "mhar")]),
               plot_temperatures(curves, tmp_path / "t.png")]
    for fig in figures:
        renderer = fig.canvas.get_renderer()
        legends = [*fig.legends, *(ax.get_legend() for ax in fig.axes if ax.get_legend() is not None)]
        assert legends
        for legend in legends:
            box = legend.get_window_extent(renderer)
            assert not any(_overlaps(box, ax.get_window_extent(renderer)) for ax in fig.axes)
            assert 0 <= box.y0 and box.y1 <= fig.bbox.y1  # inside the saved figure
        pyplot().close(fig)


@pytest.mark.parametrize("fmt, head", [("pdf", b"%PDF"), ("svg", b"<?xml")])
def test_figures_as_pdf_and_svg_with_the_same_bytes_for_the_same_runs(tmp_path, fmt, head):
    sweep = constructed_sweep(tmp_path)
    out = tmp_path / "results"
    assert experiments_main(["results", str(sweep.path), "--out", str(out), "--format", fmt]) == 0
    figures = sorted(p.name for p in out.iterdir() if p.suffix == f".{fmt}")
    assert figures == [f"loss_vs_tokens.{fmt}", f"routing_temperature.{fmt}"]
    first = {name: (out / name).read_bytes() for name in figures}
    assert all(data.startswith(head) for data in first.values())
    assert all(b"CreationDate" not in data and b"Matplotlib v" not in data for data in first.values())
    assert f"](loss_vs_tokens.{fmt})" in (out / "RESULTS.md").read_text()
    assert experiments_main(["results", str(sweep.path), "--out", str(out), "--format", fmt, "--overwrite"]) == 0
    assert {name: (out / name).read_bytes() for name in figures} == first
    cmp = tmp_path / "cmp"
    assert analysis_main(["compare", *(str(r.run_dir) for r in sweep.runs[:2]), "--out", str(cmp), "--format", fmt]) == 0
    assert (cmp / f"loss_vs_tokens.{fmt}").read_bytes().startswith(head)


def test_tables_and_plots_give_a_loss_in_one_unit(tmp_path, capsys):
    """A byte-level sweep: its results' tables, like its plot, in bits per byte (nats / ln 2), and
    so the comparison table of its run folders; a token-level one in nats per token."""
    sweep = constructed_sweep(tmp_path, grid='[sweep.set]\n"data.tokenizer" = "bytes"')
    out = tmp_path / "results"
    assert experiments_main(["results", str(sweep.path), "--out", str(out)]) == 0
    text = (out / "RESULTS.md").read_text()
    assert "Losses in bits per byte, in the tables and the plots." in text and "nats" not in text
    mhar_s2 = sum(VAL["mhar"][2][-2:]) / 2  # the tail mean of mhar_s2, in nats per byte
    base_s2 = sum(VAL["baseline"][2][-2:]) / 2
    row = re.search(r"^\| mhar_s2 \| 2 \| (\S+) \| 2 \| (\S+) \|", text, re.M)
    assert float(row[1]) == pytest.approx(mhar_s2 / math.log(2), abs=1e-4)
    assert float(row[2]) == pytest.approx((mhar_s2 - base_s2) / math.log(2), abs=1e-4)
    fig = plot_comparison(group_curves(collect(sweep)[0]), comparison_table(group_curves(collect(sweep)[0])),
                          tmp_path / "p.png")
    assert {ax.get_ylabel() for ax in fig.axes} == {"loss (bits per byte)", "difference (bits per byte)"}
    pyplot().close(fig)
    runs = [r.run_dir for r in sweep.runs if r.seed == 2 and r.family in ("baseline", "mhar")]
    capsys.readouterr()
    assert analysis_main(["compare", *map(str, runs), "-k", "2", "--out", str(tmp_path / "cmp")]) == 0
    table = (tmp_path / "cmp" / "comparison.md").read_text()
    assert "tail-mean val loss (last 2, bits per byte)" in table
    assert f"| mhar_s2 | {mhar_s2 / math.log(2):.4f} | 2 | {(mhar_s2 - base_s2) / math.log(2):+.4f} |" in table
    # the gpt2 sweep: nats per token everywhere
    (tmp_path / "gpt2").mkdir()
    gpt2 = constructed_sweep(tmp_path / "gpt2")
    assert experiments_main(["results", str(gpt2.path), "--out", str(tmp_path / "r2")]) == 0
    assert "Losses in nats per token" in (tmp_path / "r2" / "RESULTS.md").read_text()
