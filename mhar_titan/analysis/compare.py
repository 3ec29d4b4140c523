"""Compare runs: loss curves against tokens and a tail-mean validation-loss table.

Reads each run folder's metrics JSONL (``metrics.jsonl_file`` of its ``config.toml``): training
rows carry ``loss`` and ``tokens_seen``, validation rows ``val_loss``. Tokens of a validation row
= its step x the run's tokens per step (``tokens_seen / step`` of its training rows).

* tail mean (MHAR_SPEC 3.1 "tail-mean of the last 11 evals"): the mean of the last k finite
  ``val_loss`` values; a run with fewer than k averages the ones it has, and the table says so
  ("2 of 11" in its evals column and a note under the table);
* delta: tail mean minus the baseline run's tail mean (negative = better than the baseline);
* paired: the run saw the same tokens as the baseline for the same number of steps, i.e. the same
  ``[data]`` settings that decide the order (files, tokenizer, sharding, shuffling, effective seed:
  data.seed or else debug.seed), the same sequence length and tokens per step, and the same last
  step and ``tokens_seen``. Paired deltas are much less noisy than unpaired ones (same batches,
  same validation windows); an unpaired row says what differs;
* arm: what model each run is, in the family table's terms (``models.args.family_name`` of its
  resolved ``[model]``, e.g. ``"attn_res H=1"``), so runs named by folder say what they compare;
* pairs: (A, B) runs whose difference B - A is reported and plotted (``pair_rows``,
  ``plot_comparison(pairs=...)``), for comparisons other than "each run minus the baseline",
  e.g. MHAR H = 8 against the temperature-matched single head;
* routing temperature: a run with ``model.routing_temperature = "learned"`` logs the mean, min and
  max over routing sites and heads of its learned temperatures (``metrics.TEMPERATURE_KEYS``);
  ``plot_temperatures`` draws them against tokens, beside each fixed-temperature run's scale
  (``model.routing_logit_scale``, e.g. 1/sqrt(8) for the temperature-matched single head).
"""
from __future__ import annotations

import dataclasses
import math
import pathlib
import statistics
from typing import Any, Optional, Sequence

from mhar_titan.analysis.plots import new_figure, save_figure
from mhar_titan.errors import ConfigError, missing_path

# [data] keys that do not change which tokens a step sees (workers, caches, retries, resume permissions).
_ORDER_NEUTRAL_DATA_KEYS = ("num_workers", "pin_memory", "prefetch_factor", "hub_retries", "hub_retry_backoff_s",
                            "hub_retry_max_s", "tokenizer_cache_dir", "tokenizer_file", "allow_document_reshard",
                            "allow_weight_change")


def data_order(cfg, tokens_per_step: float) -> dict:
    """What decides the tokens each step of a run with config ``cfg`` sees (module docstring:
    "paired"): the ``[data]`` keys but the order-neutral ones (a mixture's sources with their
    weights included), the effective seed (``data.seed``, else ``debug.seed``), the sequence
    length and the tokens per step."""
    data = {k: v for k, v in dataclasses.asdict(cfg.data).items() if k not in _ORDER_NEUTRAL_DATA_KEYS}
    data["seed"] = data["seed"] if data["seed"] is not None else cfg.debug.seed
    return {"data": data, "seq_len": cfg.training.seq_len, "tokens_per_step": tokens_per_step}


def order_differences(a: dict, b: dict) -> list[str]:
    """The keys in which two ``data_order`` results differ ("data.seed", "tokens_per_step", ...; a
    mixture's sources as "data.sources (web.weight 0.7 vs 0.5)")."""
    keys = [f"data.{k}" if k != "sources" else f"data.sources ({_sources_difference(a['data'][k], b['data'][k])})"
            for k in sorted(set(a["data"]) | set(b["data"])) if a["data"].get(k) != b["data"].get(k)]
    return keys + [k for k in ("seq_len", "tokens_per_step") if a[k] != b[k]]


def _sources_difference(a: Optional[list], b: Optional[list]) -> str:
    """The first difference of two mixtures' source tables (lists of dicts, ``DataConfig.sources``)."""
    names_a, names_b = [s["name"] for s in a or []], [s["name"] for s in b or []]
    if names_a != names_b:
        return f"sources {names_a} vs {names_b}"
    for sa, sb in zip(a, b):
        for key in sa:
            if sa[key] != sb.get(key):
                return f"{sa['name']}.{key} {sa[key]!r} vs {sb.get(key)!r}"
    return "differ"


@dataclasses.dataclass
class RunCurves:
    """The loss curves of one run folder."""

    name: str
    path: pathlib.Path
    train: list[tuple[int, float]]
    """(step, loss) of the training rows with a finite loss."""
    val: list[tuple[int, float]]
    """(step, val_loss) of the validation rows with a finite value, in step order."""
    tokens_per_step: float
    data_order: Optional[dict]
    """What decides the data order (see the module docstring); None without a config.toml."""
    tokens_seen: int = 0
    """``tokens_seen`` of the last training row."""
    steps: int = 0
    """Step of the last training row (the steps the run trained)."""
    tokens_per_s: tuple[float, ...] = ()
    """``tokens_per_s`` of the logged training rows after step 1 (step 1 includes start-up), in step order."""
    tokenizer: Optional[str] = None
    """``data.tokenizer`` of the run (None without a config.toml): decides the loss unit."""
    seeds: int = 1
    """Runs averaged into these curves (a sweep's family over its seeds)."""
    train_band: Optional[list[tuple[int, float, float]]] = None
    """(step, low, high): mean -/+ one standard error over the seeds (None for a single run)."""
    val_band: Optional[list[tuple[int, float, float]]] = None
    seed_val: Optional[dict[int, list[tuple[int, float]]]] = None
    """seed -> (step, val_loss) of each run averaged into these curves (None for a single run):
    what the paired difference to a baseline family is taken over (``val_difference``)."""
    arm: Optional[str] = None
    """What model the run is (module docstring: "arm"); None without a config.toml."""
    temperature: list[tuple[int, float, float, float]] = dataclasses.field(default_factory=list)
    """(step, mean, min, max) over routing sites and heads of the learned routing temperature
    (``metrics.TEMPERATURE_KEYS``; over seeds too for a seed mean: the mean of the means, the
    least min and the largest max); empty without a learned temperature."""
    logit_scale: Optional[float] = None
    """The fixed depth-logit scale of a routed run with a fixed temperature (``models.args.logit_scale``
    of ``model.routing_logit_scale``); None for a learned temperature, the baseline or without a config."""

    def tokens(self, step: int) -> float:
        return step * self.tokens_per_step

    def tail_mean(self, k: int) -> tuple[float, int]:
        """(mean of the last k validation losses, how many were averaged); NaN, 0 without any."""
        tail = [v for _, v in self.val[-k:]]
        return (sum(tail) / len(tail), len(tail)) if tail else (float("nan"), 0)


def mean_and_se(values: Sequence[float]) -> tuple[float, float]:
    """(mean, standard error of the mean) of ``values``: SE = sd / sqrt(n) with the sample
    standard deviation sd = sqrt(sum (x_i - mean)^2 / (n - 1)); SE is NaN for fewer than 2 values.

    Raises:
        ValueError: no values.
    """
    if not values:
        raise ValueError("mean_and_se needs at least one value")
    mean = math.fsum(values) / len(values)
    if len(values) < 2:
        return mean, float("nan")
    return mean, statistics.stdev(values) / math.sqrt(len(values))


@dataclasses.dataclass(frozen=True)
class Difference:
    """Validation loss of a run minus that of the baseline, at the steps both logged."""

    steps: list[int]
    mean: list[float]
    """(nats per token) the difference, averaged over the paired seeds when both are seed means."""
    band: Optional[list[tuple[float, float]]]
    """(low, high) per step: mean -/+ one standard error of the per-seed differences (None
    without two paired seeds)."""
    seeds: int
    """Seeds the difference is paired over (1 for two single runs)."""


def val_difference(run: RunCurves, base: RunCurves) -> Difference:
    """``run.val`` minus ``base.val`` (B - A). For two seed means (``seed_val`` on both), the
    difference is taken seed by seed over the seeds both have (same seed = same tokens: a paired
    difference) at the steps all of them logged, then averaged, with a band of -/+ one standard
    error over those seeds; otherwise at the steps both curves have, without a band."""
    seeds = sorted(set(run.seed_val or ()) & set(base.seed_val or ()))
    if seeds:
        a = {seed: dict(run.seed_val[seed]) for seed in seeds}
        b = {seed: dict(base.seed_val[seed]) for seed in seeds}
        steps = sorted(set.intersection(*(set(a[seed]) & set(b[seed]) for seed in seeds)))
        stats = [mean_and_se([a[seed][step] - b[seed][step] for seed in seeds]) for step in steps]
        band = [(m - se, m + se) for m, se in stats] if len(seeds) > 1 else None
        return Difference(steps, [m for m, _ in stats], band, len(seeds))
    other = dict(base.val)
    steps = [step for step, _ in run.val if step in other]
    values = dict(run.val)
    return Difference(steps, [values[step] - other[step] for step in steps], None, 1)


def _finite(value) -> Optional[float]:
    """A JSON metric as a float, None when it is missing or non-finite (written as "nan"/"inf")."""
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def run_metrics(path: pathlib.Path) -> tuple:
    """(the run's resolved config or None, {step: merged metrics row}, the metrics file) of a run folder.

    Raises:
        FileNotFoundError: no metrics file in the folder.
    """
    from mhar_titan.checkpoint.find import read_run_config
    from mhar_titan.metrics import read_jsonl_rows

    if not path.is_dir():
        raise FileNotFoundError(f"{missing_path(path, 'folder')}: pass a run folder (<dump_folder>/<job.name>)")
    cfg = read_run_config(path)
    metrics = path / (cfg.metrics.jsonl_file if cfg is not None else "metrics.jsonl")
    if not metrics.is_file():
        raise FileNotFoundError(f"{metrics} not found: is {path} a run folder (<dump_folder>/<job.name>)?")
    by_step: dict[int, dict] = {}
    for row in read_jsonl_rows(metrics):  # a torn last row (a full disk, a kill) is left out
        by_step.setdefault(int(row["step"]), {}).update(row)  # a resumed run rewrites rows: last one wins
    return cfg, by_step, metrics


def read_run(path: str | pathlib.Path, name: Optional[str] = None) -> RunCurves:
    """Load one run folder's curves.

    Raises:
        FileNotFoundError: no metrics file in the folder.
        ValueError: the metrics file has no training row with ``tokens_seen`` (tokens unknown).
    """
    from mhar_titan.metrics import TEMPERATURE_KEYS

    path = pathlib.Path(path)
    cfg, by_step, metrics = run_metrics(path)
    train, val, rates, speeds, temperature, seen, last = [], [], [], [], [], 0, 0
    for step in sorted(by_step):
        row = by_step[step]
        values = [_finite(row.get(key)) for key in TEMPERATURE_KEYS]
        if None not in values:
            temperature.append((step, *values))
        if _finite(row.get("loss")) is not None:
            train.append((step, _finite(row["loss"])))
        if _finite(row.get("val_loss")) is not None:
            val.append((step, _finite(row["val_loss"])))
        if "tokens_seen" in row and step > 0:
            rates.append(row["tokens_seen"] / step)
            seen, last = int(row["tokens_seen"]), step
        if _finite(row.get("tokens_per_s")) is not None and step > 1:
            speeds.append(_finite(row["tokens_per_s"]))
    if not rates:
        raise ValueError(f"{metrics} has no training row with tokens_seen, so tokens per step are unknown")
    order = data_order(cfg, rates[-1]) if cfg is not None else None
    arm, scale = model_of(cfg)
    return RunCurves(name=name or path.name, path=path, train=train, val=val, tokens_per_step=rates[-1],
                     data_order=order, tokens_seen=seen, steps=last, tokens_per_s=tuple(speeds),
                     tokenizer=cfg.data.tokenizer if cfg is not None else None, arm=arm, temperature=temperature,
                     logit_scale=scale)


def model_of(cfg) -> tuple[Optional[str], Optional[float]]:
    """(arm, fixed depth-logit scale) of a job config: what model it trains in the family table's
    terms (``models.args.family_name`` of its resolved ``[model]``, e.g. ``"mhar H=8"``), and
    ``routing_logit_scale`` as a number for a routed model with a fixed temperature (else None);
    (None, None) for None."""
    from mhar_titan.models.args import family_name, logit_scale, resolve_model_args

    if cfg is None:
        return None, None
    args = resolve_model_args(cfg.model, cfg.training.seq_len)
    fixed = args.residual == "attn_res" and args.routing_temperature == "fixed"
    return family_name(args), logit_scale(args.routing_logit_scale) if fixed else None


BYTE_TOKENIZER = "bytes"
"""``data.tokenizer`` of the byte-level tokenizer: one target token per byte."""


NATS_PER_TOKEN = ("nats per token", 1.0)
"""The unit the trainer logs losses in: (name, factor from nats per token)."""


def loss_unit(runs: Sequence[RunCurves]) -> tuple[str, float]:
    """(unit name, factor from nats per token) of the runs' losses: bits per byte when every
    run uses the byte tokenizer (a token is a byte: nats / ln 2), else nats per token. The one
    unit of a command's figures and tables (axis labels, table headers)."""
    if runs and all(r.tokenizer == BYTE_TOKENIZER for r in runs):
        return "bits per byte", 1.0 / math.log(2.0)
    return NATS_PER_TOKEN


@dataclasses.dataclass(frozen=True)
class TableRow:
    name: str
    tail_mean: float
    evals: int
    delta: float
    """tail_mean - baseline's tail_mean (0 for the baseline itself)."""
    paired: Optional[bool]
    """Same tokens in the same order for the same steps as the baseline; None when either run has
    no config.toml."""
    baseline: bool
    k: int = 11
    """Evaluations asked for the tail mean (``evals`` < k: the run has fewer)."""
    unpaired: str = ""
    """What differs from the baseline when ``paired`` is False (e.g. "steps 200 vs 20")."""
    arm: Optional[str] = None
    """What model the run is (``RunCurves.arm``)."""


def _differences(run: RunCurves, base: RunCurves) -> str:
    """What makes ``run`` and ``base`` not paired ("" when they saw the same tokens for the same steps)."""
    out = []
    if run.steps != base.steps:
        out.append(f"steps {run.steps} vs {base.steps}")
    if run.tokens_seen != base.tokens_seen:
        out.append(f"tokens_seen {run.tokens_seen:,} vs {base.tokens_seen:,}")
    if run.data_order != base.data_order:
        out.append("different " + ", ".join(order_differences(run.data_order, base.data_order)))
    return "; ".join(out)


def comparison_table(runs: Sequence[RunCurves], baseline: Optional[str] = None, k: int = 11) -> list[TableRow]:
    """One row per run: tail-mean validation loss over the last k evaluations, delta to the baseline.

    Args:
        runs: the runs, in table order.
        baseline: name of the baseline run (default: the first).
        k: evaluations in the tail mean (>= 1).

    Raises:
        ValueError: k < 1, or no run named ``baseline``.
    """
    if k < 1:
        raise ValueError(f"k (evaluations in the tail mean) must be >= 1, got {k}")
    names = [r.name for r in runs]
    base_name = baseline if baseline is not None else names[0]
    if base_name not in names:
        raise ValueError(f"baseline {base_name!r} is none of the runs {names}")
    base = runs[names.index(base_name)]
    base_mean, _ = base.tail_mean(k)
    rows = []
    for run in runs:
        mean, n = run.tail_mean(k)
        paired, unpaired = None, ""
        if run.data_order is not None and base.data_order is not None:
            unpaired = _differences(run, base)
            paired = not unpaired
        rows.append(TableRow(run.name, mean, n, mean - base_mean, paired, run is base, k, unpaired, run.arm))
    return rows


@dataclasses.dataclass(frozen=True)
class PairRow:
    """The tail-mean difference B - A of one pair of runs."""

    a: str
    b: str
    delta: float
    """B's tail mean minus A's (nats per token; negative = B has the lower loss)."""
    evals: tuple[int, int]
    """Evaluations in A's and B's tail means."""
    paired: Optional[bool]
    """Same tokens in the same order for the same steps (None when either has no config.toml)."""
    unpaired: str = ""
    """What differs when ``paired`` is False."""


def check_pairs(pairs: Any, names: list[str], what: str) -> tuple[tuple[str, str], ...]:
    """``pairs`` (a list of [A, B] lists) as (A, B) tuples of distinct names from ``names``
    (families of a sweep, or runs of a comparison).

    Raises:
        ConfigError: not a list of two-name lists, a name that is none of ``names``, A = B, or a
            pair given twice (the message starts with ``what``).
    """
    if not isinstance(pairs, (list, tuple)) or not all(
            isinstance(p, (list, tuple)) and len(p) == 2 and all(isinstance(n, str) for n in p) for p in pairs):
        raise ConfigError(f"{what} must be a list of [A, B] name pairs (the difference B - A is reported), "
                          f"got {pairs!r}")
    out = []
    for a, b in pairs:
        for n in (a, b):
            if n not in names:
                raise ConfigError(f"{what}: {n!r} is none of {names}")
        if a == b:
            raise ConfigError(f"{what}: pair [{a!r}, {b!r}] compares {a} with itself; give two different names")
        if (a, b) in out:
            raise ConfigError(f"{what}: pair [{a!r}, {b!r}] is given twice")
        out.append((a, b))
    return tuple(out)


def run_pairs(runs: Sequence[RunCurves], pairs) -> list[tuple[RunCurves, RunCurves]]:
    """The (A, B) runs of ``pairs`` ((A name, B name), ...).

    Raises:
        ConfigError: as ``check_pairs`` over the runs' names.
    """
    by_name = {r.name: r for r in runs}
    return [(by_name[a], by_name[b]) for a, b in check_pairs([list(p) for p in pairs], list(by_name), "pairs")]


def pair_rows(runs: Sequence[RunCurves], pairs, k: int = 11) -> list[PairRow]:
    """One row per (A, B) pair of run names: tail mean of B minus that of A over the last k
    evaluations, and whether the two are paired.

    Raises:
        ValueError: k < 1. ConfigError: as ``run_pairs``.
    """
    if k < 1:
        raise ValueError(f"k (evaluations in the tail mean) must be >= 1, got {k}")
    rows = []
    for a, b in run_pairs(runs, pairs):
        (mean_a, n_a), (mean_b, n_b) = a.tail_mean(k), b.tail_mean(k)
        paired, unpaired = None, ""
        if a.data_order is not None and b.data_order is not None:
            unpaired = _differences(b, a)
            paired = not unpaired
        rows.append(PairRow(a.name, b.name, mean_b - mean_a, (n_a, n_b), paired, unpaired))
    return rows


def pairs_markdown(rows: Sequence[PairRow], k: int, unit: tuple[str, float] = NATS_PER_TOKEN) -> str:
    """The pair rows as a Markdown table (B - A, both tail means' evaluations, paired), in ``unit``
    (``loss_unit`` of the runs: the unit the plot draws)."""
    name, scale = unit
    lines = [f"| B - A | tail-mean difference (last {k}, {name}) | evals (A, B) | paired |", "|---|---:|---|---|"]
    for r in rows:
        paired = {True: "yes", False: f"no ({r.unpaired})", None: "unknown"}[r.paired]
        lines.append(f"| {r.b} - {r.a} | {r.delta * scale:+.4f} | {r.evals[0]}, {r.evals[1]} | {paired} |")
    return "\n".join(lines) + "\n"


def short_tails(rows: Sequence[TableRow]) -> list[str]:
    """One sentence per run with fewer evaluations than the tail mean asked for."""
    return [f"{r.name} has {r.evals} of the {r.k} evaluations asked (-k {r.k}): its tail mean averages "
            f"{'those' if r.evals else 'none (NaN)'}" for r in rows if r.evals < r.k]


def table_markdown(rows: Sequence[TableRow], k: int, unit: tuple[str, float] = NATS_PER_TOKEN) -> str:
    """The table as Markdown, losses in ``unit`` (``loss_unit`` of the runs: the unit the plot
    draws); runs with fewer than k evaluations and unpaired runs are noted under it."""
    name, scale = unit
    lines = [f"| run | tail-mean val loss (last {k}, {name}) | evals | delta vs baseline | paired | arm |",
             "|---|---:|---:|---:|---|---|"]
    for r in rows:
        delta = "baseline" if r.baseline else f"{r.delta * scale:+.4f}"
        paired = "-" if r.baseline else {True: "yes", False: f"no ({r.unpaired})", None: "unknown"}[r.paired]
        evals = f"{r.evals} of {k}" if r.evals < k else str(r.evals)
        lines.append(f"| {r.name} | {r.tail_mean * scale:.4f} | {evals} | {delta} | {paired} | {r.arm or 'unknown'} |")
    notes = short_tails(rows)
    if any(r.paired is False for r in rows):
        notes.append("an unpaired delta compares runs that did not see the same tokens for the same steps")
    return "\n".join(lines) + "\n" + "".join(f"\nNote: {n}.\n" for n in notes)


def check_ylim(ylim, what: str = "ylim") -> Optional[tuple[float, float]]:
    """``ylim`` as (low, high) floats, None for an automatic range.

    Raises:
        ValueError: not two finite numbers with low < high."""
    if ylim is None:
        return None
    try:
        low, high = (float(v) for v in ylim)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be two numbers LOW HIGH, got {ylim!r}") from None
    if not (math.isfinite(low) and math.isfinite(high) and low < high):
        raise ValueError(f"{what} must be two finite numbers with LOW < HIGH, got {low:g} {high:g}")
    return low, high


def add_ylim_arguments(parser) -> None:
    """--ylim and --diff-ylim of an argparse parser: the fixed y ranges of ``plot_comparison``."""
    from mhar_titan.cli_args import number

    parser.add_argument("--ylim", type=number, nargs=2, metavar=("LOW", "HIGH"), default=None,
                        help="y range of the two loss panels, in the plot's unit (the same range for several plots)")
    parser.add_argument("--diff-ylim", type=number, nargs=2, metavar=("LOW", "HIGH"), default=None,
                        help="y range of the difference panel (validation loss minus the baseline's)")


def plot_comparison(runs: Sequence[RunCurves], rows: Sequence[TableRow], path: str | pathlib.Path,
                    dpi: int = 200, ylim: Optional[tuple[float, float]] = None,
                    diff_ylim: Optional[tuple[float, float]] = None, pairs: Sequence[tuple[str, str]] = ()):
    """Three panels against tokens, drawn at a paper's column width (`heatmap.COLUMN_WIDTH_IN`,
    fonts `heatmap.FONT_PT`), one colour per arm (`colors.curve_styles`: the same arm has the same
    colour in every panel and every figure; curves of one arm differ in line style): training loss
    (top), validation loss (middle), and the difference to the baseline, validation loss B - A for
    every other run in the run's own colour and style (`val_difference`: paired seed by seed for
    seed means, with a band of -/+ one standard error over the seeds; 0 = the baseline, drawn in
    the baseline's colour; below = lower loss). Curves averaged over seeds get a band of -/+ one
    standard error. One legend below the panels (over no data) names each run, marking the
    baseline, the runs paired with it and the seed counts. Loss unit: `loss_unit` (bits per byte
    for the byte tokenizer), on every y axis; the x axis is tokens seen.

    Args:
        ylim: (low, high) of both loss panels in that unit, e.g. to draw several comparisons on
            the same range (default: each panel's own).
        diff_ylim: (low, high) of the difference panel (default: its own range).
        pairs: (A, B) run names: the difference panel draws B - A for each pair instead
            (``val_difference(B, A)``, with its band over paired seeds), in B's colour (a second pair
            with the same B in another line style), each named in the legend; 0 = no difference
            (a grey line: it stands for no arm).

    Saves the figure at ``path`` (format from its suffix: ``plots.FORMATS``) without version
    metadata (the same runs give the same bytes); returns the figure.

    Raises:
        ValueError: ylim or diff_ylim is not two finite numbers with low < high.
        ConfigError: a pair names no run (``run_pairs``).
    """
    from mhar_titan.analysis.colors import LINE_STYLES, curve_styles
    from mhar_titan.analysis.heatmap import COLUMN_WIDTH_IN, FONT_PT
    from mhar_titan.analysis.plots import legend_below

    ylim, diff_ylim = check_ylim(ylim), check_ylim(diff_ylim, "diff_ylim")
    chosen = run_pairs(runs, pairs)
    unit, scale = loss_unit(runs)
    styles = dict(zip((r.name for r in runs), curve_styles([(r.name, r.arm) for r in runs])))
    base_row = next((k for k, row in enumerate(rows) if row.baseline), 0)
    base = runs[base_row]
    fig, (train_ax, val_ax, diff_ax) = new_figure(3, 1, panel_size=(COLUMN_WIDTH_IN, 1.75), dpi=dpi, sharex=True,
                                                  height_ratios=(1, 1, 0.9),
                                                  legend_lines=len(runs) + len(chosen) + bool(chosen))
    handles, labels = [], []
    for k, (run, row) in enumerate(zip(runs, rows)):
        label = run.name + (" (baseline)" if row.baseline and run.name != "baseline" else
                            " (paired)" if row.paired and not row.baseline else "")
        label += f", {run.seeds} seeds" if run.seeds > 1 else ""
        color, style = styles[run.name]
        train_ax.plot([run.tokens(s) for s, _ in run.train], [v * scale for _, v in run.train], lw=1, color=color,
                      ls=style)
        line, = val_ax.plot([run.tokens(s) for s, _ in run.val], [v * scale for _, v in run.val], marker="o",
                            color=color, ls=style, lw=1, ms=2.5)
        handles.append(line)
        labels.append(label)
        for ax, band in ((train_ax, run.train_band), (val_ax, run.val_band)):
            if band:
                ax.fill_between([run.tokens(s) for s, _, _ in band], [lo * scale for _, lo, _ in band],
                                [hi * scale for _, _, hi in band], color=color, alpha=0.25, lw=0)
        if k != base_row and not chosen:
            _plot_difference(diff_ax, run, base, scale, color, style)
    used: dict[str, int] = {}
    for a, b in chosen:
        color = styles[b.name][0]
        style = LINE_STYLES[used.get(color, 0) % len(LINE_STYLES)]
        used[color] = used.get(color, 0) + 1
        diff = _plot_difference(diff_ax, b, a, scale, color, style)
        handles.append(diff_ax.lines[-1])
        labels.append(f"{b.name} - {a.name} (difference panel)" + (f", {diff.seeds} paired seeds" if diff.band else ""))
    zero = diff_ax.axhline(0.0, color=styles[base.name][0] if not chosen else NO_DIFFERENCE_COLOR, lw=0.8)
    if chosen:
        handles.append(zero)
        labels.append("0 = no difference")
    banded = any(r.train_band or r.val_band for r in runs)
    paired_band = "\n(band +/- 1 SE over paired seeds)" if any(len(r.seed_val or ()) > 1 for r in runs) else ""
    for ax, title in ((train_ax, "training loss" + (" (mean, band +/- 1 SE over seeds)" if banded else "")),
                      (val_ax, "validation loss" + (" (mean, band +/- 1 SE over seeds)" if banded else "")),
                      (diff_ax, ("validation loss, B - A" if chosen else f"validation loss minus {base.name}'s")
                       + paired_band)):
        ax.set_title(title, fontsize=FONT_PT)
        ax.set_ylabel(f"loss ({unit})" if ax is not diff_ax else f"difference ({unit})", fontsize=FONT_PT)
        ax.tick_params(labelsize=FONT_PT)
        ax.xaxis.get_offset_text().set_fontsize(FONT_PT)
        ax.yaxis.get_offset_text().set_fontsize(FONT_PT)
        ax.grid(alpha=0.3)
    if ylim is not None:
        train_ax.set_ylim(*ylim)
        val_ax.set_ylim(*ylim)
    if diff_ylim is not None:
        diff_ax.set_ylim(*diff_ylim)
    diff_ax.set_xlabel("tokens seen", fontsize=FONT_PT)
    legend_below(fig, handles, labels, FONT_PT)
    save_figure(fig, path, dpi)
    return fig


NO_DIFFERENCE_COLOR = "0.35"
"""The difference panel's zero line when it draws pairs (grey: no arm's colour, ``colors.PALETTE``)."""


def _plot_difference(ax, run: RunCurves, base: RunCurves, scale: float, color, style: str) -> Difference:
    """``val_difference(run, base)`` against tokens on ``ax``, with its band over paired seeds; returns it."""
    diff = val_difference(run, base)
    x = [run.tokens(s) for s in diff.steps]
    ax.plot(x, [v * scale for v in diff.mean], marker="o", color=color, ls=style, lw=1, ms=2.5)
    if diff.band:
        ax.fill_between(x, [lo * scale for lo, _ in diff.band], [hi * scale for _, hi in diff.band],
                        color=color, alpha=0.25, lw=0)
    return diff


def plot_temperatures(runs: Sequence[RunCurves], path: str | pathlib.Path, dpi: int = 200):
    """The learned routing temperature against tokens at a paper's column width, in each arm's
    colour (`colors.curve_styles` over all ``runs``, as in the loss figure): the mean over routing
    sites and heads (line) with their min-max range (band), and the routed fixed-temperature runs'
    scales as grey levels (grey is no arm's colour), one per distinct scale naming its runs (1 for
    plain routing, 1/sqrt(8) = 0.354 for the temperature-matched single head), so a learned
    temperature reads against the fixed ones; the legend below the panel. The temperature is the
    factor every depth logit is multiplied by (below 1: a flatter depth softmax). Saves the figure
    at ``path`` (format from its suffix) without version metadata; returns the figure.

    Raises:
        ValueError: no run has a learned temperature (``RunCurves.temperature`` empty).
    """
    from mhar_titan.analysis.colors import curve_styles
    from mhar_titan.analysis.heatmap import COLUMN_WIDTH_IN, FONT_PT
    from mhar_titan.analysis.plots import legend_below

    learned = [r for r in runs if r.temperature]
    if not learned:
        raise ValueError("no run logged a learned routing temperature (model.routing_temperature = 'learned'): "
                         "nothing to plot")
    styles = dict(zip((r.name for r in runs), curve_styles([(r.name, r.arm) for r in runs])))
    levels: dict[float, list[str]] = {}
    for run in runs:
        if not run.temperature and run.logit_scale is not None:
            levels.setdefault(run.logit_scale, []).append(run.name)
    fig, (ax,) = new_figure(1, 1, panel_size=(COLUMN_WIDTH_IN, 2.4), dpi=dpi, legend_lines=len(learned) + len(levels))
    x_range = [min(r.tokens(t[0]) for r in learned for t in r.temperature),
               max(r.tokens(t[0]) for r in learned for t in r.temperature)]
    handles, labels = [], []
    for run in learned:
        x = [run.tokens(step) for step, *_ in run.temperature]
        color, style = styles[run.name]
        line, = ax.plot(x, [mean for _, mean, _, _ in run.temperature], lw=1, color=color, ls=style)
        ax.fill_between(x, [lo for _, _, lo, _ in run.temperature], [hi for _, _, _, hi in run.temperature],
                        color=color, alpha=0.25, lw=0)
        handles.append(line)
        labels.append(run.name + (f", {run.seeds} seeds" if run.seeds > 1 else ""))
    for k, (scale, names) in enumerate(sorted(levels.items())):
        line, = ax.plot(x_range, [scale] * 2, ls=("--", ":", "-.")[k % 3], color="0.35", lw=1)
        handles.append(line)
        labels.append(f"fixed {scale:.3g}: " + (", ".join(names) if len(names) <= 2 else f"{len(names)} runs"))
    seeds = ", seeds" if any(r.seeds > 1 for r in learned) else ""
    ax.set_title(f"routing temperature (learned: mean,\nband = min-max over sites, heads{seeds})", fontsize=FONT_PT)
    ax.set_ylabel("temperature (x depth logits)", fontsize=FONT_PT)
    ax.set_xlabel("tokens seen", fontsize=FONT_PT)
    ax.tick_params(labelsize=FONT_PT)
    ax.xaxis.get_offset_text().set_fontsize(FONT_PT)
    ax.grid(alpha=0.3)
    legend_below(fig, handles, labels, FONT_PT)
    save_figure(fig, path, dpi)
    return fig
