"""Mixing heatmaps of the depth connections other than depth routing: DenseFormer's weights
alpha, MUDDFormer's mean dynamic weights per stream, and the n-stream connections' mixing per site
(Hyper-Connections' alpha and beta, mHC's pre, post and comb).

Such a connection hands the observer of `Transformer.observe_routing` every mixing weight it
computes (`models.connections.base.MixObserver`): a name ("block i") and the weights, either one per
source (n,) or one per token, stream and source (B, T, C, n). `MixRecorder` is that observer: it
averages each block's weights over the tokens as the forward runs (float64 sums), so a sharded
model needs no unshard. `mixing_summary` runs the model over token batches and returns, per stream,
an (L, L+1) matrix: row i block i's mean weight of source j (the token embedding X_0 = S_0, then
block j-1's output), NaN where block i does not read source j:

- DenseFormer: one panel, "alpha": its weights do not depend on the token, and its parameter
  module gives them as that matrix with the sources a dilated or periodic average reads in place
  (`DenseWeights.matrix()`, what `mixing_summary` takes from a module that offers `matrix()`);
- MUDDFormer: one panel per stream (`MuddWeights.stream_names`: Q, K, V, R), the mean over tokens of
  dw[c, j] over the sources S_0..S_{i+1} of block i; the last block makes the R stream alone (its
  Q, K and V rows are NaN). Streams are aligned from the last (a block with fewer streams makes the
  last ones);
- Hyper-Connections and mHC (a parameter module with `mix_weights`: the names its sites give the
  observer, "site s <kind>", and each kind's own dimensions): one panel per kind, row s the mean
  over tokens of site s's weights (s = 2i for block i's attention, 2i + 1 for its MLP), flattened:
  (n,) weights in columns H0..H{n-1}; (a, b) matrices in columns "i,j" (Hyper-Connections' alpha: i,0
  the read weight of stream i, i,c stream i's weight in the new stream c-1; mHC's comb: i,j stream
  i's weight in the new stream j; beta and post: the write into stream i; pre: the read). mHC's
  learned exit adds an "exit" panel of one row. Static Hyper-Connections' weights are the same for
  every token: their mean is the weights.

Colour: the weight itself on a diverging map centred on 0 (a weight can be negative), symmetric,
-vmax..+vmax: by default the largest |weight| drawn; `vmax` fixes it across runs.
"""
from __future__ import annotations

import dataclasses
import math
import pathlib
import re
from typing import Iterable, Optional

import numpy as np
import torch
from torch import Tensor

from mhar_titan.progress import progress

BLOCK = re.compile(r"^block (\d+)$")
"""The names the connections give their per-block weights."""


class MixRecorder:
    """`observer(name, weights)` of a connection other than depth routing (`base.MixObserver`):
    per name, the float64 sum of the weights over the tokens ((B, T, C, n) per token, or (n,) per
    forward) and how many were summed; `mean(name)` is (C, n) (C = 1 for per-source weights).

    Args:
        dims: the n-stream connections' `mix_weights` ({kind: the weights' own dimensions}, kind
            the name's last word): a weight with more dimensions leads with its tokens' (B, T),
            which are averaged over; `mean(name)` has the weights' own shape. None: the convention
            above."""

    def __init__(self, dims: Optional[dict[str, int]] = None):
        self.sums: dict[str, Tensor] = {}
        self.counts: dict[str, int] = {}
        self.dims = dims

    @torch.no_grad()
    def __call__(self, name: str, weights: Tensor) -> None:
        w = weights.detach().double()
        if self.dims is not None:
            own = self.dims[name.rsplit(" ", 1)[-1]]
            count = math.prod(w.shape[:w.dim() - own])
            w = w.reshape(-1, *w.shape[w.dim() - own:]).sum(0)
        elif w.dim() >= 3:  # per token: (B, T, C, n)
            count, w = w[..., 0, 0].numel(), w.flatten(0, w.dim() - 3).sum(0)
        else:
            count, w = 1, w.reshape(1, -1)
        total = self.sums.get(name)
        self.sums[name] = w.cpu() if total is None else total + w.cpu()
        self.counts[name] = self.counts.get(name, 0) + count

    def mean(self, name: str) -> Tensor:
        return self.sums[name] / self.counts[name]


@dataclasses.dataclass
class MixingSummary:
    """The mean mixing weights of one model (module docstring): `panels` {stream: (L, L+1)
    float64 array, NaN where not read}, `tokens` the tokens averaged over (0 for static weights).
    For an n-stream connection `rows` labels the panels' rows (its sites, or the exit) and
    `columns` each panel's columns {panel: labels}; None for the depth-history connections."""

    panels: dict[str, np.ndarray]
    tokens: int
    rows: Optional[dict[str, list[str]]] = None
    columns: Optional[dict[str, list[str]]] = None

    def column_labels(self, panel: Optional[str] = None) -> list[str]:
        """emb, then b0, b1, ...: the output of block j (X_{j+1}, MUDDFormer's S_{j+1}); an n-stream
        connection's panel `panel` (default the first): its own (module docstring)."""
        if self.columns is not None:
            return self.columns[panel or next(iter(self.panels))]
        n = next(iter(self.panels.values())).shape[1]
        return ["emb"] + [f"b{j}" for j in range(n - 1)]

    def row_labels(self, panel: Optional[str] = None) -> list[str]:
        """block 0, block 1, ...; an n-stream connection's panel: its sites ("0 attn", "0 mlp", ...)."""
        if self.rows is not None:
            return self.rows[panel or next(iter(self.panels))]
        return [f"block {i}" for i in range(next(iter(self.panels.values())).shape[0])]

    def to_dict(self) -> dict:
        panels = {k: [[None if math.isnan(v) else v for v in row] for row in a.tolist()]
                  for k, a in self.panels.items()}
        if self.columns is not None:
            return {"tokens": self.tokens, "rows": self.rows, "columns": self.columns, "panels": panels}
        return {"tokens": self.tokens, "columns": self.column_labels(), "panels": panels}


def mixes(model: torch.nn.Module) -> bool:
    """Whether `model`'s depth connection has mixing weights to draw: connection parameters and no
    routing sites (depth routing is drawn by `heatmap.plot_routing_heatmaps`)."""
    plan = getattr(model, "plan", None)
    return getattr(model, "routing", None) is not None and not (plan is not None and plan.sites)


@torch.no_grad()
def mixing_summary(model: torch.nn.Module, batches: Iterable[Tensor], desc: str = "mixing") -> MixingSummary:
    """The mean mixing weights of a plain (unsharded) model (module docstring); `batches` of token
    ids (B, T) are read only where the weights depend on the token (no `matrix()` on the
    connection's parameter module).

    Raises:
        ValueError: the model has no mixing weights (`mixes`), or no batches where they are needed.
    """
    if not mixes(model):
        raise ValueError(f"the model (residual = {model.args.residual!r}) has no mixing weights to draw")
    params, L = model.routing, model.args.n_layers
    if hasattr(params, "matrix"):  # static weights, sources in place
        return MixingSummary({"alpha": params.matrix().double().numpy()}, 0)
    recorder = MixRecorder(getattr(params, "mix_weights", None))
    device = next(model.parameters()).device
    tokens = 0
    total = len(batches) if hasattr(batches, "__len__") else None
    for x in progress(batches, total=total, desc=desc, unit="batch"):
        with model.observe_routing(recorder):
            model.hidden_states(x.to(device))
        tokens += x.numel()
    if not recorder.sums:
        raise ValueError("no batches to record the mixing weights over")
    if recorder.dims is not None:
        return _site_summary(recorder, L, tokens)
    means = {int(BLOCK.match(name).group(1)): recorder.mean(name).numpy() for name in recorder.sums}
    streams = max(m.shape[0] for m in means.values())
    names = list(getattr(params, "stream_names", ())) or [f"stream {c}" for c in range(streams)]
    panels = {name: np.full((L, L + 1), np.nan) for name in names}
    for block, mean in means.items():
        for c in range(mean.shape[0]):
            panels[names[streams - mean.shape[0] + c]][block, :mean.shape[1]] = mean[c]
    return MixingSummary(panels, tokens)


def _site_summary(recorder: MixRecorder, n_layers: int, tokens: int) -> MixingSummary:
    """An n-stream connection's panels from the recorded means (module docstring)."""
    panels, rows, columns = {}, {}, {}
    for kind in recorder.dims:
        names = [f"site {s} {kind}" for s in range(2 * n_layers)] if kind != "exit" else ["exit"]
        if names[0] not in recorder.sums:  # the mean of streams has no exit weights
            continue
        shape = recorder.mean(names[0]).shape
        panels[kind] = np.stack([recorder.mean(name).flatten().numpy() for name in names])
        rows[kind] = ["exit"] if kind == "exit" else [f"{s // 2} {('attn', 'mlp')[s % 2]}" for s in range(len(names))]
        columns[kind] = ([f"H{i}" for i in range(shape[0])] if len(shape) == 1 else
                         [f"{i},{j}" for i in range(shape[0]) for j in range(shape[1])])
    return MixingSummary(panels, tokens, rows, columns)


def plot_mixing(summary: MixingSummary, path: str | pathlib.Path, title: str = "", dpi: int = 200,
                vmax: Optional[float] = None, cmap: str = "RdBu_r"):
    """One heatmap per panel side by side (rows blocks, columns sources), one colour bar, saved as
    `path`; returns the figure (close it with `pyplot().close`).

    Raises:
        ValueError: vmax is not a finite number > 0.
    """
    from mhar_titan.analysis.heatmap import COLUMN_WIDTH_IN, FONT_PT, PAGE_WIDTH_IN, _ticks, check_vmax
    from mhar_titan.analysis.plots import pyplot, save_figure

    vmax = check_vmax(vmax)
    plt = pyplot()
    values = np.concatenate([a[np.isfinite(a)] for a in summary.panels.values()])
    scale = vmax if vmax is not None else max(float(np.abs(values).max()) if values.size else 1.0, 1e-6)
    k = len(summary.panels)
    width = COLUMN_WIDTH_IN if k == 1 else PAGE_WIDTH_IN
    fig = plt.figure(figsize=(width, 3.0 + (0.2 if title else 0)), dpi=dpi, layout="constrained")
    axes, image, shared = [], None, None
    sites = summary.columns is not None  # an n-stream connection: panels of their own columns and rows
    for n, (name, array) in enumerate(summary.panels.items()):
        ax = fig.add_subplot(1, k, n + 1, sharex=None if sites else shared, sharey=None if sites else shared)
        shared = shared or ax
        image = ax.imshow(np.ma.masked_invalid(array), cmap=cmap, vmin=-scale, vmax=scale, interpolation="nearest",
                          aspect="auto")
        ax.set_title(name, fontsize=FONT_PT)
        _ticks(ax, "x", summary.column_labels(name), (width - 1.0) / k)
        _ticks(ax, "y", summary.row_labels(name), 2.0)
        ax.tick_params(labelleft=n == 0 or sites, labelsize=FONT_PT)
        ax.tick_params(axis="x", labelrotation=90)
        axes.append(ax)
    fig.supxlabel("stream (i,j: stream i into new stream j)" if sites else "source", fontsize=FONT_PT)
    axes[0].set_ylabel("site" if sites else "after block", fontsize=FONT_PT)
    bar = fig.colorbar(image, ax=axes, location="right", shrink=0.9, extend="both")
    bar.set_label("mean weight" if summary.tokens else "weight", fontsize=FONT_PT)
    bar.ax.tick_params(labelsize=FONT_PT)
    if title:
        fig.suptitle(title, fontsize=FONT_PT)
    save_figure(fig, path, dpi)
    return fig


def mixing_report(summary: MixingSummary, heading: str) -> str:
    """Markdown: per panel and block, the heaviest source and the weight of the block's own output;
    for an n-stream connection per panel and site the heaviest weight and the sum of the row."""
    over = f"; mean over {summary.tokens} tokens" if summary.tokens else " (they do not depend on the token)"
    if summary.columns is not None:
        lines = [f"# {heading}", "", f"Mixing weights per site{over}.", "",
                 "| panel | site | heaviest weight | sum of weights |", "|---|---|---|---:|"]
        for name, array in summary.panels.items():
            columns, rows = summary.column_labels(name), summary.row_labels(name)
            for i, row in enumerate(array):
                top = int(np.argmax(np.abs(row)))
                lines.append(f"| {name} | {rows[i]} | {columns[top]} ({row[top]:.4f}) | {row.sum():.4f} |")
        return "\n".join(lines) + "\n"
    columns = summary.column_labels()
    lines = [f"# {heading}", "", f"Mixing weights per block{over}.", "",
             "| panel | block | own output's weight | heaviest source (weight) | sum of weights |",
             "|---|---:|---:|---|---:|"]
    for name, array in summary.panels.items():
        for i, row in enumerate(array):
            if not np.nan_to_num(row).any():  # a block without this stream, or without an average
                continue
            top = int(np.nanargmax(np.abs(row)))
            lines.append(f"| {name} | {i} | {row[i + 1]:.4f} | {columns[top]} ({row[top]:.4f}) | "
                         f"{np.nansum(row):.4f} |")
    return "\n".join(lines) + "\n"
