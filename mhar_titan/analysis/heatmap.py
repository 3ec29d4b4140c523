"""Routing heatmaps: what routing learned at every site over every source, as a PNG.

Colour: log2(w * N_s), the mean depth-softmax weight w of a source relative to the uniform
weight 1/N_s of its site (N_s sources), on a diverging map centred on 0: uniform routing is the
neutral (white) colour, red a source weighted above uniform (+1 = twice 1/N), blue below. The
raw mean weights stay in the JSON the heatmap command writes (``RoutingSummary.to_dict``).

Layout, drawn at a paper's column width (``COLUMN_WIDTH_IN``, fonts ``FONT_PT``): the mean over
heads (rows: routing sites, layer i's attention and MLP, then the final routing; columns: the
model's source list, ``RoutingSummary.columns``; empty cells: not read) beside the per-site
spread (effective sources exp(entropy), dots, against N_s, dotted line); below, one panel per routing head, two
per row, only when the heads disagree (some head's mean weight differs from the mean over heads
by at least ``agree_tol``); otherwise the heads are collapsed into the one panel.
"""
from __future__ import annotations

import dataclasses
import math
import pathlib

import numpy as np

from mhar_titan.analysis.plots import pyplot
from mhar_titan.analysis.routing import RoutingSummary, site_names
from mhar_titan.files import atomic_path

COLUMN_WIDTH_IN = 3.5
"""Figure width in inches: one column of a two-column paper."""
FONT_PT = 8
"""Tick, label and title font size (points) at that width."""


@dataclasses.dataclass
class Heatmaps:
    """What ``plot_routing_heatmaps`` drew (the figure stays open for inspection; close it with
    ``pyplot().close(figure)``)."""

    path: pathlib.Path
    panels: dict[str, np.ndarray]
    """Panel title -> the (S, C) array given to imshow: log2(weight * N_s) (NaN = not read)."""
    vmin: float
    vmax: float
    """The colour scale, symmetric around 0 (uniform routing): vmin = -vmax."""
    cmap: str
    heads_agree: bool
    """Whether the per-head panels were collapsed into the mean (H = 1 counts as agreeing)."""
    head_spread: float
    """Largest |head mean weight - mean over heads| over sites and sources (0 for H = 1)."""
    figure: object
    axes: dict[str, object]
    """Panel title -> its matplotlib Axes."""


def relative_to_uniform(weights: np.ndarray, n_sources: np.ndarray) -> np.ndarray:
    """log2(weights * N) for mean weights (..., S, C) of sites with N (S,) sources; NaN stays NaN."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.log2(np.maximum(weights, 1e-30) * n_sources[:, None])


def color_scale_max(panels: dict[str, np.ndarray]) -> float:
    """The 95th percentile of |log2(w * N)| over the panels' cells (a few near-zero weights,
    log2 -> -inf, would otherwise wash out the scale; cells beyond it take the end colours),
    at least 0.1, so that uniform routing draws white rather than stretching a zero range."""
    values = np.concatenate([np.abs(a[np.isfinite(a)]) for a in panels.values()])
    return max(0.1, float(np.percentile(values, 95))) if values.size else 1.0


def _ticks(ax, axis: str, labels: list[str], length_in: float) -> None:
    """Tick labels at FONT_PT, every k-th one so that neighbours do not overlap."""
    stride = max(1, math.ceil(FONT_PT * 1.2 / (72 * length_in / max(len(labels), 1))))
    positions = list(range(0, len(labels), stride))
    names = [labels[i] for i in positions]
    if axis == "x":
        ax.set_xticks(positions, names, fontsize=FONT_PT, rotation=90)
    else:
        ax.set_yticks(positions, names, fontsize=FONT_PT)


def plot_routing_heatmaps(summary: RoutingSummary, path: str | pathlib.Path, title: str = "",
                          cmap: str = "RdBu_r", dpi: int = 200, agree_tol: float = 0.02) -> Heatmaps:
    """Draw the heatmaps of ``summary`` (see the module doc) and save them as a PNG at ``path``
    (folders created). agree_tol: mean-weight difference below which heads count as agreeing."""
    plt = pyplot()
    weights = summary.mean_weights().numpy()  # (H, S, C)
    mean = summary.head_mean_weights().numpy()
    n = np.array([site.n_sources for site in summary.sites], dtype=np.float64)
    spread = float(np.nanmax(np.abs(weights - mean[None]))) if summary.heads > 1 else 0.0
    agree = spread < agree_tol
    first = "single head" if summary.heads == 1 else ("mean over heads" if not agree else
                                                       f"all {summary.heads} heads (agree within {agree_tol:g})")
    panels = {first: relative_to_uniform(mean, n)}
    if not agree:
        panels.update({f"head {h}": relative_to_uniform(weights[h], n) for h in range(summary.heads)})
    vmax = color_scale_max(panels)
    n_sites, n_cols = mean.shape
    names, columns = site_names(n_sites), summary.column_labels()
    panel_h = max(1.6, 0.16 * n_sites + 0.4)
    head_rows = 0 if agree else -(-summary.heads // 2)
    fig = plt.figure(figsize=(COLUMN_WIDTH_IN, panel_h * (1 + head_rows) + 0.9 + (0.25 if title else 0)),
                     dpi=dpi, layout="constrained")
    grid = fig.add_gridspec(1 + head_rows, 4)
    slots = [grid[0, :3]] + [grid[1 + h // 2, 2 * (h % 2):2 * (h % 2) + 2] for h in range(summary.heads if not agree else 0)]
    axes, image = {}, None
    for k, (slot, (name, array)) in enumerate(zip(slots, panels.items())):
        ax = fig.add_subplot(slot)
        image = ax.imshow(np.ma.masked_invalid(array), cmap=cmap, vmin=-vmax, vmax=vmax, interpolation="nearest",
                          aspect="auto")
        ax.set_title(name, fontsize=FONT_PT)
        width_in = COLUMN_WIDTH_IN * (0.6 if k == 0 else 0.45)
        _ticks(ax, "x", columns, width_in)
        _ticks(ax, "y", names, panel_h - 0.5)
        ax.set_xlabel("source", fontsize=FONT_PT)
        axes[name] = ax
    ax = fig.add_subplot(grid[0, 3], sharey=axes[first])
    y = np.arange(n_sites)
    ax.plot(summary.effective_sources(), y, "o-", ms=3)
    ax.plot(n, y, "k:")
    ax.set_title("exp(H)", fontsize=FONT_PT)
    ax.set_xlim(0, n.max() + 0.5)
    ax.xaxis.set_major_locator(pyplot().MaxNLocator(2, integer=True))
    ax.tick_params(labelsize=FONT_PT, labelleft=False)
    axes["per-site spread"] = ax
    bar = fig.colorbar(image, ax=[a for key, a in axes.items() if key != "per-site spread"], location="bottom",
                       shrink=0.8, aspect=30, extend="both")
    bar.set_label("log2(weight x N): 0 = uniform 1/N", fontsize=FONT_PT)
    bar.ax.tick_params(labelsize=FONT_PT)
    if title:
        fig.suptitle(title, fontsize=FONT_PT)
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=dpi, format=path.suffix.lstrip(".") or "png")
    return Heatmaps(path=path, panels=panels, vmin=-vmax, vmax=vmax, cmap=cmap, heads_agree=agree,
                    head_spread=spread, figure=fig, axes=axes)


def routing_report(summary: RoutingSummary, heading: str) -> str:
    """Markdown: per-site sources, entropy, effective sources and the heaviest source."""
    names = site_names(len(summary.sites))
    lines = [f"# {heading}", "", f"Routing heads H = {summary.heads}; {summary.sites[0].tokens} tokens; "
             f"mean entropy over sites {summary.mean_entropy():.4f} nats.", "",
             "| site | sources N | entropy (nats) | log N | effective sources | heaviest source (weight) |",
             "|---|---:|---:|---:|---:|---|"]
    for s, (name, site) in enumerate(zip(names, summary.sites)):
        mean = site.mean_weights.mean(0)
        top = int(mean.argmax())
        lines.append(f"| {name} | {site.n_sources} | {site.entropy:.4f} | {np.log(site.n_sources):.4f} | "
                     f"{site.effective_sources:.3f} | {summary.site_source_labels(s)[top]} ({float(mean[top]):.3f}) |")
    return "\n".join(lines) + "\n"
