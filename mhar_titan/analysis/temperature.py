"""The learned routing temperature per routing site, read from checkpoints, and its figure.

A run with ``model.routing_temperature = "learned"`` learns one temperature per routing site and
head, t = exp(log_temperature), the factor every depth logit of that site and head is multiplied
by (``DepthRouting.temperatures``). The metrics log only its mean, min and max over sites and
heads (``metrics.TEMPERATURE_KEYS``, drawn against tokens by ``compare.plot_temperatures``); where
the temperature went site by site is read here from the newest complete checkpoint of each run
(the weight EMA when the checkpoint holds one, as ``eval.load.load_run`` loads it): one tensor
of the checkpoint, without building the model.
"""
from __future__ import annotations

import dataclasses
import pathlib
from typing import Mapping, Optional, Sequence

import numpy as np

from mhar_titan.analysis.compare import RunCurves
from mhar_titan.analysis.plots import legend_below, new_figure, save_figure

SITES_PER_COLUMN = 28
"""Routing sites whose names fit under a column-wide figure (at ``heatmap.FONT_PT``)."""
TEMPERATURE_KEY = "routing.log_temperature"
"""The learned log-temperatures' key in a model state dict: (S sites, H heads)."""


@dataclasses.dataclass(frozen=True)
class SiteTemperatures:
    """The learned temperatures of one curve (a run, or a family over its seeds) at its runs'
    newest complete checkpoints."""

    name: str
    arm: Optional[str]
    steps: tuple[int, ...]
    """The checkpoint step of each run read."""
    values: np.ndarray
    """(runs, S, H): t = exp(log_temperature) of each run, routing site and head."""


def read_site_temperatures(run_dir: str | pathlib.Path) -> Optional[tuple[int, np.ndarray]]:
    """(step, (S, H) temperatures) of the newest complete checkpoint of ``run_dir``; None when the
    run has no complete checkpoint or its model learns no temperature.

    Raises:
        CheckpointError: the checkpoint's files cannot be read (``checks.unreadable_error``).
    """
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    from mhar_titan.checkpoint import MARKER, read_marker
    from mhar_titan.checkpoint.checks import unreadable_error
    from mhar_titan.eval.load import find_checkpoint

    try:
        _, checkpoint = find_checkpoint(run_dir)
    except FileNotFoundError:
        return None
    try:
        saved = dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
        part = "ema" if f"ema.{TEMPERATURE_KEY}" in saved else "model"
        meta = saved.get(f"{part}.{TEMPERATURE_KEY}")
        if meta is None:
            return None
        value = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({part: {TEMPERATURE_KEY: value}}, checkpoint_id=str(checkpoint), no_dist=True)
    except Exception as e:  # noqa: BLE001 - a truncated or corrupted checkpoint: one line naming it
        raise unreadable_error(checkpoint.parent, checkpoint, e, reader=True) from None
    step = int(read_marker(checkpoint).get("step", 0)) if (checkpoint / MARKER).is_file() else 0
    return step, value.double().exp().numpy()


def site_temperatures(runs: Sequence[RunCurves],
                      run_dirs: Optional[Mapping[str, Sequence[pathlib.Path]]] = None) -> list[SiteTemperatures]:
    """The per-site temperatures of every run of ``runs`` that learned its temperature (a
    non-empty ``RunCurves.temperature``), read from ``run_dirs[run.name]`` (a family's seeds)
    or ``run.path``; runs without a readable temperature (no complete checkpoint) are left out,
    and so are runs whose sites or heads differ from their family's first.

    Raises:
        CheckpointError: a checkpoint's files cannot be read.
    """
    out = []
    for run in runs:
        if not run.temperature:
            continue
        read = [read_site_temperatures(d) for d in (run_dirs or {}).get(run.name, [run.path])]
        read = [r for r in read if r is not None]
        if read:
            shape = read[0][1].shape
            read = [r for r in read if r[1].shape == shape]
            out.append(SiteTemperatures(run.name, run.arm, tuple(s for s, _ in read), np.stack([v for _, v in read])))
    return out


def plot_site_temperatures(sites: Sequence[SiteTemperatures], runs: Sequence[RunCurves], path: str | pathlib.Path,
                           dpi: int = 200):
    """The learned temperature of every routing site (x: layer i's attention and MLP sites, then the
    final one; ``routing.site_names``; a column wide up to ``SITES_PER_COLUMN`` sites, else a page
    wide), one curve per learned run or family in its arm's colour
    (``colors.curve_styles`` over all ``runs``, as in the loss figure): the mean over heads (and
    seeds) with a band from the least to the largest head (and seed); the routed fixed-temperature
    runs' scales as grey levels; the legend below the panel, at a paper's column width. Saves the
    figure at ``path`` (format from its suffix) without version metadata; returns the figure.

    Raises:
        ValueError: ``sites`` is empty.
    """
    from mhar_titan.analysis.colors import curve_styles
    from mhar_titan.analysis.heatmap import COLUMN_WIDTH_IN, FONT_PT, PAGE_WIDTH_IN
    from mhar_titan.analysis.routing import site_names

    if not sites:
        raise ValueError("no run has a learned routing temperature in a complete checkpoint: nothing to plot")
    styles = dict(zip((r.name for r in runs), curve_styles([(r.name, r.arm) for r in runs])))
    levels: dict[float, list[str]] = {}
    for run in runs:
        if not run.temperature and run.logit_scale is not None:
            levels.setdefault(run.logit_scale, []).append(run.name)
    n_sites = max(s.values.shape[1] for s in sites)
    width = COLUMN_WIDTH_IN if n_sites <= SITES_PER_COLUMN else PAGE_WIDTH_IN
    fig, (ax,) = new_figure(1, 1, panel_size=(width, 2.4), dpi=dpi, legend_lines=len(sites) + len(levels))
    handles, labels = [], []
    widest = max(sites, key=lambda s: s.values.shape[1])
    for site in sites:
        x = np.arange(site.values.shape[1])
        color, style = styles.get(site.name, ("C0", "-"))
        line, = ax.plot(x, site.values.mean(axis=(0, 2)), marker="o", ms=2.5, lw=1, color=color, ls=style)
        ax.fill_between(x, site.values.min(axis=(0, 2)), site.values.max(axis=(0, 2)), color=color, alpha=0.25, lw=0)
        handles.append(line)
        steps = sorted(set(site.steps))
        labels.append(f"{site.name}, step {steps[0] if len(steps) == 1 else f'{steps[0]}-{steps[-1]}'}"
                      + (f", {len(site.steps)} seeds" if len(site.steps) > 1 else "")
                      + f", H = {site.values.shape[2]}")
    span = [0, widest.values.shape[1] - 1]
    for k, (scale, names) in enumerate(sorted(levels.items())):
        line, = ax.plot(span, [scale] * 2, ls=("--", ":", "-.")[k % 3], color="0.35", lw=1)
        handles.append(line)
        labels.append(f"fixed {scale:.3g}: " + (", ".join(names) if len(names) <= 2 else f"{len(names)} runs"))
    names = site_names(widest.values.shape[1])
    ax.set_xticks(range(len(names)), names, rotation=90, fontsize=FONT_PT)
    seeds = " and seeds" if any(len(s.steps) > 1 for s in sites) else ""
    ax.set_title(f"learned routing temperature per site\n(mean over heads{seeds}, band: least to largest)",
                 fontsize=FONT_PT)
    ax.set_xlabel("routing site", fontsize=FONT_PT)
    ax.set_ylabel("temperature (x depth logits)", fontsize=FONT_PT)
    ax.tick_params(labelsize=FONT_PT)
    ax.grid(alpha=0.3)
    legend_below(fig, handles, labels, FONT_PT)
    save_figure(fig, path, dpi)
    return fig
