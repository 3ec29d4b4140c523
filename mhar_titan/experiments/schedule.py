"""Schedule-matched runs: two arms of one experiment (a control and a treatment, e.g. plain
continued pretraining and its delta-MHAR conversion) must differ only in the model.

Two runs are *schedule-matched* when they have

- the same learning rate at every step: the LR settings (``optimizer.lr``, ``[lr_scheduler]``,
  ``training.steps``) and the LR at every step both have (every planned step of a config, the
  logged steps of a run folder);
- the same tokens per step (global batch x ``training.seq_len``);
- the same data order: ``mhar_titan.analysis.compare``'s "paired" notion (``data_order``: the
  ``[data]`` keys that decide the tokens, a mixture's sources and weights among them, and the
  effective seed).

Either side may be a job config (a TOML file: its planned schedule, for ``--world-size``
ranks, built from the config alone as the dry run does) or a run folder (what its
``config.toml`` and metrics file say it did). ``schedule_differences`` lists the
differences, the first one first, in the order above.
"""
from __future__ import annotations

import dataclasses
import pathlib
from typing import Optional

from mhar_titan.analysis.compare import data_order, order_differences, run_metrics
from mhar_titan.components.batches import batch_geometry
from mhar_titan.config import ConfigError, JobConfig, load_config
from mhar_titan.optim import WarmupStableDecay

LR_SETTINGS = (("optimizer", "lr"), ("lr_scheduler", "warmup_steps"), ("lr_scheduler", "decay_ratio"),
               ("lr_scheduler", "decay_type"), ("lr_scheduler", "min_lr_factor"), ("training", "steps"))
"""The settings the LR of a step depends on (``optim.WarmupStableDecay``)."""


@dataclasses.dataclass
class Schedule:
    """What two arms must share: LR per step, tokens per step, data order."""

    name: str
    lr: dict[int, float]
    """Step (1-based) -> LR: every step of a config, the logged steps of a run folder."""
    tokens_per_step: float
    order: Optional[dict]
    """``compare.data_order`` (None for a run folder without ``config.toml``)."""
    settings: dict[str, object]
    """"section.key" -> value of ``LR_SETTINGS`` (empty without a config)."""
    planned: bool
    """True for a config's plan, False for what a run folder logged."""

    @property
    def what(self) -> str:
        return "planned" if self.planned else "logged"


def _settings(cfg: JobConfig) -> dict[str, object]:
    return {f"{section}.{key}": getattr(getattr(cfg, section), key) for section, key in LR_SETTINGS}


def planned_schedule(cfg: JobConfig, world_size: int = 1, name: str = "") -> Schedule:
    """The schedule a job config plans on ``world_size`` data-parallel ranks (no model, no data).

    Raises:
        ConfigError: the global batch does not split over ``world_size`` ranks.
    """
    s, t = cfg.lr_scheduler, cfg.training
    fn = WarmupStableDecay(t.steps, s.warmup_steps, s.decay_ratio, s.decay_type, s.min_lr_factor)
    global_batch, _ = batch_geometry(t, world_size)
    tokens = float(global_batch * t.seq_len)
    return Schedule(name or cfg.job.name, {k: cfg.optimizer.lr * fn.factor(k) for k in range(1, t.steps + 1)},
                    tokens, data_order(cfg, tokens), _settings(cfg), planned=True)


def logged_schedule(run_dir: str | pathlib.Path) -> Schedule:
    """The schedule a run folder's metrics file logged (``lr`` and ``tokens_seen`` of its training rows).

    Raises:
        FileNotFoundError: not a run folder. ValueError: no training row with ``lr`` and ``tokens_seen``.
    """
    path = pathlib.Path(run_dir)
    cfg, rows, metrics = run_metrics(path)
    lr = {step: float(r["lr"]) for step, r in sorted(rows.items()) if step > 0 and "lr" in r}
    seen = [(step, r["tokens_seen"]) for step, r in sorted(rows.items()) if step > 0 and "tokens_seen" in r]
    if not lr or not seen:
        raise ValueError(f"{metrics} has no training row with lr and tokens_seen: was the run trained?")
    tokens = seen[-1][1] / seen[-1][0]
    return Schedule(path.name, lr, tokens, data_order(cfg, tokens) if cfg is not None else None,
                    _settings(cfg) if cfg is not None else {}, planned=False)


def load_schedule(path: str | pathlib.Path, world_size: int = 1) -> Schedule:
    """A config file's planned schedule or a run folder's logged one (module docstring).

    Raises:
        ConfigError: a bad config file; FileNotFoundError: neither a file nor a run folder.
    """
    p = pathlib.Path(path)
    if p.is_dir():
        return logged_schedule(p)
    if not p.is_file():
        raise FileNotFoundError(f"{p} is neither a job config (TOML file) nor a run folder")
    return planned_schedule(load_config(str(p)), world_size, name=str(p))


def _number(v) -> str:
    return f"{v:.6g}" if isinstance(v, float) else repr(v)


def schedule_differences(a: Schedule, b: Schedule) -> list[str]:
    """What keeps ``a`` and ``b`` from being schedule-matched, the first difference first: LR
    settings (each named with both values), the LR at the first step where it differs, tokens
    per step, data order (the keys that differ). Empty when they are matched.
    """
    out = []
    both = [k for k in a.settings if k in b.settings]
    for key in both:
        if a.settings[key] != b.settings[key]:
            out.append(f"{key} = {_number(a.settings[key])} vs {_number(b.settings[key])}")
    steps = sorted(set(a.lr) & set(b.lr))
    if not steps:
        out.append(f"no step in common ({a.what} steps {min(a.lr)}-{max(a.lr)}, {b.what} {min(b.lr)}-{max(b.lr)})")
    else:
        first = next((k for k in steps if a.lr[k] != b.lr[k]), None)
        if first is not None:
            out.append(f"LR at step {first}: {a.lr[first]:.6g} vs {b.lr[first]:.6g}")
    if a.tokens_per_step != b.tokens_per_step:
        out.append(f"tokens per step {a.tokens_per_step:,.0f} vs {b.tokens_per_step:,.0f}")
    if a.order is not None and b.order is not None and a.order != b.order:
        keys = [k for k in order_differences(a.order, b.order) if k != "tokens_per_step"]
        if keys:
            out.append("data order: different " + ", ".join(keys))
    elif a.order is None or b.order is None:
        missing = a.name if a.order is None else b.name
        out.append(f"data order unknown: {missing} has no config.toml")
    return out


def check_schedule(a: Schedule, b: Schedule) -> str:
    """The line saying what ``a`` and ``b`` share when they are schedule-matched.

    Raises:
        ConfigError: they are not, naming the first difference (and the others after it).
    """
    diffs = schedule_differences(a, b)
    if diffs:
        more = f" (also: {'; '.join(diffs[1:])})" if len(diffs) > 1 else ""
        raise ConfigError(f"{a.name} and {b.name} are not schedule-matched: {diffs[0]}{more}")
    steps = sorted(set(a.lr) & set(b.lr))
    sources = a.order["data"].get("sources") or []
    data = (", ".join(f"{s['name']}={s['weight']:g}" for s in sources) if sources else "one source")
    return (f"schedule-matched: {a.name} ({a.what}) and {b.name} ({b.what}): the same LR at {len(steps):,} steps "
            f"(peak {max(a.lr.values()):.6g}, last {a.lr[steps[-1]]:.6g}), {a.tokens_per_step:,.0f} tokens per step, "
            f"the same data order (data: {data}; seed {a.order['data']['seed']})")
