"""DenseFormer (Pagliardini et al. 2024, "DenseFormer: Enhancing Information Flow in Transformers via
Depth Weighted Averaging", section 3): `residual = "dense"`.

X_0 is the token embedding; block i (a standard pre-norm block, additive residuals inside) maps its
input Y_i to its output X_{i+1}; after it, a depth-weighted average (DWA)

    Y_{i+1} = sum_j alpha_{i,j} X_j   over j <= i+1 with j = i+1 (mod k)   (dilation k)

feeds the next block, one learned scalar per (block, source), where (i+1) % p == 0 (period p);
elsewhere Y_{i+1} = X_{i+1}. The last Y is the read-out before the final norm. alpha_{i,i+1} = 1 and
every other alpha_{i,j} = 0 at initialisation, so the model starts exactly as the pre-norm baseline.
k = `dense_dilation`, p = `dense_period` (the reference's defaults, 1 and 1: L(L+3)/2 weights).
Reference: `epfml/DenseFormer`, `denseformer/denseformer.py` (`DWAModules`), which keeps the block
outputs in a preallocated accumulator; here the outputs are the flow's depth history (one tensor per
block, kept for the backward as the reference's accumulator rows are), and each average is a sum of
scaled history entries: no stack of sources is made per average.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from mhar_kernels.depth_buffer import DepthBuffer
from mhar_kernels.depth_mix import host_reads, mix_rows

from ..args import dense_averages, dense_sources
from .base import Connection


class DenseWeights(nn.Module):
    """DenseFormer's weights (`Transformer.routing`): `alpha`, one flat parameter holding, for every
    block i that averages (`args.dense_averages`), its weights over `args.dense_sources(i)` in order,
    block after block (shape (L(L+3)/2,) at k = p = 1). `segments`: (block, the sources it reads)."""

    def __init__(self, args):
        super().__init__()
        self.n_layers = args.n_layers
        self.segments = tuple((i, dense_sources(args, i)) for i in range(args.n_layers) if dense_averages(args, i))
        self.alpha = nn.Parameter(torch.empty(sum(len(s) for _, s in self.segments)))

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Every block's own output weighted 1, earlier outputs 0: the pre-norm baseline."""
        nn.init.zeros_(self.alpha)
        for weights in self.alpha.split([len(s) for _, s in self.segments]):
            weights[-1] = 1.0

    def rows(self) -> dict[int, Tensor]:
        """{block: its weights (n,)}, views of `alpha` (one split per forward)."""
        return dict(zip((i for i, _ in self.segments), self.alpha.split([len(s) for _, s in self.segments])))

    @torch.no_grad()
    def matrix(self) -> Tensor:
        """The weights as an (L, L+1) fp32 matrix on the CPU: row i the average after block i over
        X_0..X_L (0 for a source it does not read, a row of zeros where block i does not average)."""
        out = torch.zeros(self.n_layers, self.n_layers + 1)
        for (block, sources), weights in zip(self.segments, self.alpha.split([len(s) for _, s in self.segments])):
            out[block, list(sources)] = weights.detach().float().cpu()
        return out


class DenseLink:
    """Block i's link: the block is a pre-norm block over its input y; its MLP write makes the
    block's output X = h + m and the average Y over the earlier outputs it reads and X with
    `weights` (None where block i does not average: Y = X). Eager: X is written into the depth
    buffer's slot i+1 after the write that made `token`, and Y is the weighted sum of the rows
    `reads`; compiled: `sources` are the earlier outputs it reads as tensors (`buffer` None). The
    block returns (X, Y, the newest write's token)."""

    __slots__ = ("layer", "weights", "sources", "buffer", "reads", "token")

    def __init__(self, layer: int, weights: Tensor | None, sources: tuple[Tensor, ...], buffer: DepthBuffer | None = None,
                 reads=None, token: Tensor | None = None):
        self.layer, self.weights, self.sources = layer, weights, sources
        self.buffer, self.reads, self.token = buffer, reads, token

    def enter(self, y: Tensor) -> Tensor:
        return y

    def read(self, sublayer: int, h: Tensor) -> Tensor:
        return h

    def write(self, sublayer: int, h: Tensor, output: Tensor):
        x = h + output
        if sublayer == 0:
            return x
        if self.buffer is None:
            return x, weighted_sum(self.weights, (*self.sources, x)) if self.weights is not None else x, None
        token = self.buffer.write(self.layer + 1, x, self.token)
        return x, mix_rows(self.buffer, self.reads, token, self.weights) if self.weights is not None else x, token

    def leave(self, state):
        return state


def weighted_sum(weights: Tensor, sources: tuple[Tensor, ...]) -> Tensor:
    """sum_j weights[j] sources[j] (each (B, T, d)), left to right, in the sources' dtype."""
    weights = weights.to(sources[0].dtype)
    total = weights[0] * sources[0]
    for j in range(1, len(sources)):
        total = total + weights[j] * sources[j]
    return total


class DenseFlow:
    """One forward of DenseFormer: the depth history X_0.. (X_0 the embedding; a depth buffer's rows,
    or a list where the blocks are compiled) and the next block's input Y. An observer
    (`base.MixObserver`) sees each block's weights (n,) as "block i"."""

    def __init__(self, connection: "DenseFormer", params: DenseWeights, x0: Tensor, observer=None,
                 buffered: bool = True):
        self.args, self.reads, self.observer = connection.args, connection.reads, observer
        self.history, self.y, self.token = [x0], x0, None
        self.weights = params.rows()
        self.buffer = DepthBuffer(self.args.n_layers + 1, x0) if buffered and not torch.compiler.is_compiling() else None
        if self.buffer is not None:
            self.token = self.buffer.write(0, x0, None)

    def block(self, layer: int) -> tuple[Tensor, DenseLink]:
        weights = self.weights.get(layer)
        if weights is not None and self.observer is not None:
            self.observer(f"block {layer}", weights.detach())
        if self.buffer is not None:
            return self.y, DenseLink(layer, weights, (), self.buffer, self.reads.get(layer), self.token)
        sources = tuple(self.history[j] for j in dense_sources(self.args, layer)[:-1]) if weights is not None else ()
        return self.y, DenseLink(layer, weights, sources)

    def done(self, layer: int, returned: tuple[Tensor, Tensor, Tensor | None]) -> None:
        x, self.y, self.token = returned
        if self.buffer is None:
            self.history.append(x)

    def final(self) -> Tensor:
        return self.y


class DenseFormer(Connection):
    """`residual = "dense"` (module docstring)."""

    name = "dense"

    def __init__(self, args):
        super().__init__(args)
        calls = [(i, dense_sources(args, i)) for i in range(args.n_layers) if dense_averages(args, i)]
        later = [set().union(*(set(rows) for _, rows in calls[n + 1:])) for n in range(len(calls))]
        self.reads = {i: host_reads(rows, tuple(j in after for j in rows)) for (i, rows), after in zip(calls, later)}
        """{block: the `Reads` of its average on the depth buffer (X_j in slot j)}, made once."""

    def parameters(self) -> DenseWeights:
        return DenseWeights(self.args)

    def flow(self, params: DenseWeights, x0: Tensor, observer=None, buffered: bool = True) -> DenseFlow:
        return DenseFlow(self, params, x0, observer, buffered)
