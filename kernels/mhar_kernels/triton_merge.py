"""The fused merge (phase 2) of grouped depth routing (docs/DESIGN.md "Grouped routing").

At a grouped site the phase-1 state (mix_1, normalised, in the storage dtype; lse_1 per token
and routing head) of the sources that existed when its group started is merged with the m
in-group sources t_1..t_m it also reads. By the log-sum-exp rule the state acts as one more
source whose logit is lse_1 (MHAR_SPEC section 2's depth softmax over all of the site's sources,
exact in real arithmetic):

    lse = logaddexp(lse_1, logsumexp_t l_t),   w0 = exp(lse_1 - lse),   a_t = exp(l_t - lse)
    out = w0 mix_1 + sum_t a_t t

so the per-call kernels compute it: the forward kernel starts its online softmax from the
state (`triton_routing.route_forward(state=...)`) and runs over the m sources; the backward
kernel (`route_backward(state_lse=...)`) reads each in-group source once, writes (or adds into
the shared buffer of) its gradient, and writes the state's gradients, which phase 1's backward
reads (`grouped_reference`'s contract: lse_1 held constant, the normaliser carrying the softmax
term):

    d mix_1 = w0 dmix  (B, T, d) storage dtype,    d norm_1 = -w0 <dmix_h, mix_h>  (B, T, H) fp32

A site with no in-group source (the first of its group) has out = mix_1 (no launch forward;
w0 = 1, so d mix_1 is the incoming gradient and only d norm_1 is computed). Delta mode
(MHAR_SPEC section 1.4) fuses partial + alpha * mix as per-call routing does. No fp32 copy of
any (B, T, d) tensor is made. Saved for backward: the state's lse_1 (B, T, H), the output (the
mix, or in delta mode the mix row the kernel writes), its bf16 / fp16 rounding residual, and the
m + 1 per-token statistics (one (m + 1, B*T, H) fp32 tensor: the logits, then the lse); kept as
plain references (`launch.save_with_sources`): the site's rows and the in-group sources.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import launch, triton_routing
from .op import can_run, cast_like, gradient_buffers


class Merge(torch.autograd.Function):
    """forward(mix (B, T, d), norm (B, T, H), lse (B, T, H), query (d,), norm_weight (d,),
    partial (B, T, d) or None, alpha (1,) or None, heads, eps, *late (B, T, d)) -> out (B, T, d)
    in the storage dtype (module docstring). `norm` is not read (it is identically 1): its
    gradient is the softmax term phase 1's backward needs."""

    @staticmethod
    def forward(ctx, looked_up: Optional[tuple], mix: Tensor, norm: Tensor, lse1: Tensor, query: Tensor,
                norm_weight: Tensor, partial: Optional[Tensor], alpha: Optional[Tensor], heads: int, eps: float,
                *late: Tensor):
        state_lse = lse1.contiguous()  # (B, T, H): the kernels index it per token and head
        ctx.heads, ctx.eps, ctx.shape = heads, eps, mix.shape
        ctx.has_partial = partial is not None
        if looked_up is None:  # the in-group sinks and their `launch.lookup`, as `dispatch.merge` makes them
            sinks = launch.sinks(late)
            looked_up = sinks, launch.lookup(sinks) if late else None
        ctx.sinks, found = looked_up
        ctx.found = None
        rows = (query, norm_weight, alpha)
        if not late and partial is None:  # the group's first site: its state is its mix, its lse the state's
            launch.save_with_sources(ctx, ctx.sinks, (mix, None, None, state_lse), late, rows)
            return mix.view_as(mix)
        tables = None
        if found is not None:  # consecutive entries of one source table: its rows, no table built
            table, first = found
            ctx.found = (table, first, first + len(late))
            tables = (*table.views(first, first + len(late))[:2], table.aligned)
        out, mixed, residual, stats = triton_routing.route_forward_saved(
            late, query, norm_weight, heads, eps, partial=partial, alpha=alpha, state=(mix, state_lse),
            residual=bool(late), tables=tables)
        launch.save_with_sources(ctx, ctx.sinks, (out if partial is None else mixed, residual, stats, state_lse), late,
                                 rows)
        return out

    @staticmethod
    @launch.once_differentiable
    def backward(ctx, grad_out: Tensor):
        mix, residual, stats, state_lse, query, norm_weight, alpha, *late = launch.saved_with_sources(ctx)
        grad_out = grad_out.contiguous()
        if stats is None:  # first site of its group: no logits, its lse the state's (w0 = 1, dmix_1 = dout)
            stats = state_lse
        rows = None
        if ctx.found is not None:
            table, lo, hi = ctx.found
            ctx.found = None  # a second backward takes the general path (the table may be reused by then)
            rows = table.backward_rows(lo, hi, False, late, ctx.shape, mix.device, registered=ctx.sources_kept)
        if rows is None:
            buffers, accumulate = gradient_buffers(ctx.sinks, ctx.shape, mix.dtype, mix.device)
            returned = [None if sink is not None else buffer for sink, buffer in zip(ctx.sinks, buffers)]
        else:  # every in-group source is shared: its gradient is in its buffer (the table's rows point at it)
            buffers, accumulate = None, None
            returned = (None,) * len(late)
        dnorm = torch.empty(state_lse.shape, dtype=state_lse.dtype, device=mix.device)
        # with in-group sources (or a gate) the state's share w0 < 1 (or dmix = alpha dout) is written
        write_state = bool(late) or alpha is not None
        dstate = torch.empty(ctx.shape, dtype=mix.dtype, device=mix.device) if write_state else None
        _, dq, dg, dalpha, _ = triton_routing.route_backward(
            grad_out, list(late), mix, query, norm_weight, ctx.heads, ctx.eps, stats, alpha, grads=buffers,
            accumulate=accumulate, mix_residual=residual, state_lse=state_lse, state_grad=dstate,
            state_norm_grad=dnorm, param_dtype=triton_routing.common_dtype(query, norm_weight), tables=rows)
        return (None, dstate if write_state else grad_out, dnorm, None,
                cast_like(dq, query), cast_like(dg, norm_weight), grad_out if ctx.has_partial else None,
                None if alpha is None else cast_like(dalpha, alpha), None, None, *returned)


def merge(mix: Tensor, norm: Tensor, lse: Tensor, query: Tensor, norm_weight: Tensor, heads: int, eps: float,
          *late: Tensor, partial: Optional[Tensor] = None, alpha: Optional[Tensor] = None,
          looked_up: Optional[tuple] = None) -> Tensor:
    """Fused phase 2 at one grouped site (module docstring; `grouped_reference.merge`'s contract).

    Args:
        mix: the site's phase-1 mix (B, T, d) in the sources' storage dtype
            (`triton_grouped.route_phase1`); norm, lse: its normaliser and log-sum-exp (B, T, H)
            fp32 (lse not differentiable).
        query, norm_weight: the site's pseudo-query and key-norm weight (d,).
        heads, eps: routing heads H and the RMSNorm epsilon.
        late: the m >= 0 in-group sources (B, T, d) in mix's dtype, checked by the caller
            (`contract.check_route_args`); `op.share_gradient` views get their gradients added into
            their shared buffers.
        partial, alpha: delta mode (MHAR_SPEC section 1.4): returns partial + alpha * mix.
        looked_up: (`launch.sinks(late)`, their `launch.lookup`) where the caller already made them
            (`dispatch.merge`).

    Returns:
        (B, T, d) in mix's dtype.

    Raises:
        RuntimeError: where the kernels cannot run (`op.can_run`); call `dispatch.merge`, which
            picks the eager merge there.
    """
    if not can_run(mix.device, mix.shape[-1], heads):
        raise RuntimeError(f"the fused merge cannot run on {mix.device} at d={mix.shape[-1]}, H={heads}; call "
                           "mhar_kernels.dispatch.merge, which uses the eager merge where mhar_kernels.can_run() "
                           "is False")
    # (the caller checked the in-group sources against each other: the first one's dtype is theirs)
    if (late and late[0].dtype is not mix.dtype) or (partial is not None and partial.dtype is not mix.dtype):
        raise ValueError(f"the fused merge needs the phase-1 mix ({mix.dtype}) in the sources' dtype "
                         f"({late[0].dtype if late else partial.dtype}); phase 1 on the fused kernels writes it so")
    return launch.apply(Merge, looked_up, mix, norm, lse, query, norm_weight, partial, alpha, int(heads), float(eps),
                        *late)
