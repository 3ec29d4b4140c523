"""Depth routing: the softmax-over-depth mix of AttnRes / MHAR (MHAR_SPEC sections 1.1, 2, 4).

For sources s_1..s_N (each (B, T, d)), one pseudo-query q (d,) split into H contiguous
heads of K = d/H dims, and a key-norm weight g (d,):

    r_n          = (mean(s_n^2) + eps)^-1/2                  RMS statistic over the FULL d
    khat_n       = cast_to_storage_dtype(s_n * r_n) * g       rounded where HF RMSNorm rounds
    logit_{n,h}  = <q[h], khat_n[h]>                          no temperature, no 1/sqrt(K)
    a_{n,h}      = softmax over n (the depth softmax) of logit_{n,h}
    out[h]       = sum_n a_{n,h} * s_n[h]                     un-normalised sources

H = 1 is single-head AttnRes. `route_reference` is the readable eager oracle (also the one
the Triton kernels are tested against); `route` dispatches on `routing_kernel`.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

KERNELS = ("eager", "compile", "triton", "auto")


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for 16/32-bit storage, float64 stays float64."""
    return torch.promote_types(dtype, torch.float32)


def _check_inputs(sources: Sequence[Tensor], query: Tensor, norm_weight: Tensor, heads: int) -> tuple[int, int]:
    if len(sources) == 0:
        raise ValueError("depth routing needs at least one source")
    d = query.shape[-1]
    if query.shape != (d,) or norm_weight.shape != (d,):
        raise ValueError(
            f"query and norm_weight must both have shape (d,), got {tuple(query.shape)} and {tuple(norm_weight.shape)}"
        )
    if not isinstance(heads, int) or heads <= 0 or d % heads:
        raise ValueError(f"dim d={d} is not divisible by routing heads H={heads}: heads are contiguous d/H slices")
    full = [s for s in sources if s.dim() != 1]
    if not full:
        raise ValueError("depth routing needs at least one (B, T, d) source besides (d,) null sources")
    shape = full[0].shape
    for s in sources:
        if s.shape[-1] != d or (s.dim() != 1 and s.shape != shape):
            raise ValueError(
                f"every source must be {tuple(shape)} (or a (d,) null source) with d={d}, got {tuple(s.shape)}"
            )
        if s.dtype != full[0].dtype:
            raise ValueError(f"sources must share one dtype, got {s.dtype} and {full[0].dtype}")
    return d, d // heads


def _inv_rms(source: Tensor, eps: float, cdt: torch.dtype) -> Tensor:
    """r = (mean(s^2) + eps)^-1/2 over the last dim, in the compute dtype, keepdim."""
    s = source.to(cdt)
    return torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps)


def _normalised_key(source: Tensor, rstd: Tensor, cdt: torch.dtype) -> Tensor:
    """cast_to_storage_dtype(s * r), back in the compute dtype (MHAR_SPEC section 4, step 3); no g yet."""
    return (source.to(cdt) * rstd).to(source.dtype).to(cdt)


def _source_logits(source: Tensor, q: Tensor, g: Tensor, eps: float, cdt: torch.dtype) -> tuple[Tensor, Tensor]:
    """Per-head logits (..., H) of one source against q (H, K), and its inverse RMS (..., 1)."""
    rstd = _inv_rms(source, eps, cdt)
    key = _normalised_key(source, rstd, cdt) * g
    return (key.unflatten(-1, (q.shape[0], -1)) * q).sum(-1), rstd


def routing_logits(sources: Sequence[Tensor], query: Tensor, norm_weight: Tensor, heads: int, eps: float = 1e-6) -> Tensor:
    """Depth logits logit_{n,h} = <q[h], RMSNorm_g(s_n)[h]> as (N, B, T, H) in the compute dtype
    (MHAR_SPEC section 2); no gradient bookkeeping beyond plain autograd. For analysis and tests."""
    _check_inputs(sources, query, norm_weight, heads)
    cdt = _compute_dtype(sources[-1].dtype)
    batch = next(s for s in sources if s.dim() != 1).shape[:-1]
    q, g = query.to(cdt).view(heads, -1), norm_weight.to(cdt)
    return torch.stack([_source_logits(s, q, g, eps, cdt)[0].expand(*batch, heads) for s in sources])


class _DepthRoute(torch.autograd.Function):
    """Reference routing with the closed-form backward of MHAR_SPEC section 4.

    Saves for backward: references to the N source tensors (no copies; the caller keeps
    them alive anyway), query, norm_weight, the depth-softmax weights W (N, B, T, H) and
    the inverse RMS r (N, B, T) in the compute dtype. No stacked (N, B, T, d) tensor and
    no normalised keys are kept: backward recomputes the keys one source at a time.
    """

    @staticmethod
    def forward(ctx, query: Tensor, norm_weight: Tensor, heads: int, eps: float, *sources: Tensor):
        cdt = _compute_dtype(sources[-1].dtype)
        d = query.shape[-1]
        q = query.to(cdt).view(heads, d // heads)
        g = norm_weight.to(cdt)
        full = next(s for s in sources if s.dim() != 1)
        batch = full.shape[:-1]

        rstds, logits = [], []
        for s in sources:
            logit, rstd = _source_logits(s, q, g, eps, cdt)
            logits.append(logit.expand(*batch, heads))
            rstds.append(rstd.squeeze(-1).expand(batch))
        weights = torch.softmax(torch.stack(logits), dim=0)  # (N, B, T, H)

        out = torch.zeros(*batch, heads, d // heads, dtype=cdt, device=full.device)
        for n, s in enumerate(sources):
            out += weights[n].unsqueeze(-1) * s.to(cdt).unflatten(-1, (heads, -1))
        out = out.flatten(-2).to(full.dtype)

        rstd = torch.stack(rstds)  # (N, B, T)
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
            # dv = r dkp - (r^3/d) <dkp, s> s, written with xhat = r s so that r^3 never
            # appears (it underflows fp32 once a source's RMS passes ~1e12).
            xhat = s.to(cdt) * r
            dkp = dkey * g
            dv = r * (dkp - xhat * ((dkp * xhat).sum(-1, keepdim=True) / d))
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
) -> Tensor | tuple[Tensor, Tensor]:
    """Multi-head depth routing, eager reference (MHAR_SPEC section 2; H = 1 is AttnRes, section 1.1).

    Args:
        sources: N tensors of shape (B, T, d), all of one dtype (any leading dims work, as long as
            they match). A (d,) tensor (the learnable null source) is also accepted and broadcast
            over the tokens without being copied.
        query: pseudo-query (d,), viewed as H contiguous heads of d/H dims.
        norm_weight: key RMSNorm weight g (d,); the RMS statistic is over the full d.
        heads: routing heads H; d % H must be 0.
        eps: RMSNorm epsilon.
        return_weights: also return the depth-softmax weights.

    Returns:
        The mix (B, T, d) in the sources' dtype; with return_weights, also the weights
        (N, B, T, H) in the compute dtype (float32, or float64 for float64 sources).
        Statistics, softmax and accumulation run in float32 (float64 stays float64).

    Saves for backward only references to the sources, the weights and one inverse-RMS
    scalar per source and token (see `_DepthRoute`).

    Raises:
        ValueError: d % H != 0 (naming d and H), no sources, or mismatched shapes/dtypes.
    """
    _check_inputs(sources, query, norm_weight, heads)
    out, weights = _DepthRoute.apply(query, norm_weight, heads, float(eps), *sources)
    return (out, weights) if return_weights else out


def route_stacked(stacked: Tensor, query: Tensor, norm_weight: Tensor, heads: int, eps: float) -> Tensor:
    """The same function on a pre-stacked (N, B, T, d) tensor with plain autograd; the body that
    `kernel="compile"` compiles (MHAR_SPEC pitfall 9: stack outside the compiled region).
    Keeps the stack and fp32 intermediates for backward, unlike `route_reference`."""
    cdt = _compute_dtype(stacked.dtype)
    x = stacked.to(cdt)
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    key = (x * rstd).to(stacked.dtype).to(cdt) * norm_weight.to(cdt)
    q = query.to(cdt).view(heads, -1)
    weights = torch.softmax((key.unflatten(-1, (heads, -1)) * q).sum(-1), dim=0)  # (N, B, T, H)
    out = (weights.unsqueeze(-1) * x.unflatten(-1, (heads, -1))).sum(0)
    return out.flatten(-2).to(stacked.dtype)


_compiled_route_stacked = None


def _route_compiled(sources: Sequence[Tensor], query: Tensor, norm_weight: Tensor, heads: int, eps: float) -> Tensor:
    global _compiled_route_stacked
    if _compiled_route_stacked is None:
        _compiled_route_stacked = torch.compile(route_stacked, dynamic=True)
    shape = next(s for s in sources if s.dim() != 1).shape
    stacked = torch.stack([s.expand(shape) for s in sources])
    return _compiled_route_stacked(stacked, query, norm_weight, heads, eps)


def _triton_route():
    try:
        from mhar_kernels import route as triton_route
    except ImportError as exc:
        raise RuntimeError(
            "routing_kernel='triton' needs the fused kernels (`mhar_kernels.route`, the repo's kernels/ folder, "
            f"and triton installed), but importing them failed: {exc}. Use routing_kernel='eager' or 'compile'."
        ) from exc
    return triton_route


def route(
    sources: Sequence[Tensor],
    query: Tensor,
    norm_weight: Tensor,
    heads: int,
    eps: float = 1e-6,
    kernel: str = "eager",
    *,
    partial: Tensor | None = None,
    alpha: Tensor | None = None,
) -> Tensor:
    """Depth routing with the implementation chosen by `kernel` (the `routing_kernel` field).

    kernel: "eager" (`route_reference`), "compile" (`route_stacked` under torch.compile,
    dynamic=True), "triton" (`mhar_kernels.route`, fused), "auto" (triton for CUDA sources,
    eager otherwise). A leading (d,) source is the null source.

    Replacement mode returns the mix (B, T, d). Delta mode (MHAR_SPEC section 1.4) passes the
    residual `partial` (B, T, d) and the gate `alpha` (1,) and returns partial + alpha * mix;
    with alpha = 0 the result equals `partial` bit for bit.

    Raises:
        ValueError: unknown kernel, only one of partial/alpha given, or bad shapes (see route_reference).
        RuntimeError: kernel="triton" when the fused kernels cannot be imported.
    """
    if kernel not in KERNELS:
        raise ValueError(f"unknown routing kernel {kernel!r}; choose one of {KERNELS}")
    if (partial is None) != (alpha is None):
        raise ValueError("delta routing needs both `partial` and `alpha` (or neither for replacement routing)")
    if kernel == "auto":
        kernel = "triton" if sources[-1].is_cuda else "eager"
    if kernel == "triton":
        null_source = None
        if sources[0].dim() == 1:
            null_source, sources = sources[0], sources[1:]
        return _triton_route()(
            list(sources), query, norm_weight, heads, eps, partial=partial, alpha=alpha, null_source=null_source
        )
    if kernel == "compile":
        _check_inputs(sources, query, norm_weight, heads)
        mix = _route_compiled(sources, query, norm_weight, heads, eps)
    else:
        mix = route_reference(sources, query, norm_weight, heads, eps)
    if partial is None:
        return mix
    return partial + alpha.to(mix.dtype) * mix
