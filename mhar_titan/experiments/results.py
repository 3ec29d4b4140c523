"""Results of a sweep: a Markdown table of paired differences and the comparison plot.

Reads the run folders of a sweep (``mhar_titan.analysis.compare.read_run``) and computes, with
k = ``sweep.tail_evals``:

* tail mean of a run: the mean of its last k finite validation losses (MHAR_SPEC 3.1,
  "tail-mean of the last 11 evals");
* paired difference of a run: its tail mean minus the tail mean of the baseline-family run of the
  same seed and grid point (negative = lower loss than the baseline). Both runs read the same
  tokens in the same order (the ``paired`` column checks it from their resolved configs);
* per family and grid point, over the n seeds that have both runs: the mean paired difference
  and its standard error  SE = sd / sqrt(n),  sd = sqrt(sum (x_i - mean)^2 / (n - 1))
  (undefined for n = 1, written "n/a");
* tokens seen (the last training row) and the measured throughput: the median ``tokens_per_s``
  of the logged training rows after step 1;
* per family and grid point (``experiments.timing``): its tokens/s (median over seeds) and ratio to
  the baseline's, and its paired difference to the baseline at equal steps (the tail means above)
  beside the one at equal wall-clock time (each pair compared when its faster run ended);
* per pair (A, B) of families (``[sweep] pairs`` or ``--pair A B``) and grid point: B's tail mean
  minus A's, seed by seed over the seeds that have both runs (same tokens in the same order), then
  the mean and standard error as above: e.g. MHAR H = 8 minus the temperature-matched single head,
  the "heads or temperature?" question of the MHAR paper's v2 control.

The file also names each family's arm (``Sweep.arms``: the family-table row and the keys the
sweep adds, e.g. ``attn_res H=1 + routing_logit_scale=match_heads:8``).

The plot shows each family's loss curves averaged over seeds (at the steps all its seeds logged)
with a band of -/+ one standard error, and each family's paired validation-loss difference to the
baseline family (or, with pairs, B - A for each pair) with its band over seeds, in the tokenizer's
unit (bits per byte for the byte tokenizer), through
``mhar_titan.analysis.compare.plot_comparison``; with a learned routing temperature a second plot
shows its trajectory (``plot_temperatures``). Nothing in these files depends on the time or the
software version: rerunning on the same run folders rewrites the same bytes.
"""
from __future__ import annotations

import dataclasses
import math
import pathlib
import statistics
from typing import Callable, Optional, Sequence

from mhar_titan.analysis.compare import (RunCurves, check_pairs, comparison_table, loss_unit, mean_and_se,
                                         plot_comparison, plot_temperatures, read_run)
from mhar_titan.analysis.plots import pyplot
from mhar_titan.experiments.sweep import Run, Sweep, paired_baseline, paired_run
from mhar_titan.experiments.timing import timing_lines
from mhar_titan.files import write_text


@dataclasses.dataclass(frozen=True)
class RunResult:
    run: Run
    curves: Optional[RunCurves]
    """None when the run folder has no metrics yet."""
    tail_mean: float
    evals: int
    paired_delta: Optional[float]
    """Tail mean minus the paired baseline run's (None for baseline runs or a missing baseline)."""
    paired: Optional[bool]
    """Same data order as the paired baseline run (None when unknown)."""
    throughput: Optional[float]
    """Median tokens/s of the logged training rows after step 1."""


@dataclasses.dataclass(frozen=True)
class GroupResult:
    """One family at one grid point, over its seeds."""

    family: str
    point_tag: str
    seeds: int
    tail_mean: float
    delta_mean: Optional[float]
    delta_se: Optional[float]
    paired_seeds: int


def collect(sweep: Sweep) -> tuple[list[RunResult], list[GroupResult]]:
    """Per-run and per-group results of the sweep's run folders (missing runs count as not run)."""
    k = sweep.tail_evals
    curves = {}
    for run in sweep.runs:
        metrics = run.run_dir / run.config.metrics.jsonl_file
        curves[run.name] = read_run(run.run_dir, run.name) if metrics.is_file() else None
    results = []
    for run in sweep.runs:
        c = curves[run.name]
        tail, n = c.tail_mean(k) if c is not None else (float("nan"), 0)
        base = paired_baseline(sweep, run)
        base_c = curves[base.name] if base is not None else None
        delta, paired = None, None
        if c is not None and base_c is not None and n and base_c.tail_mean(k)[1]:
            delta = tail - base_c.tail_mean(k)[0]
            if c.data_order is not None and base_c.data_order is not None:
                paired = c.data_order == base_c.data_order
        speed = statistics.median(c.tokens_per_s) if c is not None and c.tokens_per_s else None
        results.append(RunResult(run, c, tail, n, delta, paired, speed))
    groups = []
    for group in dict.fromkeys(r.run.group for r in results):
        members = [r for r in results if r.run.group == group and r.evals]
        if not members:
            continue
        deltas = [r.paired_delta for r in members if r.paired_delta is not None]
        d_mean, d_se = mean_and_se(deltas) if deltas else (None, None)
        groups.append(GroupResult(members[0].run.family, members[0].run.point_tag.lstrip("_"), len(members),
                                  mean_and_se([r.tail_mean for r in members])[0], d_mean, d_se, len(deltas)))
    return results, groups


@dataclasses.dataclass(frozen=True)
class PairResult:
    """B - A for one pair of families at one grid point, over the seeds that have both runs."""

    a: str
    b: str
    point_tag: str
    seeds: int
    """Seeds with both runs evaluated."""
    delta_mean: Optional[float]
    """Mean over those seeds of B's tail mean minus A's (None without any)."""
    delta_se: Optional[float]
    paired: Optional[bool]
    """Every seed's two runs read the same tokens in the same order (None when unknown)."""


def pair_results(sweep: Sweep, results: Sequence[RunResult], pairs: Sequence[tuple[str, str]]) -> list[PairResult]:
    """One ``PairResult`` per pair of families and grid point (in the sweep's order of grid points)."""
    by_name = {r.run.name: r for r in results}
    out = []
    for a, b in pairs:
        for point in dict.fromkeys(r.run.point for r in results):
            deltas, orders = [], []
            for run_b in (r.run for r in results if r.run.family == b and r.run.point == point):
                rb, ra = by_name[run_b.name], by_name[paired_run(sweep, run_b, a).name]
                if ra.evals and rb.evals:
                    deltas.append(rb.tail_mean - ra.tail_mean)
                    known = ra.curves.data_order is not None and rb.curves.data_order is not None
                    orders.append(ra.curves.data_order == rb.curves.data_order if known else None)
            tag = next(r.run.point_tag for r in results if r.run.point == point).lstrip("_")
            mean, se = mean_and_se(deltas) if deltas else (None, None)
            paired = None if not orders or None in orders else all(orders)
            out.append(PairResult(a, b, tag, len(deltas), mean, se, paired))
    return out


def group_pairs(results: Sequence[RunResult], pairs: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    """The (A, B) family pairs as pairs of groups (``Run.group``: family and grid point), one per
    pair and grid point, in the sweep's order of grid points (``attnres_lr0.001``,
    ``attnres_tau_lr0.001``): what the plot's difference panel draws."""
    group_of = {(r.run.family, r.run.point): r.run.group for r in results}
    points = dict.fromkeys(r.run.point for r in results)
    return [(group_of[a, point], group_of[b, point]) for a, b in pairs for point in points]


def _num(value: Optional[float], fmt: str) -> str:
    return "n/a" if value is None or not math.isfinite(value) else format(value, fmt)


def results_markdown(sweep: Sweep, results: Sequence[RunResult], groups: Sequence[GroupResult],
                     plots: Sequence[str] = (), pairs: Sequence[PairResult] = ()) -> str:
    """The results file: how it was made, the plots (file names: the loss plot, then the learned
    routing temperature's when there is one), the arms, the per-family table of paired differences,
    the pairs' differences (when ``pairs``), the per-run table."""
    k = sweep.tail_evals
    unit = loss_unit([r.curves for r in results if r.curves is not None])[0]
    lines = [f"# Sweep {sweep.name}", "",
             f"Made by `python -m mhar_titan.experiments results {sweep.path}` from the run folders under "
             f"`{sweep.dump_folder}`. Tail mean: the mean of the last {k} validation losses (nats per token). "
             f"Paired difference: a run's tail mean minus that of the `{sweep.baseline}` run with the same seed "
             "(same tokens in the same order); mean and standard error over seeds (negative = lower loss).", ""]
    if plots:
        lines += [f"![loss against tokens, mean over seeds]({plots[0]})", "",
                  f"(The plot's losses are in {unit}; the tables' in nats per token.)", ""]
    if len(plots) > 1:
        lines += [f"![learned routing temperature against tokens]({plots[1]})", ""]
    return "\n".join(lines) + "\n" + results_tables(sweep, results, groups, pairs)


def results_tables(sweep: Sweep, results: Sequence[RunResult], groups: Sequence[GroupResult],
                   pairs: Sequence[PairResult] = ()) -> str:
    """The results file's tables (Markdown): the arms, the per-family paired differences to the
    baseline, the pairs' differences (when ``pairs``), the per-run table."""
    k = sweep.tail_evals
    lines = []
    if sweep.arms:
        lines += ["| family | arm |", "|---|---|", *(f"| {f} | {sweep.arms[f]} |" for f in sweep.families), ""]
    lines += [f"| family | grid | seeds | tail-mean val loss (mean) | paired diff vs {sweep.baseline} | SE | "
              "paired seeds |", "|---|---|---:|---:|---:|---:|---:|"]
    for g in groups:
        base = g.family == sweep.baseline
        lines.append(f"| {g.family} | {g.point_tag or '-'} | {g.seeds} | {g.tail_mean:.4f} | "
                     f"{'baseline' if base else _num(g.delta_mean, '+.4f')} | "
                     f"{'-' if base else _num(g.delta_se, '.4f')} | {'-' if base else g.paired_seeds} |")
    lines += ["", *timing_lines(sweep, results, {(g.family, g.point_tag): (g.delta_mean, g.delta_se) for g in groups})]
    if pairs:
        lines += ["", "Pairs: B's tail mean minus A's, seed by seed (same tokens in the same order), mean and "
                  "standard error over the seeds that have both runs (negative = B has the lower loss).", "",
                  "| B - A | grid | paired seeds | tail-mean diff | SE | paired |", "|---|---|---:|---:|---:|---|"]
        for p in pairs:
            paired = {True: "yes", False: "NO", None: "unknown"}[p.paired] if p.seeds else "-"
            lines.append(f"| {p.b} - {p.a} | {p.point_tag or '-'} | {p.seeds} | {_num(p.delta_mean, '+.4f')} | "
                         f"{_num(p.delta_se, '.4f')} | {paired} |")
    lines += ["", f"| run | seed | tail-mean val loss (last {k}) | evals | paired diff | paired | tokens seen | "
              "tokens/s (median) |", "|---|---:|---:|---:|---:|---|---:|---:|"]
    for r in results:
        if r.curves is None:
            lines.append(f"| {r.run.name} | {r.run.seed} | not run | 0 | - | - | - | - |")
            continue
        base = r.run.family == sweep.baseline
        paired = "-" if base else {True: "yes", False: "NO", None: "unknown"}[r.paired]
        lines.append(f"| {r.run.name} | {r.run.seed} | {_num(r.tail_mean, '.4f')} | {r.evals} | "
                     f"{'baseline' if base else _num(r.paired_delta, '+.4f')} | {paired} | "
                     f"{r.curves.tokens_seen:,} | {_num(r.throughput, ',.0f')} |")
    return "\n".join(lines) + "\n"


def _mean_curve(points: Sequence[Sequence[tuple[int, float]]]) -> tuple[list, Optional[list]]:
    """(step, mean value) at the steps every curve has, and the band (step, mean - SE, mean + SE)
    there (`mean_and_se`; None for a single curve)."""
    common = set.intersection(*(set(s for s, _ in p) for p in points))
    values = [dict(p) for p in points]
    stats = [(s, *mean_and_se([v[s] for v in values])) for s in sorted(common)]
    band = [(s, m - se, m + se) for s, m, se in stats] if len(points) > 1 else None
    return [(s, m) for s, m, _ in stats], band


def group_curves(results: Sequence[RunResult]) -> list[RunCurves]:
    """One curve per family and grid point: training and validation loss averaged over its seeds,
    with a band of -/+ one standard error when it has several, and each seed's validation curve
    (``RunCurves.seed_val``: the plot's paired difference to the baseline family)."""
    out = []
    for group in dict.fromkeys(r.run.group for r in results):
        members = [r.curves for r in results if r.run.group == group and r.curves is not None]
        if members:
            train, train_band = _mean_curve([m.train for m in members])
            val, val_band = _mean_curve([m.val for m in members])
            seeds = [r.run.seed for r in results if r.run.group == group and r.curves is not None]
            out.append(RunCurves(name=group, path=members[0].path, train=train, val=val,
                                 tokens_per_step=members[0].tokens_per_step, data_order=None,
                                 tokenizer=members[0].tokenizer, seeds=len(members), train_band=train_band,
                                 val_band=val_band, seed_val=dict(zip(seeds, (m.val for m in members))),
                                 arm=members[0].arm, temperature=_mean_temperature([m.temperature for m in members]),
                                 logit_scale=members[0].logit_scale))
    return out


def _mean_temperature(curves: Sequence[Sequence[tuple[int, float, float, float]]]) -> list:
    """(step, mean of the means, least min, largest max) of learned-temperature curves
    (``RunCurves.temperature``) at the steps all of them logged; empty if any is empty."""
    if not all(curves):
        return []
    by_step = [{step: rest for step, *rest in c} for c in curves]
    common = sorted(set.intersection(*(set(c) for c in by_step)))
    return [(step, math.fsum(c[step][0] for c in by_step) / len(by_step), min(c[step][1] for c in by_step),
             max(c[step][2] for c in by_step)) for step in common]


def write_results(sweep: Sweep, out: str | pathlib.Path, dpi: int = 200, ylim=None,
                  diff_ylim=None, pairs: Optional[Sequence[tuple[str, str]]] = None,
                  echo: Optional[Callable[[str], None]] = None) -> list[pathlib.Path]:
    """Write ``<out>/RESULTS.md`` and ``<out>/loss_vs_tokens.png`` (``ylim``, ``diff_ylim``: the
    plot's fixed y ranges, as ``plot_comparison``), and ``<out>/routing_temperature.png``
    (``plot_temperatures``) when a family learns its routing temperature; returns the paths written.

    pairs: (A, B) families (checked by ``analysis.compare.check_pairs``) whose difference B - A the file
    tabulates and the plot's difference panel draws, at every grid point both have run (default:
    the sweep's ``pairs``; none: each family minus the baseline). echo: called with the tables
    (``results_tables``) once the files are written (the command prints them).

    Raises:
        FileNotFoundError: no run of the sweep has a metrics file yet.
        ValueError: ylim or diff_ylim is not two finite numbers with low < high.
        ConfigError: a pair names no family of the sweep.
    """
    pairs = sweep.pairs if pairs is None else check_pairs([list(p) for p in pairs], list(sweep.families), "pairs")
    results, groups = collect(sweep)
    if not groups:
        raise FileNotFoundError(f"no run of sweep {sweep.name} has metrics under {sweep.dump_folder}; "
                                f"run it first: python -m mhar_titan.experiments run {sweep.path} "
                                f"--dump-folder {sweep.dump_folder}")
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    curves = group_curves(results)
    names = [c.name for c in curves]
    baseline = next((r.run.group for r in results if r.run.family == sweep.baseline and r.run.group in names),
                    names[0])
    png = out / "loss_vs_tokens.png"
    plotted = [(a, b) for a, b in group_pairs(results, pairs) if a in names and b in names]
    fig = plot_comparison(curves, comparison_table(curves, baseline, sweep.tail_evals), png, dpi=dpi, ylim=ylim,
                          diff_ylim=diff_ylim, pairs=plotted)
    pyplot().close(fig)
    written = [png]
    if any(c.temperature for c in curves):
        written.append(out / "routing_temperature.png")
        pyplot().close(plot_temperatures(curves, written[-1], dpi=dpi))
    md = out / "RESULTS.md"
    pair_rows = pair_results(sweep, results, pairs)
    write_text(md, results_markdown(sweep, results, groups, [p.name for p in written], pair_rows))
    if echo is not None:
        echo(results_tables(sweep, results, groups, pair_rows))
    return [md, *written]
