"""`mhar_kernels.route`: fused depth routing as registered custom ops with autograd.

Two ops, so that `torch.compile` (per block, fullgraph) traces them as opaque nodes and
never touches a data pointer (ENV_NOTES gotcha (d): `triton_op` + `wrap_triton` fails under
compile with the interpreter):

    mhar::route_fwd(sources, query, norm_weight, heads, eps, partial, alpha, null_source)
        -> (out (B, T, d), logits (N, B*T, H), lse (B*T, H))
    mhar::route_bwd(grad_out, sources, query, norm_weight, heads, eps, logits, lse, alpha, null_source)
        -> (grads of the N sources, dq, dg, dalpha, dnull)

Each implementation runs the Triton kernels on CUDA, and on CPU when TRITON_INTERPRET=1 was
set before this package was imported; otherwise the eager reference (`reference_path`).

Saved for backward: references to the source tensors (no copies), query, norm weight,
alpha, null source and the fp32 logits and lse (N*B*T*H + B*T*H elements). Nothing is
shared between calls, so a block recomputed by activation checkpointing, or a backward in
any order (FSDP2 prefetching, pipeline schedules), sees the same state as the first run.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from . import reference_path

try:
    from . import triton_routing
except ImportError:  # triton not installed: the reference path only
    triton_routing = None


def uses_triton(device: torch.device) -> bool:
    """True when the op runs the Triton kernels for tensors on `device`."""
    if triton_routing is None:
        return False
    return device.type == "cuda" or (device.type == "cpu" and triton_routing.INTERPRET)


def _stat_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _all_sources(sources: Sequence[Tensor], null_source: Optional[Tensor]) -> list[Tensor]:
    """null_source (cast to the sources' dtype, a (d,) copy at most) as source 0, then sources."""
    if null_source is None:
        return list(sources)
    return [null_source.to(sources[0].dtype), *sources]


# ---------------------------------------------------------------------------- forward op
@torch.library.custom_op("mhar::route_fwd", mutates_args=())
def route_fwd(
    sources: list[Tensor],
    query: Tensor,
    norm_weight: Tensor,
    heads: int,
    eps: float,
    partial: Optional[Tensor],
    alpha: Optional[Tensor],
    null_source: Optional[Tensor],
) -> tuple[Tensor, Tensor, Tensor]:
    srcs = _all_sources(sources, null_source)
    if uses_triton(sources[0].device):
        return triton_routing.route_forward(srcs, query, norm_weight, heads, eps, partial=partial, alpha=alpha)
    return reference_path.forward(srcs, query, norm_weight, heads, eps, partial, alpha)


@route_fwd.register_fake
def _route_fwd_fake(sources, query, norm_weight, heads, eps, partial, alpha, null_source):
    full = sources[0]
    n = len(sources) + int(null_source is not None)
    bt = full.numel() // full.shape[-1]
    cdt = _stat_dtype(full.dtype)
    return full.new_empty(full.shape), full.new_empty((n, bt, heads), dtype=cdt), full.new_empty((bt, heads), dtype=cdt)


# ---------------------------------------------------------------------------- backward op
@torch.library.custom_op("mhar::route_bwd", mutates_args=())
def route_bwd(
    grad_out: Tensor,
    sources: list[Tensor],
    query: Tensor,
    norm_weight: Tensor,
    heads: int,
    eps: float,
    logits: Tensor,
    lse: Tensor,
    alpha: Optional[Tensor],
    null_source: Optional[Tensor],
) -> tuple[list[Tensor], Tensor, Tensor, Tensor, Tensor]:
    """Gradients; dalpha / dnull are empty (0,) tensors when alpha / null_source are None."""
    srcs = _all_sources(sources, null_source)
    if uses_triton(grad_out.device):
        grads, dq, dg, dalpha, dnull = triton_routing.route_backward(
            grad_out, srcs, query, norm_weight, heads, eps, logits, lse, alpha
        )
    else:
        grads, dq, dg, dalpha, dnull = reference_path.backward(grad_out, srcs, query, norm_weight, heads, eps, alpha)
    return (
        grads,
        dq.to(query.dtype),
        dg.to(norm_weight.dtype),
        dalpha.to(alpha.dtype) if alpha is not None else query.new_empty((0,)),
        dnull.to(null_source.dtype) if null_source is not None else query.new_empty((0,)),
    )


@route_bwd.register_fake
def _route_bwd_fake(grad_out, sources, query, norm_weight, heads, eps, logits, lse, alpha, null_source):
    return (
        [s.new_empty(s.shape) for s in sources],  # contiguous, like the kernel's
        torch.empty_like(query),
        torch.empty_like(norm_weight),
        torch.empty_like(alpha) if alpha is not None else query.new_empty((0,)),
        torch.empty_like(null_source) if null_source is not None else query.new_empty((0,)),
    )


# ---------------------------------------------------------------------------- autograd
def _setup_context(ctx, inputs, output):
    sources, query, norm_weight, heads, eps, partial, alpha, null_source = inputs
    _, logits, lse = output
    ctx.heads, ctx.eps, ctx.n_sources = heads, eps, len(sources)
    ctx.has_alpha, ctx.has_null = alpha is not None, null_source is not None
    ctx.partial_dtype = partial.dtype if partial is not None else None
    optional = [t for t in (alpha, null_source) if t is not None]
    ctx.save_for_backward(query, norm_weight, logits, lse, *optional, *sources)


def _backward(ctx, grad_out, _grad_logits, _grad_lse):
    query, norm_weight, logits, lse, *rest = ctx.saved_tensors
    alpha = rest.pop(0) if ctx.has_alpha else None
    null_source = rest.pop(0) if ctx.has_null else None
    grads, dq, dg, dalpha, dnull = route_bwd(
        grad_out, rest, query, norm_weight, ctx.heads, ctx.eps, logits, lse, alpha, null_source
    )
    dpartial = grad_out.to(ctx.partial_dtype) if ctx.partial_dtype is not None else None
    return (
        list(grads), dq, dg, None, None, dpartial,
        dalpha if ctx.has_alpha else None,
        dnull if ctx.has_null else None,
    )


route_fwd.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------- public API
def check_route_args(
    sources: Sequence[Tensor],
    query: Tensor,
    norm_weight: Tensor,
    heads: int,
    partial: Optional[Tensor] = None,
    alpha: Optional[Tensor] = None,
    null_source: Optional[Tensor] = None,
) -> None:
    """Raise ValueError naming the bad argument (shapes, dtypes, devices, heads)."""
    if len(sources) == 0:
        raise ValueError("depth routing needs at least one (B, T, d) source")
    full = sources[0]
    if full.dim() < 2:
        raise ValueError(f"sources must be (B, T, d) tensors, got shape {tuple(full.shape)}; pass a (d,) "
                         "null source as null_source=")
    d = full.shape[-1]
    for i, s in enumerate(sources):
        if s.shape != full.shape or s.dtype != full.dtype or s.device != full.device:
            raise ValueError(f"source {i} is {tuple(s.shape)} {s.dtype} on {s.device}; every source must match "
                             f"source 0: {tuple(full.shape)} {full.dtype} on {full.device}")
    if query.shape != (d,) or norm_weight.shape != (d,):
        raise ValueError(f"query and norm_weight must be ({d},), got {tuple(query.shape)} and "
                         f"{tuple(norm_weight.shape)}")
    if isinstance(heads, bool) or not isinstance(heads, int) or heads <= 0 or d % heads:
        raise ValueError(f"dim d={d} is not divisible by routing heads H={heads}: heads are contiguous d/H slices")
    if (partial is None) != (alpha is None):
        raise ValueError("delta routing needs both `partial` and `alpha` (or neither for replacement routing)")
    if partial is not None and partial.shape != full.shape:
        raise ValueError(f"partial must match the sources' shape {tuple(full.shape)}, got {tuple(partial.shape)}")
    if alpha is not None and alpha.shape != (1,):
        raise ValueError(f"alpha must have shape (1,) (FSDP rejects 0-dim parameters), got {tuple(alpha.shape)}")
    if null_source is not None and null_source.shape != (d,):
        raise ValueError(f"null_source must be ({d},), got {tuple(null_source.shape)}")


def route(
    sources: Sequence[Tensor],
    query: Tensor,
    norm_weight: Tensor,
    heads: int,
    eps: float = 1e-6,
    *,
    partial: Optional[Tensor] = None,
    alpha: Optional[Tensor] = None,
    null_source: Optional[Tensor] = None,
) -> Tensor:
    """Fused multi-head depth routing (MHAR_SPEC sections 2 and 4; delta mode section 1.4).

    Args:
        sources: N tensors (B, T, d) of one dtype and device, passed separately (never stacked).
            For block granularity pass the block sums and the partial block as sources.
        query: pseudo-query (d,), viewed as `heads` contiguous slices of K = d/H.
        norm_weight: key RMSNorm weight g (d,); the RMS statistic is over the full d.
        heads: routing heads H (d % H == 0; K need not be a power of two).
        eps: RMSNorm epsilon.
        partial, alpha: delta mode, residual stream (B, T, d) and gate (1,); returns
            partial + alpha * mix. Both or neither.
        null_source: learnable (d,) source, prepended as source 0 (broadcast over tokens).

    Returns:
        (B, T, d) in the sources' dtype: the mix (replacement) or partial + alpha * mix (delta).
        Statistics, softmax and accumulation in fp32 (fp64 for fp64 sources).

    Raises:
        ValueError: empty or mismatched sources, d % H != 0, bad partial/alpha/null_source shapes.
    """
    sources = list(sources)
    check_route_args(sources, query, norm_weight, heads, partial, alpha, null_source)
    out, _, _ = route_fwd(sources, query, norm_weight, heads, float(eps), partial, alpha, null_source)
    return out
