"""The op's implementation where Triton cannot run (CPU without TRITON_INTERPRET=1, or a tile
too large for the kernels).

Forward is the models' eager routing (`mhar_titan.models.routing.route`, kernel="eager"); the
logits and log-sum-exp that the op returns alongside (its online-softmax state) come from the
same module's `routing_logits`. Backward differentiates `route_reference` again (its closed
form), so this path is the oracle the fused kernels are tested against.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from mhar_titan.models.routing import compute_dtype, route, route_reference, routing_logits


def forward(
    sources: Sequence[Tensor],
    query: Tensor,
    norm_weight: Tensor,
    heads: int,
    eps: float,
    partial: Optional[Tensor],
    alpha: Optional[Tensor],
) -> tuple[Tensor, Tensor, Tensor]:
    """(out, logits (N, B*T, H), lse (B*T, H)) like the fused forward; sources[0] may be a (d,)
    null source. Logits and lse in the compute dtype."""
    out = route(sources, query, norm_weight, heads, eps, "eager", partial=partial, alpha=alpha)
    logits = routing_logits(sources, query, norm_weight, heads, eps).flatten(1, -2)
    return out, logits, torch.logsumexp(logits, dim=0)


def backward(
    grad_out: Tensor,
    sources: Sequence[Tensor],
    query: Tensor,
    norm_weight: Tensor,
    heads: int,
    eps: float,
    alpha: Optional[Tensor],
) -> tuple[list[Tensor], Tensor, Tensor, Optional[Tensor], Optional[Tensor]]:
    """Same return convention as `triton_routing.route_backward`: dalpha = <grad_out, mix>
    summed in the compute dtype (fp64 for fp64 sources)."""
    has_null = sources[0].dim() == 1
    with torch.enable_grad():
        leaves = [s.detach().requires_grad_() for s in sources]
        q = query.detach().requires_grad_()
        g = norm_weight.detach().requires_grad_()
        mix = route_reference(leaves, q, g, heads, eps)
        dmix = grad_out if alpha is None else grad_out * alpha.to(grad_out.dtype)
        grads = torch.autograd.grad(mix, [*leaves, q, g], dmix)
    dalpha = None
    if alpha is not None:
        cdt = compute_dtype(grad_out.dtype)
        dalpha = (grad_out.to(cdt) * mix.detach().to(cdt)).sum().reshape(1)
    dsources = [gr.contiguous() for gr in grads[int(has_null) : len(sources)]]
    dnull = grads[0] if has_null else None
    return dsources, grads[-2], grads[-1], dalpha, dnull
