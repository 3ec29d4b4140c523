"""Online-softmax routing state, the interface for grouped routing (DESIGN.md "Kernels").

A depth softmax over sources A + B can be computed in two pieces: route A, route B, and merge
the two normalised mixes by their log-sum-exps (exact in real arithmetic; the summation order
changes, so not bitwise). A state is (mix (B, T, d) fp32, normalised; lse (B*T, H) fp32).

Forward only (no autograd). Grouped routing's differentiable phase 1 is
`triton_grouped.route_phase1`; its merge is the models' eager one. Runs the Triton kernels only
(`mhar_kernels.can_run`); `merge_states` is plain torch.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from . import contract
from .op import _require

State = tuple[Tensor, Tensor]


def route_with_state(
    sources: Sequence[Tensor],
    query: Tensor,
    norm_weight: Tensor,
    heads: int,
    eps: float = 1e-6,
    *,
    state: Optional[State] = None,
    null_source: Optional[Tensor] = None,
) -> State:
    """Route `sources` (continuing from `state`, when given) and return the new state.

    Args as `mhar_kernels.route`; state: (mix (B, T, d), lse (B*T, H)) of earlier sources
    routed with the same query and norm weight, e.g. from a previous call.
    Returns (mix (B, T, d) fp32, lse (B*T, H) fp32); no autograd.
    Raises ValueError as `mhar_kernels.route`, or when the state's shapes do not fit;
    RuntimeError where the kernels cannot run (`mhar_kernels.can_run` is False)."""
    sources = list(sources)
    heads = contract.check_route_args(sources, query, norm_weight, heads, null_source=null_source)
    srcs = contract.with_null_source(null_source, sources)
    bt = sources[0].numel() // sources[0].shape[-1]
    if state is not None and (state[0].shape != sources[0].shape or state[1].shape != (bt, heads)):
        raise ValueError(f"state must be (mix {tuple(sources[0].shape)}, lse ({bt}, {heads})), got "
                         f"({tuple(state[0].shape)}, {tuple(state[1].shape)})")
    _require(sources[0].device, sources[0].shape[-1], heads)
    from .triton_routing import route_forward

    with torch.no_grad():
        out, _, _, lse = route_forward(srcs, query, norm_weight, heads, eps, state=state, out_dtype=torch.float32)
    return out, lse


def merge_states(a: State, b: State) -> State:
    """Merge two routing states over disjoint source sets: lse = logaddexp, mixes weighted
    by exp(lse_i - lse). Shapes: mix (B, T, d), lse (B*T, H); returns fp32."""
    mix_a, lse_a = a
    mix_b, lse_b = b
    lse = torch.logaddexp(lse_a.float(), lse_b.float())
    shape = mix_a.shape
    bt, heads = lse.shape
    wa = torch.exp(lse_a.float() - lse).unsqueeze(-1)
    wb = torch.exp(lse_b.float() - lse).unsqueeze(-1)
    mix = wa * mix_a.float().reshape(bt, heads, -1) + wb * mix_b.float().reshape(bt, heads, -1)
    return mix.reshape(shape), lse
