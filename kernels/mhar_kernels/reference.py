"""The readable eager reference of depth routing (MHAR_SPEC sections 1.1, 2, 4), and the oracle
the fused kernels are tested against.

For sources s_1..s_N (each (B, T, d)), one pseudo-query q (d,) split into H contiguous
heads of K = d/H dims, and a key-norm weight g (d,):

    r_n          = (mean(s_n^2) + eps)^-1/2                  RMS statistic over the FULL d
    khat_n       = cast_to_storage_dtype(s_n * r_n) * g       rounded where HF RMSNorm rounds
    logit_{n,h}  = <q[h], khat_n[h]>                          no temperature, no 1/sqrt(K)
    a_{n,h}      = softmax over n (the depth softmax) of logit_{n,h}
    out[h]       = sum_n a_{n,h} * s_n[h]                     un-normalised sources

H = 1 is single-head AttnRes. `route_reference` is the eager implementation with the closed-form
backward (and, with return_weights, the depth-softmax weights analysis reads); `route_stacked`
is the same function with plain autograd, the body `routing_kernel="compile"` compiles
(`route_compiled`). Which implementation a call runs is `mhar_kernels.dispatch`'s decision.
The op's contract (argument checks, compute dtype, null-source handling) is
`mhar_kernels.contract`. Imports torch only.
"""
from __future__ import annotations

import functools
from typing import Sequence

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from . import contract

@functools.lru_cache(maxsize=8)
def head_permutation(dim: int, seed: int) -> Tensor:
    """The permuted head layout's fixed permutation of the d feature coordinates, int64 (d,):
    head h reads coordinates perm[h K : (h + 1) K] instead of the contiguous slice (the paper's
    random-subspace ablation). Drawn from a private CPU generator seeded with `seed`, so it is
    the same on every rank and after a resume, whatever the global RNG did. Not trained."""
    return torch.randperm(dim, generator=torch.Generator().manual_seed(seed), device="cpu")


def _permute_features(sources: Sequence[Tensor], query: Tensor, norm_weight: Tensor, permutation: Tensor):
    """Sources, query and key-norm weight with their last (feature) dim reordered by `permutation`,
    so that the contiguous heads of the result are the permuted layout's heads."""
    perm = permutation.to(query.device)
    return [s.index_select(-1, perm) for s in sources], query[perm], norm_weight[perm]


def _inv_rms(source: Tensor, eps: float, cdt: torch.dtype) -> Tensor:
    """r = (mean(s^2) + eps)^-1/2 over the last dim, in the compute dtype, keepdim."""
    s = source.to(cdt)
    return torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps)


def _normalised_key(source: Tensor, rstd: Tensor, cdt: torch.dtype) -> Tensor:
    """cast_to_storage_dtype(s * r), back in the compute dtype (MHAR_SPEC section 4, step 3); no g yet."""
    return (source.to(cdt) * rstd).to(source.dtype).to(cdt)


def rms_norm_input_grad(source: Tensor, rstd: Tensor, dkp: Tensor) -> Tensor:
    """Gradient through the key RMSNorm (MHAR_SPEC section 4, the storage cast taken as identity):
    dv = r dkp - (r^3/d) <dkp, s> s for the upstream gradient dkp (..., d) of the normalised key
    (before the key-norm weight), written with xhat = r s so that r^3 never appears (it underflows
    fp32 once a source's RMS passes ~1e12). rstd: inverse RMS (..., 1); result in dkp's dtype."""
    xhat = source.to(dkp.dtype) * rstd
    return rstd * (dkp - xhat * ((dkp * xhat).sum(-1, keepdim=True) / dkp.shape[-1]))


def _source_logits(source: Tensor, q: Tensor, g: Tensor, eps: float, cdt: torch.dtype) -> tuple[Tensor, Tensor]:
    """Per-head logits (..., H) of one source (or a stack of them) against q (H, K), and its
    inverse RMS (..., 1)."""
    rstd = _inv_rms(source, eps, cdt)
    key = _normalised_key(source, rstd, cdt) * g
    return (key.unflatten(-1, (q.shape[0], -1)) * q).sum(-1), rstd


def _logits_and_inv_rms(sources: Sequence[Tensor], query: Tensor, norm_weight: Tensor, heads: int,
                        eps: float) -> tuple[Tensor, Tensor]:
    """Logits (N, B, T, H) and inverse RMS (N, B, T) in the compute dtype; a (d,) null source
    (first) is broadcast over the tokens."""
    full = sources[-1]
    cdt = contract.compute_dtype(full.dtype)
    q, g = query.to(cdt).view(heads, -1), norm_weight.to(cdt)
    logits, rstds = [], []
    for s in sources:
        logit, rstd = _source_logits(s, q, g, eps, cdt)
        logits.append(logit.expand(*full.shape[:-1], heads))
        rstds.append(rstd.squeeze(-1).expand(full.shape[:-1]))
    return torch.stack(logits), torch.stack(rstds)


def depth_mix(sources: Sequence[Tensor], weights: Tensor) -> Tensor:
    """out[h] = sum_n weights[n, ..., h] * s_n[h] (MHAR_SPEC section 2) in the weights' dtype.

    sources: N tensors (B, T, d) (a (d,) null source broadcasts); weights: (N, B, T, H).
    Returns (B, T, d); accumulates one source at a time (no stacked copy)."""
    heads = weights.shape[-1]
    out = None
    for n, s in enumerate(sources):
        term = weights[n].unsqueeze(-1) * s.to(weights.dtype).unflatten(-1, (heads, -1))
        out = term if out is None else out + term
    return out.flatten(-2)


def routing_logits(
    sources: Sequence[Tensor], query: Tensor, norm_weight: Tensor, heads: int, eps: float = 1e-6
) -> Tensor:
    """Depth logits logit_{n,h} = <q[h], RMSNorm_g(s_n)[h]> as (N, B, T, H) in the compute dtype
    (MHAR_SPEC section 2); a leading (d,) source is the null source. Plain autograd; for the
    online-softmax state, analysis and tests. Raises ValueError as `mhar_kernels.contract.check_route_args`."""
    null_source, full = contract.split_null_source(sources)
    heads = contract.check_route_args(full, query, norm_weight, heads, null_source=null_source)
    return _logits_and_inv_rms(contract.with_null_source(null_source, full), query, norm_weight, heads, eps)[0]


class _DepthRoute(torch.autograd.Function):
    """Reference routing with the closed-form backward of MHAR_SPEC section 4.

    Saves for backward: references to the N source tensors (no copies; the caller keeps
    them alive anyway), query, norm_weight, the depth-softmax weights W (N, B, T, H) and
    the inverse RMS r (N, B, T) in the compute dtype. No stacked (N, B, T, d) tensor and
    no normalised keys are kept: backward recomputes the keys one source at a time.
    """

    @staticmethod
    def forward(ctx, query: Tensor, norm_weight: Tensor, heads: int, eps: float, *sources: Tensor):
        logits, rstd = _logits_and_inv_rms(sources, query, norm_weight, heads, eps)
        weights = torch.softmax(logits, dim=0)  # (N, B, T, H)
        out = depth_mix(sources, weights).to(sources[-1].dtype)
        ctx.save_for_backward(query, norm_weight, weights, rstd, *sources)
        ctx.heads = heads
        ctx.mark_non_differentiable(weights)
        return out, weights

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor, _grad_weights):
        query, norm_weight, weights, rstd, *sources = ctx.saved_tensors
        heads, cdt = ctx.heads, weights.dtype
        d = query.shape[-1]
        need_q, need_g = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_src = ctx.needs_input_grad[4:]

        q = query.to(cdt).view(heads, d // heads)
        g = norm_weight.to(cdt)
        dout = grad_out.to(cdt).unflatten(-1, (heads, -1))  # (B, T, H, K)
        # Pass 1: <dout_h, s_{n,h}> and S_h = sum_n W[n,h] <dout_h, s_{n,h}>.
        dots = torch.stack([(dout * s.to(cdt).unflatten(-1, (heads, -1))).sum(-1) for s in sources])
        dlogits = weights * (dots - (weights * dots).sum(0))  # (N, B, T, H)

        dq = torch.zeros(heads, d // heads, dtype=cdt, device=dout.device)
        dg = torch.zeros(d, dtype=cdt, device=dout.device)
        grads = []
        token_dims = tuple(range(dout.dim() - 2))
        # Pass 2, per source: recompute the key, then dq, dg and dv (closed form, cast = identity).
        for n, s in enumerate(sources):
            r = rstd[n].unsqueeze(-1)
            key = _normalised_key(s, r, cdt)  # khat_pre, (B, T, d)
            dlogit = dlogits[n].unsqueeze(-1)  # (B, T, H, 1)
            if need_q:
                dq += (dlogit * (key * g).unflatten(-1, (heads, -1))).sum(token_dims)
            dkey = (dlogit * q).flatten(-2)  # d logit / d khat, (B, T, d)
            if need_g:
                dg += (dkey * key).sum(token_dims)
            if not need_src[n]:
                grads.append(None)
                continue
            dv = rms_norm_input_grad(s, r, dkey * g)
            dv = dv + (weights[n].unsqueeze(-1) * dout).flatten(-2)
            if s.dim() == 1:  # broadcast null source: sum over the token dims
                dv = dv.sum(token_dims)
            grads.append(dv.to(s.dtype))
        dquery = dq.flatten().to(query.dtype) if need_q else None
        dnorm = dg.to(norm_weight.dtype) if need_g else None
        return (dquery, dnorm, None, None, *grads)


def route_reference(
    sources: Sequence[Tensor],
    query: Tensor,
    norm_weight: Tensor,
    heads: int,
    eps: float = 1e-6,
    return_weights: bool = False,
    permutation: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Multi-head depth routing, eager reference (MHAR_SPEC section 2; H = 1 is AttnRes, section 1.1).

    Args:
        sources: N tensors of shape (B, T, d), all of one dtype (any leading dims work, as long as
            they match). A leading (d,) tensor (the learnable null source) is also accepted: cast
            to the sources' dtype and broadcast over the tokens without being copied.
        query: pseudo-query (d,), viewed as H contiguous heads of d/H dims.
        norm_weight: key RMSNorm weight g (d,); the RMS statistic is over the full d.
        heads: routing heads H, a positive int (numpy integers accepted); d % H must be 0.
        eps: RMSNorm epsilon.
        return_weights: also return the depth-softmax weights.
        permutation: int64 (d,) from `head_permutation` for the permuted head layout (head h reads
            coordinates permutation[h K : (h + 1) K]); None = contiguous heads.

    Returns:
        The mix (B, T, d) in the sources' dtype; with return_weights, also the weights
        (N, B, T, H) in the compute dtype (float32, or float64 for float64 sources).
        Statistics, softmax and accumulation run in float32 (float64 stays float64).

    Saves for backward only references to the sources, the weights and one inverse-RMS
    scalar per source and token (see `_DepthRoute`).

    Raises:
        ValueError: as `mhar_kernels.contract.check_route_args` (no sources, mismatched
        shapes/dtypes/devices, heads not a positive int, d % H != 0 naming d and H).
    """
    null_source, full = contract.split_null_source(sources)
    heads = contract.check_route_args(full, query, norm_weight, heads, null_source=null_source)
    out, weights = route_checked(contract.with_null_source(null_source, full), query, norm_weight, heads, eps,
                                  permutation)
    return (out, weights) if return_weights else out


def route_checked(sources: list[Tensor], query: Tensor, norm_weight: Tensor, heads: int, eps: float,
                  permutation: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """`route_reference` on arguments already checked (null source first, heads an int): the mix
    and the weights, in the permuted head layout when `permutation` is given."""
    if permutation is not None:
        sources, query, norm_weight = _permute_features(sources, query, norm_weight, permutation)
    out, weights = _DepthRoute.apply(query, norm_weight, heads, float(eps), *sources)
    if permutation is not None:
        out = out.index_select(-1, torch.argsort(permutation.to(out.device)))
    return out, weights


def route_stacked(stacked: Tensor, query: Tensor, norm_weight: Tensor, heads: int, eps: float) -> Tensor:
    """The same function on a pre-stacked (N, B, T, d) tensor with plain autograd; the body that
    `kernel="compile"` compiles (MHAR_SPEC pitfall 9: stack outside the compiled region).
    Keeps the stack and fp32 intermediates for backward, unlike `route_reference`."""
    cdt = contract.compute_dtype(stacked.dtype)
    logits, _ = _source_logits(stacked, query.to(cdt).view(heads, -1), norm_weight.to(cdt), eps, cdt)
    weights = torch.softmax(logits, dim=0)  # (N, B, T, H)
    out = (weights.unsqueeze(-1) * stacked.to(cdt).unflatten(-1, (heads, -1))).sum(0)
    return out.flatten(-2).to(stacked.dtype)


_compiled_route_stacked = None


def route_compiled(sources: list[Tensor], query: Tensor, norm_weight: Tensor, heads: int, eps: float) -> Tensor:
    """`route_stacked` under torch.compile (dynamic=True, compiled on first use) over the checked
    sources (null source first, broadcast to the others' shape before stacking)."""
    global _compiled_route_stacked
    if _compiled_route_stacked is None:
        _compiled_route_stacked = torch.compile(route_stacked, dynamic=True)
    stacked = torch.stack([s.expand(sources[-1].shape) for s in sources])
    return _compiled_route_stacked(stacked, query, norm_weight, heads, eps)
