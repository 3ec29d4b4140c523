"""A sweep's arms at equal wall-clock time, beside equal steps, and their throughput.

Wall-clock of a run (`timeline`): the seconds at each logged training row, summed from its metrics
over the rows so far: the tokens trained since the previous row over the row's ``tokens_per_s``
(which the trainer measures over everything it did since the previous row: steps, validation,
checkpoint saves; the first row's includes the start-up). Nothing new is logged for it.

Per arm (family and grid point) over its seeds (`arm_timing`):

* tokens/s: the median over the seeds of each run's median ``tokens_per_s`` after step 1, and its
  ratio to the baseline family's (the same median);
* paired difference at equal wall-clock time: for each seed, T = the earlier of the two runs'
  last logged times (the faster run of the pair, which trained the same steps); the arm's
  validation loss at T minus the baseline run's at T, each interpolated linearly between the
  run's evaluations over its timeline (a run that had not reached its first evaluation at T has
  no value); mean and standard error over the seeds that have both (`analysis.compare.mean_and_se`).
  At equal steps the difference is the results' tail mean (`results.collect`). A faster arm is
  compared at its own end and the slower one before its end, where its loss is higher: the
  difference is what the arm buys per second rather than per step.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Optional, Sequence

from mhar_titan.analysis.compare import mean_and_se, run_metrics


def timeline(run_dir) -> list[tuple[int, float]]:
    """(step, seconds since the start) at every logged training row of a run folder with
    ``tokens_seen`` and a finite, positive ``tokens_per_s`` (module docstring); empty without any.

    Raises:
        FileNotFoundError: no metrics file in the folder.
    """
    _, by_step, _ = run_metrics(run_dir)
    out, seconds, seen = [], 0.0, 0
    for step in sorted(by_step):
        row = by_step[step]
        rate, tokens = row.get("tokens_per_s"), row.get("tokens_seen")
        if tokens is None or not isinstance(rate, (int, float)) or not math.isfinite(rate) or rate <= 0:
            continue
        seconds += (tokens - seen) / rate
        seen = tokens
        out.append((step, seconds))
    return out


def value_at(points: Sequence[tuple[float, float]], x: float) -> Optional[float]:
    """y at x by linear interpolation between the (x, y) `points` (x increasing); None outside them."""
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return points[0][1] if len(points) == 1 and points[0][0] == x else None


def val_over_time(val: Sequence[tuple[int, float]], times: Sequence[tuple[int, float]]) -> list[tuple[float, float]]:
    """(seconds, validation loss) of the evaluations `val` ((step, loss)) whose step the timeline
    `times` ((step, seconds)) covers, the seconds interpolated between its logged steps."""
    steps = [(float(s), t) for s, t in times]
    out = []
    for step, loss in val:
        t = value_at(steps, float(step))
        if t is not None:
            out.append((t, loss))
    return out


@dataclasses.dataclass(frozen=True)
class ArmTiming:
    """One family at one grid point, over its seeds (module docstring)."""

    family: str
    point_tag: str
    tokens_per_s: Optional[float]
    """Median over the seeds of each run's median tokens/s after step 1."""
    speed_ratio: Optional[float]
    """tokens_per_s over the baseline family's (None for the baseline or without both)."""
    seconds: Optional[float]
    """Mean over the paired seeds of T, the time the two runs are compared at."""
    delta_mean: Optional[float]
    """Mean over the paired seeds of the validation loss at T minus the baseline's."""
    delta_se: Optional[float]
    paired_seeds: int


def arm_timing(sweep, results) -> list[ArmTiming]:
    """One `ArmTiming` per family and grid point of a sweep's results (`results.collect`'s runs,
    in their order); the baseline family's row carries its tokens/s only."""
    from mhar_titan.experiments.sweep import paired_baseline

    by_name = {r.run.name: r for r in results}
    times = {r.run.name: timeline(r.run.run_dir) if r.curves is not None else [] for r in results}

    def speed(family, point) -> Optional[float]:
        runs = [r.throughput for r in results if r.run.family == family and r.run.point == point
                and r.throughput is not None]
        return statistics.median(runs) if runs else None

    out = []
    for group in dict.fromkeys(r.run.group for r in results):
        members = [r for r in results if r.run.group == group and r.curves is not None]
        if not members:
            continue
        family, point = members[0].run.family, members[0].run.point
        deltas, seconds = [], []
        for r in members:
            base = paired_baseline(sweep, r.run)
            b = by_name[base.name] if base is not None else None
            if b is None or b.curves is None or not times[r.run.name] or not times[b.run.name]:
                continue
            t = min(times[r.run.name][-1][1], times[b.run.name][-1][1])
            arm = value_at(val_over_time(r.curves.val, times[r.run.name]), t)
            ref = value_at(val_over_time(b.curves.val, times[b.run.name]), t)
            if arm is not None and ref is not None:
                deltas.append(arm - ref)
                seconds.append(t)
        mine, base_speed = speed(family, point), speed(sweep.baseline, point)
        ratio = mine / base_speed if mine and base_speed and family != sweep.baseline else None
        mean, se = mean_and_se(deltas) if deltas else (None, None)
        out.append(ArmTiming(family, members[0].run.point_tag.lstrip("_"), mine, ratio,
                             math.fsum(seconds) / len(seconds) if seconds else None, mean, se, len(deltas)))
    return out


def timing_lines(sweep, results, equal_steps: dict, unit: str = "nats per token", scale: float = 1.0) -> list[str]:
    """The results file's table of every arm at equal steps and at equal wall-clock time, with its
    tokens/s (Markdown lines). `equal_steps`: {(family, point tag): (mean, SE) of the paired
    difference at equal steps} (the results' per-family table), in nats per token like the runs'
    losses; every difference is printed times `scale`, in `unit` (`analysis.compare.loss_unit`:
    the results' other tables' unit)."""
    def num(value, fmt):
        return "n/a" if value is None or not math.isfinite(value) else format(value, fmt)

    def loss(value, fmt):
        return num(None if value is None else value * scale, fmt)

    lines = [f"Every arm against `{sweep.baseline}`, paired by seed: the difference at equal steps (tail means, "
             "as above) and at equal wall-clock time (the validation loss when the faster run of each pair ended, "
             "interpolated over each run's evaluations; `mhar_titan/experiments/timing.py`), and the throughput "
             "(median tokens/s over the seeds, and its ratio to the baseline's).", "",
             f"| family | grid | tokens/s | vs baseline | diff at equal steps ({unit}) | SE | diff at equal time | SE | "
             "at (s, mean) | paired seeds |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for a in arm_timing(sweep, results):
        base = a.family == sweep.baseline
        steps_mean, steps_se = equal_steps.get((a.family, a.point_tag), (None, None))
        cells = ["baseline", "-", "baseline", "-", "-", "-"] if base else [
            loss(steps_mean, "+.4f"), loss(steps_se, ".4f"), loss(a.delta_mean, "+.4f"), loss(a.delta_se, ".4f"),
            num(a.seconds, ",.0f"), str(a.paired_seeds)]
        lines.append(f"| {a.family} | {a.point_tag or '-'} | {num(a.tokens_per_s, ',.0f')} | "
                     f"{'-' if base else num(a.speed_ratio, '.2f')} | " + " | ".join(cells) + " |")
    return lines
