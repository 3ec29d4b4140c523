"""Routing heatmaps: the mean depth-softmax weight of every site over every source, as PNG.

Panels, left to right: the single-head view (mean over heads), then one panel per routing
head (H > 1 only), then per-site entropy as the effective number of sources next to the
number of sources N_s. Rows are routing sites (layer i's attention and MLP sites, then the
final routing), columns are the sources of the model's source list (``RoutingSummary.columns``:
emb, a0, m0, a1, ... at sublayer granularity; block sums at block granularity). Empty cells:
the site does not read that source.
All heatmap panels share one colour scale from 0 to the largest mean weight of a site with
two or more sources (``color_scale_max``).
"""
from __future__ import annotations

import dataclasses
import pathlib

import numpy as np

from mhar_titan.analysis.plots import new_figure, pyplot
from mhar_titan.analysis.routing import RoutingSummary, site_names
from mhar_titan.files import atomic_path


@dataclasses.dataclass
class Heatmaps:
    """What ``plot_routing_heatmaps`` drew (the figure stays open for inspection; close it with
    ``pyplot().close(figure)``)."""

    path: pathlib.Path
    panels: dict[str, np.ndarray]
    """Panel title -> the (S, C) array given to imshow (``RoutingSummary.columns``; NaN = not read)."""
    vmax: float
    """Upper end of the shared colour scale (the lower end is 0)."""
    cmap: str
    figure: object
    axes: dict[str, object]
    """Panel title -> its matplotlib Axes."""


def color_scale_max(summary: RoutingSummary) -> float:
    """The largest mean weight over sites with at least two sources (a one-source site has
    weight 1 and would wash out the scale; it is drawn in the top colour); 1 if there are none."""
    peaks = [float(site.mean_weights.max()) for site in summary.sites if site.n_sources > 1]
    return max(peaks) if peaks else 1.0


def plot_routing_heatmaps(summary: RoutingSummary, path: str | pathlib.Path, title: str = "",
                          cmap: str = "viridis", dpi: int = 100) -> Heatmaps:
    """Draw the heatmaps of ``summary`` and save them as a PNG at ``path`` (folders created)."""
    plt = pyplot()
    weights = summary.mean_weights().numpy()  # (H, S, N)
    panels = {"mean over heads" if summary.heads > 1 else "single head": summary.head_mean_weights().numpy()}
    if summary.heads > 1:
        panels.update({f"head {h}": weights[h] for h in range(summary.heads)})
    vmax = color_scale_max(summary)
    n_sites, n_cols = weights.shape[1:]
    names = site_names(n_sites)
    cols = min(len(panels) + 1, 5)
    rows = -(-(len(panels) + 1) // cols)
    fig, grid = new_figure(rows, cols, panel_size=(0.28 * n_cols + 1.6, 0.28 * n_sites + 1.2), dpi=dpi)
    axes = {}
    image = None
    for ax, (name, array) in zip(grid, panels.items()):
        image = ax.imshow(np.ma.masked_invalid(array), cmap=cmap, vmin=0.0, vmax=vmax, interpolation="nearest",
                          aspect="auto")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("source")
        ax.set_yticks(range(n_sites), names, fontsize=6)
        ax.set_xticks(range(n_cols), summary.column_labels(), fontsize=6, rotation=90)
        axes[name] = ax
    ax = grid[len(panels)]
    y = np.arange(n_sites)
    ax.plot(summary.effective_sources(), y, "o-", label="effective sources exp(H)")
    ax.plot([site.n_sources for site in summary.sites], y, "k:", label="sources N")
    ax.set_ylim(n_sites - 0.5, -0.5)
    ax.set_yticks(range(n_sites), names, fontsize=6)
    ax.set_xlabel("sources")
    ax.set_title("per-site spread", fontsize=9)
    ax.legend(fontsize=6, loc="upper right")
    axes["per-site spread"] = ax
    for extra in grid[len(panels) + 1:]:
        extra.set_visible(False)
    fig.colorbar(image, ax=list(axes.values())[:-1], shrink=0.8, label="mean routing weight", extend="max")
    if title:
        fig.suptitle(title, fontsize=10)
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=dpi, format=path.suffix.lstrip(".") or "png")
    return Heatmaps(path=path, panels=panels, vmax=vmax, cmap=cmap, figure=fig, axes=axes)


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
