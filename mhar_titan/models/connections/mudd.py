"""MUDDFormer (Xiao et al. 2025, "MUDDFormer: Breaking Residual Bottlenecks in Transformers via
Multiway Dynamic Dense Connections", section 3): `residual = "mudd"`.

X_0 is the token embedding and X_{i+1} block i's output. After block i, per token, a small MLP
generates dynamic weights over the i+2 sources:

    dw = W2 GELU(W1 norm(X_{i+1})) + a_i                       (C x (i+2), per token)
    DA_c = sum_j dw[c, j] S_j                                   c in {Q, K, V, R}

with C = 4 streams (queries, keys, values and the residual R; after the last block R only). The
next block's attention projects its queries, keys and values from the Q, K and V streams, each
through its own input norm, and adds its output to R: h = R + attn(norm_q Q, norm_k K, norm_v V),
then X = h + MLP(norm h). Hidden width K_i = C (i+2) (4x after the last block), rounded as
(K // 64 + 1) * 64 (`args.mudd_hidden`). Initialisation: W1 ~ N(0, 1/d), W2 = 0.

Two variants (`mudd_prepost_norm`):
- plain (false; `Caiyun-AI/MUDDFormer`, `pytorch/muddformer/modeling_muddformer.py`,
  `MultiwayDynamicDenseBlock`): sources S_j = X_j, norm = RMSNorm without a scale, a_i one-hot on
  the current block, streams = DA_c. Exactly the pre-norm baseline at initialisation; diverged at 24
  layers in the MHAR authors' harness.
- pre/post DA norm (true, the default; the reference's JAX code, `mudd_prenorm` / `mudd_postnorm` of
  `MUDDLlama2Medium`): sources S_j = RMSNorm_j(X_j), each with its own scale; norm = an RMSNorm with
  a scale; a_i = 0; streams = X_{i+1} + DA_c, the R stream's DA through a post-RMSNorm whose scale
  starts at 1e-3. DA = 0 at initialisation, so again exactly the pre-norm baseline.

The read-out before the final norm is the last R stream. In eager mode the sources are the rows of
one depth buffer per forward (`mhar_kernels.depth_buffer`: S_j in slot j) and every block's C
streams are one batched weighted sum of its rows (`mhar_kernels.depth_mix.mix_rows`: a view of the
rows, no stack, O(1) autograd edges); inside torch.compile'd blocks the sources are a list of
tensors and each stream a sum of scaled entries, which the compiler fuses.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mhar_kernels.depth_buffer import DepthBuffer
from mhar_kernels.depth_mix import host_reads, mix_rows

from ..args import mudd_hidden, mudd_streams
from ..norms import RMSNorm, rms_normalized
from .base import Connection


class StreamNorms(nn.Module):
    """The input norms of a MUDDFormer block's attention: (Q, K, V) -> (norm_q Q, norm_k K, norm_v V),
    each (B, T, d); `q` is the block's usual attention norm."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.q, self.k, self.v = RMSNorm(dim, eps), RMSNorm(dim, eps), RMSNorm(dim, eps)

    def forward(self, streams: tuple[Tensor, Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v = streams
        return self.q(q), self.k(k), self.v(v)


class MuddWeights(nn.Module):
    """MUDDFormer's parameters (`Transformer.routing`), per block i: `w1[i]` (K_i, d) and `w2[i]`
    (C_i (i+2), K_i) of the weight generator and `static[i]` (C_i, i+2), a_i. With the pre/post DA
    norm also `source_norm[j]` (the sources' RMSNorm scales, j = 0..L), `generator_norm[i]` (the
    generator's input norm) and `post_norm[i]` (the R stream's, scale 1e-3 at init)."""

    def __init__(self, args):
        super().__init__()
        d, L, eps = args.dim, args.n_layers, args.norm_eps
        self.prepost = args.mudd_prepost_norm
        self.w1 = nn.ModuleList(nn.Linear(d, mudd_hidden(args, i), bias=False) for i in range(L))
        self.w2 = nn.ModuleList(nn.Linear(mudd_hidden(args, i), mudd_streams(args, i) * (i + 2), bias=False)
                                for i in range(L))
        self.static = nn.ParameterList(nn.Parameter(torch.empty(mudd_streams(args, i), i + 2)) for i in range(L))
        if self.prepost:
            self.source_norm = nn.ModuleList(RMSNorm(d, eps) for _ in range(L + 1))
            self.generator_norm = nn.ModuleList(RMSNorm(d, eps) for _ in range(L))
            self.post_norm = nn.ModuleList(RMSNorm(d, eps, init=1e-3) for _ in range(L))

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """W1 ~ N(0, 1/d), W2 = 0; a_i one-hot on the current block (plain) or 0 (pre/post DA norm);
        norm scales 1, the post-norms' 1e-3: the pre-norm baseline at initialisation."""
        for w1 in self.w1:
            nn.init.normal_(w1.weight, std=1 / math.sqrt(w1.in_features))
        for w2 in self.w2:
            nn.init.zeros_(w2.weight)
        for a in self.static:
            nn.init.zeros_(a)
            if not self.prepost:
                a[:, -1] = 1.0
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.reset_parameters()


class MuddLink:
    """Block i's link: reads the streams carried in (the embedding alone into block 0; else Q, K, V
    for attention and R for the residual), and its MLP write makes X_{i+1}, its source, the dynamic
    weights and the next block's streams over the earlier sources and the new one: eager, the
    depth buffer's rows `reads` after writing the new source into slot i+1 after the write that
    made `token`; compiled, `sources` (tensors; `buffer` None). The block returns (its source, its
    streams, the newest write's token)."""

    __slots__ = ("layer", "params", "sources", "eps", "observer", "buffer", "reads", "token")

    def __init__(self, layer: int, params: MuddWeights, sources: tuple[Tensor, ...], eps: float, observer=None,
                 buffer: DepthBuffer | None = None, reads=None, token: Tensor | None = None):
        self.layer, self.params, self.sources, self.eps, self.observer = layer, params, sources, eps, observer
        self.buffer, self.reads, self.token = buffer, reads, token

    def enter(self, carried):
        return carried

    def read(self, sublayer: int, state):
        if sublayer == 1:
            return state
        return state if isinstance(state, Tensor) else state[:3]

    def write(self, sublayer: int, state, output: Tensor):
        if sublayer == 0:
            return (state if isinstance(state, Tensor) else state[3]) + output
        return mix(self, state + output)

    def leave(self, state):
        return state


def mix(link: MuddLink, x: Tensor):
    """After block i with output `x` (B, T, d): (its source S, the streams (four: Q, K, V, R, or
    after the last block the R stream alone), the newest write's token); module docstring for the
    formulas. An observer (`base.MixObserver`) sees the dynamic weights dw (B, T, C, i+2) as
    "block i"."""
    params, i, prepost = link.params, link.layer, link.params.prepost
    source = params.source_norm[i + 1](x) if prepost else x
    hidden = params.generator_norm[i](x) if prepost else rms_normalized(x, link.eps)
    C = params.static[i].shape[0]
    dw = params.w2[i](F.gelu(params.w1[i](hidden))).unflatten(-1, (C, i + 2)) + params.static[i].to(x.dtype)
    if link.observer is not None:
        link.observer(f"block {i}", dw.detach())
    token = None
    if link.buffer is not None:
        token = link.buffer.write(i + 1, source, link.token)
        mixed = mix_rows(link.buffer, link.reads, token, dw).unbind(0)
    else:
        every = (*link.sources, source)
        mixed = [sum_scaled(dw[..., c, :], every) for c in range(C)]
    if prepost:
        mixed = [x + (params.post_norm[i](da) if c == C - 1 else da) for c, da in enumerate(mixed)]
    return source, tuple(mixed), token


def sum_scaled(weights: Tensor, sources: tuple[Tensor, ...]) -> Tensor:
    """sum_j weights[..., j:j+1] sources[j] (weights (B, T, n), each source (B, T, d)), left to right."""
    total = weights[..., 0:1] * sources[0]
    for j in range(1, len(sources)):
        total = total + weights[..., j:j + 1] * sources[j]
    return total


class MuddFlow:
    """One forward of MUDDFormer: the sources S_0.. (a depth buffer's rows, or a list where the
    blocks are compiled) and the streams carried into the next block."""

    def __init__(self, connection: "MUDDFormer", params: MuddWeights, x0: Tensor, observer=None,
                 buffered: bool = True):
        self.args, self.params, self.observer, self.reads = connection.args, params, observer, connection.reads
        first = params.source_norm[0](x0) if params.prepost else x0
        self.sources, self.carried, self.token = [first], x0, None
        self.buffer = DepthBuffer(self.args.n_layers + 1, x0) if buffered and not torch.compiler.is_compiling() else None
        if self.buffer is not None:
            self.token = self.buffer.write(0, first, None)

    def block(self, layer: int):
        link = MuddLink(layer, self.params, () if self.buffer is not None else tuple(self.sources), self.args.norm_eps,
                        self.observer, self.buffer, self.reads[layer], self.token)
        return self.carried, link

    def done(self, layer: int, returned) -> None:
        source, self.carried, self.token = returned
        if self.buffer is None:
            self.sources.append(source)

    def final(self) -> Tensor:
        return self.carried[-1]


class MUDDFormer(Connection):
    """`residual = "mudd"` (module docstring)."""

    name = "mudd"

    def __init__(self, args):
        super().__init__(args)
        L = args.n_layers
        self.reads = tuple(host_reads(tuple(range(i + 2)), (i < L - 1,) * (i + 2)) for i in range(L))
        """Per block, the `Reads` of its streams on the depth buffer (S_j in slot j: every source so
        far; every block but the last adds into the rows' gradients), made once."""

    def parameters(self) -> MuddWeights:
        return MuddWeights(self.args)

    def attention_norm(self, layer: int) -> nn.Module:
        """Block 0's attention reads the embedding alone (one RMSNorm); later blocks' read three
        streams (`StreamNorms`)."""
        return super().attention_norm(layer) if layer == 0 else StreamNorms(self.args.dim, self.args.norm_eps)

    def flow(self, params: MuddWeights, x0: Tensor, observer=None, buffered: bool = True) -> MuddFlow:
        return MuddFlow(self, params, x0, observer, buffered)
