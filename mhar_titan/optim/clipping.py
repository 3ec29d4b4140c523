"""Gradient clipping by the global L2 norm, with the norm split by parameter group for logging."""
from __future__ import annotations

import torch
from torch import nn

from .groups import GRAD_NORM_GROUPS, clean_name, grad_norm_group


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


@torch.no_grad()
def clip_grad_norm_by_group(model: nn.Module, max_norm: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Global L2 gradient norm, its split by ``GRAD_NORM_GROUPS``, and clipping.

    Works on FSDP2-sharded (DTensor) gradients: the squared norms of the local
    shards are summed over ranks with one all-reduce (of a vector of group sums).
    Gradients are scaled by ``min(1, max_norm / (total + 1e-6))`` when
    ``max_norm > 0`` and the total is finite (a non-finite step is skipped by the
    caller, so it is left untouched). Nothing is read back to the host: the choice is a
    ``torch.where`` on the device, so the call is safe inside a captured or asynchronous step.

    Returns:
        (total norm, {group: norm} for the groups that have gradients) as fp32 scalar
        tensors on the gradients' device.
    """
    import torch.distributed as dist

    grads = {g: [] for g in GRAD_NORM_GROUPS}
    sharded = False
    plan = getattr(model, "plan", None)
    routed = plan is None or bool(plan.sites)  # depth routing's queries and gates (not another connection's)
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        sharded |= hasattr(p.grad, "to_local")
        grads[grad_norm_group(clean_name(name), routed)].append(_local(p.grad))
    device = next((gs[0].device for gs in grads.values() if gs), torch.device("cpu"))
    sq = torch.stack([
        torch.stack([g.float().pow(2).sum() for g in gs]).sum() if gs else torch.zeros((), device=device)
        for gs in grads.values()
    ])
    if sharded and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(sq)
    # Groups without parameters (gates exist only in delta mode) are left out.
    norms = {g: sq[i].sqrt() for i, g in enumerate(GRAD_NORM_GROUPS) if grads[g]}
    total = sq.sum().sqrt()
    flat = [g for gs in grads.values() for g in gs]
    if max_norm > 0 and flat:
        # Decided on the device (no host read): a non-finite total leaves the gradients as they are.
        coef = torch.where(torch.isfinite(total), torch.clamp(max_norm / (total + 1e-6), max=1.0), 1.0)
        torch._foreach_mul_(flat, coef.to(flat[0].dtype))
    return total, norms
