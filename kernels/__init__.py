"""Fused Triton depth-routing kernels for AttnRes / MHAR (imported as `mhar_kernels`).

`route(sources, query, norm_weight, heads, eps=1e-6, *, partial=None, alpha=None,
null_source=None)` is the registered custom op `mhar::route_fwd` with autograd
(`mhar::route_bwd`); see `op.py`. `route_with_state` / `merge_states` expose the
online-softmax state (normalised mix, log-sum-exp) for grouped routing.
"""
from .online_state import merge_states, route_with_state
from .op import check_route_args, route, uses_triton

__all__ = ["route", "route_with_state", "merge_states", "check_route_args", "uses_triton"]
