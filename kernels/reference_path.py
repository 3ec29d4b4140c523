"""The op's implementation where Triton cannot run (CPU without TRITON_INTERPRET=1).

Forward is the eager reference `mhar_titan.models.routing.route_reference`; the logits and
log-sum-exp that the op returns alongside (its online-softmax state) are recomputed in
torch with the same formulas. Backward differentiates `route_reference` again (its closed
form), so this path is the oracle the fused kernels are tested against.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor


def _route_reference():
    from mhar_titan.models.routing import route_reference  # lazy: the model package imports us

    return route_reference


def depth_logits(sources: Sequence[Tensor], query: Tensor, norm_weight: Tensor, heads: int, eps: float) -> Tensor:
    """logit_{n,h} (N, B*T, H) in fp32 (fp64 for fp64 sources), MHAR_SPEC section 2."""
    full = next(s for s in sources if s.dim() != 1)
    d = full.shape[-1]
    bt = full.numel() // d
    cdt = torch.promote_types(full.dtype, torch.float32)
    q = query.to(cdt).view(heads, d // heads)
    logits = []
    for s in sources:
        x = s.to(cdt).expand(full.shape).reshape(bt, d)
        r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        key = (x * r).to(s.dtype).to(cdt) * norm_weight.to(cdt)
        logits.append((key.view(bt, heads, -1) * q).sum(-1))
    return torch.stack(logits)


def forward(
    sources: Sequence[Tensor],
    query: Tensor,
    norm_weight: Tensor,
    heads: int,
    eps: float,
    partial: Optional[Tensor],
    alpha: Optional[Tensor],
) -> tuple[Tensor, Tensor, Tensor]:
    """(out, logits, lse) like the fused forward; sources[0] may be a (d,) null source."""
    mix = _route_reference()(sources, query, norm_weight, heads, eps)
    logits = depth_logits(sources, query, norm_weight, heads, eps)
    out = mix if partial is None else partial + alpha.to(mix.dtype) * mix
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
    """Same return convention as `triton_routing.route_backward`."""
    has_null = sources[0].dim() == 1
    with torch.enable_grad():
        leaves = [s.detach().requires_grad_() for s in sources]
        q = query.detach().requires_grad_()
        g = norm_weight.detach().requires_grad_()
        mix = _route_reference()(leaves, q, g, heads, eps)
        dmix = grad_out if alpha is None else grad_out * alpha.to(grad_out.dtype)
        grads = torch.autograd.grad(mix, [*leaves, q, g], dmix)
    dalpha = None
    if alpha is not None:
        dalpha = (grad_out.float() * mix.detach().float()).sum().reshape(1)
    dsources = [gr.contiguous() for gr in grads[int(has_null) : len(sources)]]
    dnull = grads[0] if has_null else None
    return dsources, grads[-2], grads[-1], dalpha, dnull
