"""Grouped two-phase depth routing, eager reference (docs/DESIGN.md "Grouped routing").

`phase1` is the eager phase 1 (the fused one, `triton_grouped.route_phase1`, has the same
contract) and `merge` the eager phase 2; `mhar_kernels.dispatch` picks between them. The
models' Router maps the routing plan's groups onto these calls. Imports torch only.

The pseudo-queries do not depend on the input, so for a group of g consecutive routing sites
(the models' `RoutingPlan.groups`) the part of every site's depth softmax over the entries that exist when
the group starts can be computed at once:

- phase 1 (`phase1`, when the group starts): one pass over the group's start entries
  s_1..s_n0, each read once, computes for every site i of the group and every routing head h
  the online-softmax state over the entries site i reads (`reads[i]`)
      lse_i      = logsumexp_n l_{n,i}            l_{n,i,h} = <q_i[h], RMSNorm_{g_i}(s_n)[h]>
      mix_i      = sum_n exp(l_{n,i} - lse_i) s_n   (normalised partial mix, (B, T, d) fp32)
      norm_i     = sum_n exp(l_{n,i} - lse_i)       (= 1; its gradient carries the softmax term)
- phase 2 (`merge`, at site i): the in-group entries t_1..t_m it reads are
  merged by log-sum-exp: lse = logaddexp(lse_i, logsumexp_t l_t), and
      out = (w mix_i + sum_t a_t t) / (w norm_i + sum_t a_t),  w = exp(lse_i - lse), a_t = exp(l_t - lse)
  which is MHAR_SPEC section 2's depth softmax over all of site i's sources (exact in real
  arithmetic, not bitwise: the summation order changes).

Holding lse_i constant (not differentiable) is exact: `out` does not depend on it. With it
constant, mix_i and norm_i are plain sums over the sources, so phase 1's backward needs no
<dmix_i, mix_i> term and runs as one pass over the sources: per source, recompute its key and
the g sites' logits, then its gradient (accumulated once per group, not once per site) and the
g sites' query and key-norm gradients. The merge's gradient for norm_i is -w <dout, out> / den.

Saved for backward (beyond references to sources, which the model keeps anyway):
- phase 1, per group: lse (B, T, g, H) fp32 (returned site-major, (g, B, T, H)); the rows q, g of
  the group's sites.
- merge, per site: its output (B, T, d) in the storage dtype (as the fused per-call kernel
  saves; in fp32 the same tensor the next RMSNorm saves), w / den (B, T, H) fp32, the in-group
  weights (m, B, T, H) and inverse RMS (m, B, T) fp32.
No (B, T, d) phase-1 state is saved: mix_i lives from phase 1 until site i's merge (forward),
and its gradient from site i's merge backward until phase 1's backward.
"""
from __future__ import annotations

import functools
from typing import Sequence

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from . import contract
from .reference import _inv_rms, _logits_and_inv_rms, _normalised_key, depth_mix, rms_norm_input_grad


def _einsum(equation: str, *operands: Tensor) -> Tensor:
    """torch.einsum in the operands' dtype (the compute dtype), also under torch.autocast, which
    would run it in bf16 / fp16 (the routing statistics stay fp32, as on every other path)."""
    device_type = operands[0].device.type
    if not torch.is_autocast_enabled(device_type):
        return torch.einsum(equation, *operands)
    with torch.autocast(device_type, enabled=False):
        return torch.einsum(equation, *operands)


def _site_logits(source: Tensor, qg: Tensor, eps: float, cdt: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """Logits (..., g, H) of one source against g sites (qg = q * g, (g, H, K)), its inverse RMS
    (..., 1) and its normalised key (..., H, K) before the key-norm weight."""
    rstd = _inv_rms(source, eps, cdt)
    key = _normalised_key(source, rstd, cdt).unflatten(-1, qg.shape[1:])
    return _einsum("...hk,ghk->...gh", key, qg), rstd, key


def _key_backward(source: Tensor, rstd: Tensor, key: Tensor, dlogits: Tensor, q: Tensor, g: Tensor,
                  dq: Tensor | None, dg: Tensor | None) -> Tensor:
    """Backward through the logits of one source at g sites (MHAR_SPEC section 4, closed form, the
    storage cast taken as identity). dlogits (..., g, H); q, g (g, H, K); key (..., H, K) as from
    `_site_logits`. Adds into dq, dg (g, H, K) when given; returns d source (..., d) (key part)."""
    if dq is not None or dg is not None:
        t = _einsum("...gh,...hk->ghk", dlogits, key)  # summed over tokens
        if dq is not None:
            dq += t * g
        if dg is not None:
            dg += t * q
    return rms_norm_input_grad(source, rstd, _einsum("...gh,ghk->...hk", dlogits, q * g).flatten(-2))


def _reduce_to(grad: Tensor, source: Tensor) -> Tensor:
    """Sum a (..., d) gradient over the token dims for a broadcast (d,) null source; cast to its dtype."""
    if source.dim() == 1:
        grad = grad.sum(tuple(range(grad.dim() - 1)))
    return grad.to(source.dtype)


def _unread_mask(reads: tuple, device: torch.device) -> Tensor:
    """(n, g, 1) bool: source n is not read by site j of the group. Eager: made once per group
    shape and device (a constant table: no host-to-device copy per call, and safe under CUDA-graph
    capture); inside torch.compile a constant of the graph (dynamo traces no cache wrapper)."""
    if torch.compiler.is_compiling():
        return _unread_mask_of(reads, device)
    return _cached_unread_mask(reads, device)


def _unread_mask_of(reads: tuple, device: torch.device) -> Tensor:
    return ~torch.tensor(reads, device=device).T.unsqueeze(-1)


_cached_unread_mask = functools.lru_cache(maxsize=256)(_unread_mask_of)


class _Phase1(torch.autograd.Function):
    """Phase 1 of one group: forward(queries (g, d), norm_weights (g, d), reads (per site, one
    bool per source), heads, eps, *sources) -> (mix_1..mix_g, norm_1..norm_g, lse (g, ..., H)):
    lse site-major, lse[i] site i's (a view of the (..., g, H) tensor the backward saves).
    Forward and backward each read every source once (module docstring)."""

    @staticmethod
    def forward(ctx, queries: Tensor, norm_weights: Tensor, reads: tuple, heads: int, eps: float, *sources: Tensor):
        full = sources[-1]
        cdt = contract.compute_dtype(full.dtype)
        n_sites = queries.shape[0]
        qg = (queries.to(cdt) * norm_weights.to(cdt)).view(n_sites, heads, -1)
        unread = _unread_mask(reads, full.device)  # (n, g, 1)
        lead = full.shape[:-1]
        m = torch.full((*lead, n_sites, heads), -torch.inf, dtype=cdt, device=full.device)
        z = torch.zeros_like(m)
        acc = torch.zeros((*lead, n_sites, *qg.shape[1:]), dtype=cdt, device=full.device)
        for n, s in enumerate(sources):  # online softmax over the sources, each read once
            logits = _site_logits(s, qg, eps, cdt)[0].masked_fill(unread[n], -torch.inf)
            m_new = torch.maximum(m, logits)
            shift = torch.where(torch.isinf(m_new), 0.0, m_new)
            scale, p = torch.exp(m - shift), torch.exp(logits - shift)
            z = z * scale + p
            acc = acc * scale.unsqueeze(-1) + p.unsqueeze(-1) * s.to(cdt).unflatten(-1, (heads, -1)).unsqueeze(-3)
            m = m_new
        lse = m + torch.log(z)
        mixes = [(acc[..., i, :, :] / z[..., i, :, None]).flatten(-2) for i in range(n_sites)]
        norms = [torch.ones_like(z[..., i, :]) for i in range(n_sites)]
        ctx.save_for_backward(queries, norm_weights, lse, *sources)
        ctx.heads, ctx.reads, ctx.eps = heads, reads, eps
        by_site = lse.movedim(-2, 0)
        ctx.mark_non_differentiable(by_site)
        return (*mixes, *norms, by_site)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        queries, norm_weights, lse, *sources = ctx.saved_tensors
        heads, cdt, n_sites = ctx.heads, lse.dtype, queries.shape[0]
        q = queries.to(cdt).view(n_sites, heads, -1)
        g = norm_weights.to(cdt).view(n_sites, heads, -1)
        unread = _unread_mask(ctx.reads, lse.device)
        dmix = torch.stack([torch.zeros(lse.shape[:-2] + (q.numel() // n_sites,), dtype=cdt, device=lse.device)
                            if d is None else d.to(cdt) for d in grads[:n_sites]], -2).unflatten(-1, (heads, -1))
        dnorm = torch.stack([torch.zeros_like(lse[..., 0, :]) if d is None else d.to(cdt)
                             for d in grads[n_sites:2 * n_sites]], -2)  # (..., g, H)
        need_q, need_g = ctx.needs_input_grad[:2]
        dq = torch.zeros_like(q) if need_q else None
        dg = torch.zeros_like(g) if need_g else None
        out = []
        for n, s in enumerate(sources):  # one pass: recompute keys and logits, then all gradients
            logits, rstd, key = _site_logits(s, q * g, ctx.eps, cdt)
            a = torch.exp(logits.masked_fill(unread[n], -torch.inf) - lse)  # final-softmax weight / w
            # elementwise, then summed over K, as the merge computes <dout, out>: a site with one
            # source then gets exactly zero logit gradients, as per-call routing does
            dots = (dmix * s.to(cdt).unflatten(-1, (heads, -1)).unsqueeze(-3)).sum(-1)
            dlogits = a * (dots + dnorm)
            dv = _key_backward(s, rstd, key, dlogits, q, g, dq, dg)
            dv = dv + _einsum("...gh,...ghk->...hk", a, dmix).flatten(-2)
            out.append(_reduce_to(dv, s) if ctx.needs_input_grad[5 + n] else None)
        return (None if dq is None else dq.flatten(1).to(queries.dtype),
                None if dg is None else dg.flatten(1).to(norm_weights.dtype), None, None, None, *out)


class _Merge(torch.autograd.Function):
    """Phase 2 at one site: forward(mix, norm, lse, query (d,), norm_weight (d,), heads, eps,
    dtype, *late) -> out (B, T, d) in `dtype` (module docstring)."""

    @staticmethod
    def forward(ctx, mix: Tensor, norm: Tensor, lse1: Tensor, query: Tensor, norm_weight: Tensor, heads: int,
                eps: float, dtype: torch.dtype, *late: Tensor):
        cdt, mix_dtype = contract.compute_dtype(mix.dtype), mix.dtype
        mix = mix.to(cdt)  # the fused phase 1 keeps it in the storage dtype
        lse, weights, rstd = lse1, None, None
        if late:
            logits, rstd = _logits_and_inv_rms(late, query, norm_weight, heads, eps)
            lse = torch.logaddexp(lse1, torch.logsumexp(logits, 0))
            weights = torch.exp(logits - lse)  # (m, ..., H)
        w = torch.exp(lse1 - lse)
        den = w * norm + (0 if weights is None else weights.sum(0))
        num = w.unsqueeze(-1) * mix.unflatten(-1, (heads, -1))
        if late:
            num = num + depth_mix(late, weights).unflatten(-1, (heads, -1))
        out = (num / den.unsqueeze(-1)).flatten(-2).to(dtype)
        weights = None if weights is None else weights / den
        ctx.save_for_backward(query, norm_weight, w / den, out, weights, rstd, *late)
        ctx.heads, ctx.cdt, ctx.mix_dtype = heads, cdt, mix_dtype
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):
        query, norm_weight, w, out, weights, rstd, *late = ctx.saved_tensors
        heads, cdt = ctx.heads, ctx.cdt
        dout = grad_out.to(cdt).unflatten(-1, (heads, -1))  # (..., H, K)
        total = (dout * out.to(cdt).unflatten(-1, (heads, -1))).sum(-1)  # S_h = <dout_h, out_h>
        dmix = (w.unsqueeze(-1) * dout).flatten(-2).to(ctx.mix_dtype) if ctx.needs_input_grad[0] else None
        dnorm = -w * total if ctx.needs_input_grad[1] else None
        need_q, need_g = ctx.needs_input_grad[3:5]
        q = query.to(cdt).view(1, heads, -1)
        g = norm_weight.to(cdt).view(1, heads, -1)
        dq = torch.zeros_like(q) if need_q and late else None
        dg = torch.zeros_like(g) if need_g and late else None
        grads = []
        for n, t in enumerate(late):
            key = _normalised_key(t, rstd[n].unsqueeze(-1), cdt).unflatten(-1, (heads, -1))
            dots = (dout * t.to(cdt).unflatten(-1, (heads, -1))).sum(-1)
            dlogits = (weights[n] * (dots - total)).unsqueeze(-2)  # (..., 1, H)
            dv = _key_backward(t, rstd[n].unsqueeze(-1), key, dlogits, q, g, dq, dg)
            dv = dv + (weights[n].unsqueeze(-1) * dout).flatten(-2)
            grads.append(dv.to(t.dtype) if ctx.needs_input_grad[8 + n] else None)
        dquery = (torch.zeros_like(query) if dq is None else dq.flatten().to(query.dtype)) if need_q else None
        dnorm_weight = (torch.zeros_like(norm_weight) if dg is None else dg.flatten().to(norm_weight.dtype)) \
            if need_g else None
        return (dmix, dnorm, None, dquery, dnorm_weight, None, None, None, *grads)


def phase1(queries: Tensor, norm_weights: Tensor, reads: tuple, heads: int, eps: float, *sources: Tensor) -> tuple:
    """Eager phase 1 of one group of g sites over its n start sources.

    queries, norm_weights: (g, d) rows of the group's sites; reads: per site, n bools (does the
    site read source j); sources: the n entries (a leading (d,) null source already cast to the
    others' dtype, as `contract.with_null_source` gives it), each (B, T, d), heads already checked.
    Returns (mix_1..mix_g (B, T, d), norm_1..norm_g (B, T, H), lse (g, B, T, H)), compute dtype;
    lse is not differentiable. Same contract as `triton_grouped.route_phase1`."""
    return _Phase1.apply(queries, norm_weights, reads, heads, float(eps), *sources)


def merge(mix: Tensor, norm: Tensor, lse: Tensor, query: Tensor, norm_weight: Tensor, heads: int, eps: float,
          dtype: torch.dtype, *late: Tensor) -> Tensor:
    """Eager phase 2 at one site: its phase-1 state (mix (B, T, d), norm and lse (B, T, H)) merged
    with its in-group sources `late` (each (B, T, d), checked); query, norm_weight (d,).
    Returns the site's mix (B, T, d) in `dtype` (module docstring)."""
    return _Merge.apply(mix, norm, lse, query, norm_weight, int(heads), float(eps), dtype, *late)
