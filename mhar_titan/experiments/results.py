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

* per temperature arm (``temperature_shares``: a single-head family whose only difference from
  another family of the sweep, the single head R, is its routing temperature: a fixed logit scale
  or a learned one) and MHAR family M of the same model but for its heads (for a
  ``match_heads:H`` scale, the one with H heads), at each grid point, over the seeds that have
  all three runs: the gap Y_s = M_s - R_s, what the temperature alone recovers X_s = T_s - R_s,
  and the share of the gap it recovers, mean(X) / mean(Y) (the MHAR paper v2's summary number),
  with its standard error by the delta method over the paired seeds:
  SE^2 = (var(X) - 2 r cov(X, Y) + r^2 var(Y)) / (n mean(Y)^2), r the share, var and cov over
  the seeds (n - 1 in the denominator); n/a for one seed. A gap within two standard errors of 0
  is flagged: its share says nothing.

The file also names each family's arm (``Sweep.arms``: the family-table row and the keys the
sweep adds, e.g. ``attn_res H=1 + routing_logit_scale=match_heads:8``). Every loss in the tables
and the plots is in one unit (``analysis.compare.loss_unit``: bits per byte for the byte tokenizer,
else nats per token).

The plot shows each family's loss curves averaged over seeds (at the steps all its seeds logged)
with a band of -/+ one standard error, and each family's paired validation-loss difference to the
baseline family (or, with pairs, B - A for each pair) with its band over seeds, in the tokenizer's
unit (bits per byte for the byte tokenizer), through
``mhar_titan.analysis.compare.plot_comparison``, one colour per arm in every figure
(``analysis.colors``); with a learned routing temperature a second plot shows its trajectory
(``plot_temperatures``) and a third its value per routing site at each run's newest checkpoint
(``analysis.temperature.plot_site_temperatures``, over the family's seeds). The figures are PNG,
PDF or SVG (``fmt``). Nothing in these files depends on the time or the software version:
rerunning on the same run folders rewrites the same bytes.
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
from mhar_titan.files import remove_stale_outputs, write_text


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


@dataclasses.dataclass(frozen=True)
class ShareResult:
    """What a temperature arm T recovers of the gap between the single head R and MHAR M at one
    grid point, over the seeds with all three runs (module docstring: "temperature arm")."""

    arm: str
    reference: str
    target: str
    point_tag: str
    seeds: int
    gap: Optional[float]
    """Mean over the seeds of M's tail mean minus R's (nats per token; None without seeds)."""
    gap_se: Optional[float]
    recovered: Optional[float]
    """Mean over the seeds of T's tail mean minus R's."""
    recovered_se: Optional[float]
    share: Optional[float]
    """recovered / gap (None without seeds or for a zero gap)."""
    share_se: Optional[float]
    """Delta-method standard error of the share over the paired seeds (None for one seed)."""

    @property
    def resolved(self) -> bool:
        """The gap is more than two standard errors from 0 (else its share says nothing)."""
        return self.gap is not None and self.gap_se is not None and abs(self.gap) > 2 * self.gap_se


def temperature_families(sweep: Sweep) -> list[tuple[str, str, str]]:
    """(temperature arm, single head, MHAR family) triples of the sweep's families, from their
    resolved model arguments (module docstring: "temperature arm"), in the sweep's family order."""
    from mhar_titan.models.args import MATCH_HEADS, ModelArgs, resolve_model_args

    first = {}
    for run in sweep.runs:
        first.setdefault(run.family, run)
    args = {f: resolve_model_args(r.config.model, r.config.training.seq_len) for f, r in first.items()}
    default = ModelArgs()
    plain = {"routing_logit_scale": default.routing_logit_scale, "routing_temperature": default.routing_temperature}
    out = []
    for arm, a in args.items():
        tempered = a.routing_temperature != plain["routing_temperature"] or \
            a.routing_logit_scale != plain["routing_logit_scale"]
        if a.residual != "attn_res" or a.routing_heads != 1 or not tempered:
            continue
        reference = next((f for f, b in args.items() if b == dataclasses.replace(a, **plain)), None)
        if reference is None:
            continue
        scale = str(a.routing_logit_scale)
        heads = int(scale[len(MATCH_HEADS):]) if a.routing_temperature == "fixed" and scale.startswith(MATCH_HEADS) \
            else None
        for target, b in args.items():
            h = b.routing_heads
            if h != 1 and (heads is None or h == heads) and b == dataclasses.replace(args[reference], routing_heads=h):
                out.append((arm, reference, target))
    return out


def _share(recovered: Sequence[float], gaps: Sequence[float]) -> tuple[Optional[float], Optional[float]]:
    """(mean(recovered) / mean(gaps), its delta-method SE over the paired seeds; module docstring)."""
    n, x, y = len(gaps), math.fsum(recovered) / len(gaps), math.fsum(gaps) / len(gaps)
    if y == 0:
        return None, None
    r = x / y
    if n < 2:
        return r, None
    var_x, var_y = statistics.variance(recovered), statistics.variance(gaps)
    cov = math.fsum((a - x) * (b - y) for a, b in zip(recovered, gaps)) / (n - 1)
    return r, math.sqrt(max(var_x - 2 * r * cov + r * r * var_y, 0.0) / n) / abs(y)


def temperature_shares(sweep: Sweep, results: Sequence[RunResult]) -> list[ShareResult]:
    """One ``ShareResult`` per (temperature arm, single head, MHAR family) of ``temperature_families``
    and grid point, over the seeds whose three runs were all evaluated."""
    by_name = {r.run.name: r for r in results}
    out = []
    for arm, reference, target in temperature_families(sweep):
        for point in dict.fromkeys(r.run.point for r in results):
            recovered, gaps = [], []
            for run in (r.run for r in results if r.run.family == arm and r.run.point == point):
                t, ref, m = (by_name[run.name], by_name[paired_run(sweep, run, reference).name],
                             by_name[paired_run(sweep, run, target).name])
                if t.evals and ref.evals and m.evals:
                    recovered.append(t.tail_mean - ref.tail_mean)
                    gaps.append(m.tail_mean - ref.tail_mean)
            tag = next(r.run.point_tag for r in results if r.run.point == point).lstrip("_")
            stats = [mean_and_se(v) if v else (None, None) for v in (gaps, recovered)]
            share, share_se = _share(recovered, gaps) if gaps else (None, None)
            se = [None if v is None or not math.isfinite(v) else v for _, v in stats]
            out.append(ShareResult(arm, reference, target, tag, len(gaps), stats[0][0], se[0], stats[1][0], se[1],
                                   share, share_se))
    return out


def _percent(value: Optional[float]) -> str:
    return "n/a" if value is None or not math.isfinite(value) else f"{100 * value:.0f}%"


def _num(value: Optional[float], fmt: str) -> str:
    return "n/a" if value is None or not math.isfinite(value) else format(value, fmt)


def results_markdown(sweep: Sweep, results: Sequence[RunResult], groups: Sequence[GroupResult],
                     plots: Sequence[str] = (), pairs: Sequence[PairResult] = (),
                     shares: Sequence[ShareResult] = ()) -> str:
    """The results file: how it was made, the plots (file names: the loss plot, then the learned
    routing temperature's against tokens and per site when there are they), the arms, the
    per-family table of paired differences, the pairs' differences (when ``pairs``), the
    temperature shares (when ``shares``), the per-run table; every loss in ``loss_unit``."""
    k = sweep.tail_evals
    unit = loss_unit([r.curves for r in results if r.curves is not None])[0]
    lines = [f"# Sweep {sweep.name}", "",
             f"Made by `python -m mhar_titan.experiments results {sweep.path}` from the run folders under "
             f"`{sweep.dump_folder}`. Losses in {unit}, in the tables and the plots. Tail mean: the mean of the last "
             f"{k} validation losses. Paired difference: a run's tail mean minus that of the `{sweep.baseline}` run "
             "with the same seed (same tokens in the same order); mean and standard error over seeds (negative = "
             "lower loss).", ""]
    titles = ["loss against tokens, mean over seeds", "learned routing temperature against tokens",
              "learned routing temperature per routing site"]
    for title, plot in zip(titles, plots):
        lines += [f"![{title}]({plot})", ""]
    return "\n".join(lines) + "\n" + results_tables(sweep, results, groups, pairs, shares)


def results_tables(sweep: Sweep, results: Sequence[RunResult], groups: Sequence[GroupResult],
                   pairs: Sequence[PairResult] = (), shares: Sequence[ShareResult] = ()) -> str:
    """The results file's tables (Markdown), losses in ``loss_unit`` of the runs: the arms, the
    per-family paired differences to the baseline, the pairs' differences (when ``pairs``), the
    temperature shares (when ``shares``), the per-run table."""
    k = sweep.tail_evals
    unit, scale = loss_unit([r.curves for r in results if r.curves is not None])

    def loss(value: Optional[float], fmt: str) -> str:
        return _num(None if value is None else value * scale, fmt)

    lines = []
    if sweep.arms:
        lines += ["| family | arm |", "|---|---|", *(f"| {f} | {sweep.arms[f]} |" for f in sweep.families), ""]
    lines += [f"| family | grid | seeds | tail-mean val loss (mean, {unit}) | paired diff vs {sweep.baseline} | SE | "
              "paired seeds |", "|---|---|---:|---:|---:|---:|---:|"]
    for g in groups:
        base = g.family == sweep.baseline
        lines.append(f"| {g.family} | {g.point_tag or '-'} | {g.seeds} | {loss(g.tail_mean, '.4f')} | "
                     f"{'baseline' if base else loss(g.delta_mean, '+.4f')} | "
                     f"{'-' if base else loss(g.delta_se, '.4f')} | {'-' if base else g.paired_seeds} |")
    lines += ["", *timing_lines(sweep, results, {(g.family, g.point_tag): (g.delta_mean, g.delta_se) for g in groups},
                                unit, scale)]
    if pairs:
        lines += ["", "Pairs: B's tail mean minus A's, seed by seed (same tokens in the same order), mean and "
                  "standard error over the seeds that have both runs (negative = B has the lower loss).", "",
                  f"| B - A | grid | paired seeds | tail-mean diff ({unit}) | SE | paired |",
                  "|---|---|---:|---:|---:|---|"]
        for p in pairs:
            paired = {True: "yes", False: "NO", None: "unknown"}[p.paired] if p.seeds else "-"
            lines.append(f"| {p.b} - {p.a} | {p.point_tag or '-'} | {p.seeds} | {loss(p.delta_mean, '+.4f')} | "
                         f"{loss(p.delta_se, '.4f')} | {paired} |")
    if shares:
        lines += ["", "Temperature share: of the gap between MHAR M and the single head R (M - R), the part the "
                  "temperature arm T recovers alone (T - R), seed by seed over the seeds with all three runs; share = "
                  "mean(T - R) / mean(M - R), with its delta-method standard error over the paired seeds (100% = the "
                  "temperature explains MHAR's whole gain).", "",
                  f"| T (temperature) | R (single head) | M (MHAR) | grid | paired seeds | gap M - R ({unit}) | SE | "
                  f"recovered T - R ({unit}) | SE | share | SE | note |",
                  "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
        for r in shares:
            note = ("no seed has all three runs yet" if not r.seeds else "" if r.resolved else
                    "one seed: no SE" if r.gap_se is None else "gap within 2 SE of 0: the share says nothing")
            lines.append(f"| {r.arm} | {r.reference} | {r.target} | {r.point_tag or '-'} | {r.seeds} | "
                         f"{loss(r.gap, '+.4f')} | {loss(r.gap_se, '.4f')} | {loss(r.recovered, '+.4f')} | "
                         f"{loss(r.recovered_se, '.4f')} | {_percent(r.share)} | {_percent(r.share_se)} | {note} |")
    lines += ["", f"| run | seed | tail-mean val loss (last {k}, {unit}) | evals | paired diff | paired | "
              "tokens seen | tokens/s (median) |", "|---|---:|---:|---:|---:|---|---:|---:|"]
    for r in results:
        if r.curves is None:
            lines.append(f"| {r.run.name} | {r.run.seed} | not run | 0 | - | - | - | - |")
            continue
        base = r.run.family == sweep.baseline
        paired = "-" if base else {True: "yes", False: "NO", None: "unknown"}[r.paired]
        lines.append(f"| {r.run.name} | {r.run.seed} | {loss(r.tail_mean, '.4f')} | {r.evals} | "
                     f"{'baseline' if base else loss(r.paired_delta, '+.4f')} | {paired} | "
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
                  echo: Optional[Callable[[str], None]] = None, fmt: str = "png") -> list[pathlib.Path]:
    """Write ``<out>/RESULTS.md`` and ``<out>/loss_vs_tokens.<fmt>`` (``ylim``, ``diff_ylim``: the
    plot's fixed y ranges, as ``plot_comparison``), and, when a family learns its routing
    temperature, ``<out>/routing_temperature.<fmt>`` (``plot_temperatures``) and
    ``<out>/temperature_sites.<fmt>`` (``plot_site_temperatures``, from the runs' newest
    checkpoints, when they have one); returns the paths written. ``fmt``: png, pdf or svg
    (``analysis.plots.FORMATS``). A figure ``<out>`` holds from an earlier call that this one
    does not draw is removed (the caller decides whether earlier results may be replaced:
    ``files.check_new_outputs``, ``results_outputs``).

    pairs: (A, B) families (checked by ``analysis.compare.check_pairs``) whose difference B - A the file
    tabulates and the plot's difference panel draws, at every grid point both have run (default:
    the sweep's ``pairs``; none: each family minus the baseline). echo: called with the tables
    (``results_tables``) once the files are written (the command prints them).

    Raises:
        FileNotFoundError: no run of the sweep has a metrics file yet.
        ValueError: ylim or diff_ylim is not two finite numbers with low < high.
        ConfigError: a pair names no family of the sweep.
        CheckpointError: a learned-temperature run's newest checkpoint cannot be read.
    """
    from mhar_titan.analysis.temperature import plot_site_temperatures, site_temperatures

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
    figure = out / f"loss_vs_tokens.{fmt}"
    plotted = [(a, b) for a, b in group_pairs(results, pairs) if a in names and b in names]
    fig = plot_comparison(curves, comparison_table(curves, baseline, sweep.tail_evals), figure, dpi=dpi, ylim=ylim,
                          diff_ylim=diff_ylim, pairs=plotted)
    pyplot().close(fig)
    written = [figure]
    if any(c.temperature for c in curves):
        written.append(out / f"routing_temperature.{fmt}")
        pyplot().close(plot_temperatures(curves, written[-1], dpi=dpi))
        dirs = {g: [r.run.run_dir for r in results if r.run.group == g and r.curves is not None] for g in names}
        sites = site_temperatures(curves, dirs)
        if sites:
            written.append(out / f"temperature_sites.{fmt}")
            pyplot().close(plot_site_temperatures(sites, curves, written[-1], dpi=dpi))
    md = out / "RESULTS.md"
    pair_rows = pair_results(sweep, results, pairs)
    shares = temperature_shares(sweep, results)
    write_text(md, results_markdown(sweep, results, groups, [p.name for p in written], pair_rows, shares))
    remove_stale_outputs(results_outputs(out), [md, *written])
    if echo is not None:
        echo(results_tables(sweep, results, groups, pair_rows, shares))
    return [md, *written]


def results_outputs(out: str | pathlib.Path) -> list[pathlib.Path]:
    """Every file ``write_results(sweep, out, fmt=...)`` may write, in any figure format."""
    from mhar_titan.analysis.plots import FORMATS

    out = pathlib.Path(out)
    return [out / "RESULTS.md", *(out / f"{name}.{fmt}" for name in ("loss_vs_tokens", "routing_temperature",
                                                                        "temperature_sites") for fmt in FORMATS)]
