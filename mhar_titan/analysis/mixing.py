"""Mixing heatmaps of the depth connections other than depth routing: DenseFormer's weights
alpha and MUDDFormer's mean dynamic weights per stream.

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
  last ones).

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
    forward) and how many were summed; `mean(name)` is (C, n) (C = 1 for per-source weights)."""

    def __init__(self):
        self.sums: dict[str, Tensor] = {}
        self.counts: dict[str, int] = {}

    @torch.no_grad()
    def __call__(self, name: str, weights: Tensor) -> None:
        w = weights.detach().double()
        if w.dim() >= 3:  # per token: (B, T, C, n)
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
    float64 array, NaN where not read}, `tokens` the tokens averaged over (0 for static weights)."""

    panels: dict[str, np.ndarray]
    tokens: int

    def column_labels(self) -> list[str]:
        """emb, then b0, b1, ...: the output of block j (X_{j+1}, MUDDFormer's S_{j+1})."""
        n = next(iter(self.panels.values())).shape[1]
        return ["emb"] + [f"b{j}" for j in range(n - 1)]

    def to_dict(self) -> dict:
        return {"tokens": self.tokens, "columns": self.column_labels(),
                "panels": {k: [[None if math.isnan(v) else v for v in row] for row in a.tolist()]
                           for k, a in self.panels.items()}}


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
    recorder = MixRecorder()
    device = next(model.parameters()).device
    tokens = 0
    total = len(batches) if hasattr(batches, "__len__") else None
    for x in progress(batches, total=total, desc=desc, unit="batch"):
        with model.observe_routing(recorder):
            model.hidden_states(x.to(device))
        tokens += x.numel()
    if not recorder.sums:
        raise ValueError("no batches to record the mixing weights over")
    means = {int(BLOCK.match(name).group(1)): recorder.mean(name).numpy() for name in recorder.sums}
    streams = max(m.shape[0] for m in means.values())
    names = list(getattr(params, "stream_names", ())) or [f"stream {c}" for c in range(streams)]
    panels = {name: np.full((L, L + 1), np.nan) for name in names}
    for block, mean in means.items():
        for c in range(mean.shape[0]):
            panels[names[streams - mean.shape[0] + c]][block, :mean.shape[1]] = mean[c]
    return MixingSummary(panels, tokens)


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
    columns = summary.column_labels()
    for n, (name, array) in enumerate(summary.panels.items()):
        ax = fig.add_subplot(1, k, n + 1, sharex=shared, sharey=shared)
        shared = shared or ax
        image = ax.imshow(np.ma.masked_invalid(array), cmap=cmap, vmin=-scale, vmax=scale, interpolation="nearest",
                          aspect="auto")
        ax.set_title(name, fontsize=FONT_PT)
        _ticks(ax, "x", columns, (width - 1.0) / k)
        _ticks(ax, "y", [f"block {i}" for i in range(array.shape[0])], 2.0)
        ax.tick_params(labelleft=n == 0, labelsize=FONT_PT)
        ax.tick_params(axis="x", labelrotation=90)
        axes.append(ax)
    fig.supxlabel("source", fontsize=FONT_PT)
    axes[0].set_ylabel("after block", fontsize=FONT_PT)
    bar = fig.colorbar(image, ax=axes, location="right", shrink=0.9, extend="both")
    bar.set_label("mean weight" if summary.tokens else "weight", fontsize=FONT_PT)
    bar.ax.tick_params(labelsize=FONT_PT)
    if title:
        fig.suptitle(title, fontsize=FONT_PT)
    save_figure(fig, path, dpi)
    return fig


def mixing_report(summary: MixingSummary, heading: str) -> str:
    """Markdown: per panel and block, the heaviest source and the weight of the block's own output."""
    columns = summary.column_labels()
    over = f"; mean over {summary.tokens} tokens" if summary.tokens else " (they do not depend on the token)"
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
