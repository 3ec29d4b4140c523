"""Routing heatmaps: what routing learned at every site over every source, as PNG figures.

Colour: log2(w * N_s), the mean depth-softmax weight w of a source relative to the uniform
weight 1/N_s of its site (N_s sources), on a diverging map centred on 0: uniform routing is the
neutral (white) colour, red a source weighted above uniform (+1 = twice 1/N), blue below. The
colour range is symmetric, -vmax to +vmax: by default the 95th percentile of |log2(w N)| over
every panel drawn (``color_scale_max``); pass ``vmax`` to fix it, so that the figures of two runs
use the same colours for the same values. The raw mean weights stay in the JSON the heatmap
command writes (``RoutingSummary.to_dict``).

Two figures:

* the mean over heads, one column of a two-column paper (``COLUMN_WIDTH_IN`` x
  ``COLUMN_HEIGHT_IN``, fonts ``FONT_PT``): rows are the routing sites (layer i's attention and
  MLP, then the final routing), columns the model's source list (``RoutingSummary.columns``;
  empty cells: not read); beside it each site's effective number of sources exp(entropy) against
  its N_s sources (the value of uniform routing), with a legend, titled with the routing
  temperature when one is given (``temperature_label``: the logit scale, or the learned
  temperatures' range); the weights, hence exp(entropy), are those of the effective logits the
  forward routes with (``Router.weights``: the scale or learned temperature folded in);
* one panel per routing head, on a grid of up to ``HEADS_PER_ROW`` panels a row (the page's text
  width, ``PAGE_WIDTH_IN``; a column for two heads), with the site names on the first column
  only, the source names on the bottom row only and one colour bar, in its own file, drawn only
  when the heads disagree (some head's mean weight differs from the mean over heads by at least
  ``agree_tol``); otherwise the heads are collapsed into the one panel of the first figure.
"""
from __future__ import annotations

import dataclasses
import math
import pathlib
from typing import Optional

import numpy as np

from mhar_titan.analysis.plots import pyplot, save_figure
from mhar_titan.analysis.routing import RoutingSummary, site_names

COLUMN_WIDTH_IN = 3.5
"""Figure width in inches: one column of a two-column paper."""
COLUMN_HEIGHT_IN = 3.5
"""Height of the mean-over-heads figure (inches): it fits a column as a square."""
PAGE_WIDTH_IN = 7.0
"""Width of the per-head grid with more than two heads (inches): a page's text width."""
HEADS_PER_ROW = 4
FONT_PT = 8
"""Tick, label, legend and title font size (points) at those widths."""


@dataclasses.dataclass
class Heatmaps:
    """What ``plot_routing_heatmaps`` drew (the figures stay open for inspection; close them with
    ``close()``)."""

    path: pathlib.Path
    """The mean-over-heads figure."""
    heads_path: Optional[pathlib.Path]
    """The per-head grid (None when the heads agree and none was drawn)."""
    panels: dict[str, np.ndarray]
    """Panel title -> the (S, C) array given to imshow: log2(weight * N_s) (NaN = not read); the
    first entry is the mean figure's panel, the others ("head h") the per-head grid's."""
    vmin: float
    vmax: float
    """The colour scale, symmetric around 0 (uniform routing): vmin = -vmax, the same in both figures."""
    cmap: str
    heads_agree: bool
    """Whether the per-head panels were collapsed into the mean (H = 1 counts as agreeing)."""
    head_spread: float
    """Largest |head mean weight - mean over heads| over sites and sources (0 for H = 1)."""
    figure: object
    heads_figure: Optional[object]
    axes: dict[str, object]
    """Panel title -> its matplotlib Axes; also "effective sources" (the mean figure's side panel)."""

    def path_of(self, panel: str) -> pathlib.Path:
        """The file that holds ``panel`` (a key of ``panels``)."""
        return self.path if panel == next(iter(self.panels)) or panel == "effective sources" else self.heads_path

    def close(self) -> None:
        for figure in (self.figure, self.heads_figure):
            if figure is not None:
                pyplot().close(figure)


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


def check_vmax(vmax: Optional[float]) -> Optional[float]:
    """``vmax`` as a float, None for the automatic range.

    Raises:
        ValueError: vmax is not a finite number > 0 (the range is -vmax..+vmax of log2(w N))."""
    if vmax is None:
        return None
    if not (isinstance(vmax, (int, float)) and math.isfinite(vmax) and vmax > 0):
        raise ValueError(f"vmax must be a finite number > 0 (the colour range is -vmax..+vmax of log2(weight x N), "
                         f"e.g. 1 for half to twice uniform), got {vmax!r}")
    return float(vmax)


def _ticks(ax, axis: str, labels: list[str], length_in: float) -> None:
    """Tick labels at FONT_PT, every k-th one so that neighbours do not overlap."""
    stride = max(1, math.ceil(FONT_PT * 1.2 / (72 * length_in / max(len(labels), 1))))
    positions = list(range(0, len(labels), stride))
    names = [labels[i] for i in positions]
    if axis == "x":
        ax.set_xticks(positions, names, fontsize=FONT_PT, rotation=90)
    else:
        ax.set_yticks(positions, names, fontsize=FONT_PT)


def _image(ax, array: np.ndarray, cmap: str, vmax: float):
    return ax.imshow(np.ma.masked_invalid(array), cmap=cmap, vmin=-vmax, vmax=vmax, interpolation="nearest",
                     aspect="auto")


def _colorbar(fig, image, axes, location: str):
    bar = fig.colorbar(image, ax=axes, location=location, shrink=0.9, aspect=30 if location == "bottom" else 20,
                       extend="both")
    bar.set_label("log2(weight x N): 0 = uniform 1/N", fontsize=FONT_PT)
    bar.ax.tick_params(labelsize=FONT_PT)
    return bar


def heads_path_for(path: str | pathlib.Path) -> pathlib.Path:
    """Default file of the per-head grid beside the mean figure's ``path``: ``<stem>_heads<suffix>``."""
    path = pathlib.Path(path)
    return path.with_name(f"{path.stem}_heads{path.suffix or '.png'}")


def temperature_label(model) -> str:
    """The routing temperature of ``model`` in words, for the spread panel: "" at the default
    (scale 1, fixed), "t = 0.354" for a fixed logit scale, "t 0.31-0.42" (min-max over sites and
    heads, ``DepthRouting.temperatures``) for a learned one."""
    routing = getattr(model, "routing", None)
    if routing is None or not routing.scaled:
        return ""
    if not routing.learned:
        return f"t = {routing.logit_scale:.3g}"
    t = routing.temperatures().detach()
    t = t.full_tensor() if hasattr(t, "full_tensor") else t
    return f"t {float(t.min()):.3g}-{float(t.max()):.3g}"


def plot_routing_heatmaps(summary: RoutingSummary, path: str | pathlib.Path, title: str = "",
                          cmap: str = "RdBu_r", dpi: int = 200, agree_tol: float = 0.02,
                          vmax: Optional[float] = None,
                          heads_path: Optional[str | pathlib.Path] = None, temperature: str = "") -> Heatmaps:
    """Draw the figures of ``summary`` (see the module doc) and save them as PNGs: the mean over
    heads at ``path``, the per-head grid (when the heads disagree) at ``heads_path`` (default
    ``heads_path_for(path)``); folders are created.

    Args:
        agree_tol: mean-weight difference below which the heads count as agreeing.
        vmax: fixed colour range -vmax..+vmax of log2(weight x N) (None: ``color_scale_max``).
        temperature: shown in the spread panel's title (``temperature_label(model)``); "" for none.

    Raises:
        ValueError: vmax is not a finite number > 0.
    """
    vmax = check_vmax(vmax)
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
    scale = vmax if vmax is not None else color_scale_max(panels)
    n_sites, _ = mean.shape
    names, columns = site_names(n_sites), summary.column_labels()

    # the mean over heads and the effective sources, one column
    fig = plt.figure(figsize=(COLUMN_WIDTH_IN, COLUMN_HEIGHT_IN), dpi=dpi, layout="constrained")
    grid = fig.add_gridspec(1, 2, width_ratios=(3, 1.15))
    ax = fig.add_subplot(grid[0, 0])
    image = _image(ax, panels[first], cmap, scale)
    ax.set_title(first, fontsize=FONT_PT)
    heat_h = COLUMN_HEIGHT_IN - 1.6 - (0.2 if title else 0)  # less the colour bar, the x labels, the titles
    _ticks(ax, "x", columns, 2.0)
    _ticks(ax, "y", names, heat_h)
    ax.set_xlabel("source", fontsize=FONT_PT)
    ax.set_ylabel("routing site", fontsize=FONT_PT)
    axes = {first: ax}
    side = fig.add_subplot(grid[0, 1], sharey=ax)
    y = np.arange(n_sites)
    side.plot(summary.effective_sources(), y, "o-", ms=2.5, lw=1, label="exp(entropy)")
    side.plot(n, y, "k:", lw=1, label="N (uniform)")
    side.set_title(f"spread\n{temperature}" if temperature else "spread", fontsize=FONT_PT)
    side.set_xlabel("effective sources", fontsize=FONT_PT)
    side.set_xlim(0, n.max() + 0.5)
    side.xaxis.set_major_locator(plt.MaxNLocator(2, integer=True))
    side.tick_params(labelsize=FONT_PT, labelleft=False)
    side.legend(fontsize=FONT_PT, frameon=False, loc="upper center", bbox_to_anchor=(0.45, -0.3),
                handlelength=1.2, borderaxespad=0)
    axes["effective sources"] = side
    _colorbar(fig, image, [ax], "bottom")
    if title:
        fig.suptitle(title, fontsize=FONT_PT)
    path = pathlib.Path(path)
    save_figure(fig, path, dpi)

    # one panel per head, a compact grid
    heads_figure, heads_file = None, None
    if not agree:
        cols = min(summary.heads, HEADS_PER_ROW)
        rows = -(-summary.heads // cols)
        width = COLUMN_WIDTH_IN if cols <= 2 else PAGE_WIDTH_IN
        panel_w = (width - 1.4) / cols
        panel_h = min(2.2, max(1.1, 0.09 * n_sites + 0.35))
        heads_figure = plt.figure(figsize=(width, panel_h * rows + 1.3 + (0.2 if title else 0)), dpi=dpi,
                                  layout="constrained")
        grid = heads_figure.add_gridspec(rows, cols)
        head_axes, shared = [], None
        for h in range(summary.heads):
            r, c = divmod(h, cols)
            ax = heads_figure.add_subplot(grid[r, c], sharex=shared, sharey=shared)
            shared = shared or ax
            name = f"head {h}"
            image = _image(ax, panels[name], cmap, scale)
            ax.set_title(name, fontsize=FONT_PT, pad=2)
            if ax is shared:  # the shared axes carry the tick labels of every panel
                _ticks(ax, "x", columns, panel_w)
                _ticks(ax, "y", names, panel_h - 0.3)
            ax.tick_params(labelbottom=h + cols >= summary.heads, labelleft=c == 0,  # bottom row, first column
                           labelsize=FONT_PT)
            ax.tick_params(axis="x", labelrotation=90)
            axes[name] = ax
            head_axes.append(ax)
        heads_figure.supxlabel("source", fontsize=FONT_PT)
        heads_figure.supylabel("routing site", fontsize=FONT_PT)
        _colorbar(heads_figure, image, head_axes, "right")
        heads_figure.suptitle(f"{title}, per head" if title else f"the {summary.heads} routing heads",
                              fontsize=FONT_PT)
        heads_file = pathlib.Path(heads_path) if heads_path is not None else heads_path_for(path)
        save_figure(heads_figure, heads_file, dpi)
    return Heatmaps(path=path, heads_path=heads_file, panels=panels, vmin=-scale, vmax=scale, cmap=cmap,
                    heads_agree=agree, head_spread=spread, figure=fig, heads_figure=heads_figure, axes=axes)


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
