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
m + 1 per-token statistics (one (m + 1, B*T, H) fp32 tensor: the logits, then the lse) and the
site's rows; the in-group sources are read from the depth buffer again in the backward, which
writes or adds their gradients into the buffer's gradient rows. In the models the state's mix
gradient goes straight into the group's row of one (g, B, T, d) tensor (`MixGradients`) that
phase 1's backward reads.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import contract, depth_buffer, triton_routing
from .depth_buffer import DepthBuffer, Reads
from .op import can_run, cast_like, why_not
from .triton_grouped import MixGradients


class Merge(torch.autograd.Function):
    """forward(token, mix (B, T, d), norm (B, T, H), lse (B, T, H), query (d,), norm_weight (d,),
    partial (B, T, d) or None, alpha (1,) or None, buffer, reads (the in-group rows; None: none),
    heads, eps, given ((`MixGradients`, site position, group size) or None)) -> out (B, T, d) in
    the storage dtype (module docstring). `norm` is not read (it is identically 1): its gradient is
    the softmax term phase 1's backward needs. With `given`, the mix's gradient is written into the
    group's row instead of being returned."""

    @staticmethod
    def forward(ctx, token, mix: Tensor, norm: Tensor, lse1: Tensor, query: Tensor, norm_weight: Tensor,
                partial: Optional[Tensor], alpha: Optional[Tensor], buffer: Optional[DepthBuffer],
                reads: Optional[Reads], heads: int, eps: float, given: Optional[tuple]):
        state_lse = lse1.contiguous()  # (B, T, H): the kernels index it per token and head
        ctx.heads, ctx.eps, ctx.shape = heads, eps, mix.shape
        ctx.has_partial = partial is not None
        ctx.buffer, ctx.reads, ctx.given = buffer, reads, given
        if reads is None and partial is None:  # the group's first site: its state is its mix, its lse the state's
            ctx.save_for_backward(mix, None, None, state_lse, query, norm_weight, alpha)
            return mix.view_as(mix)
        out, mixed, residual, stats = triton_routing.route_forward_saved(
            buffer.values if reads is not None else None, reads.slots if reads is not None else None, query,
            norm_weight, heads, eps, partial=partial, alpha=alpha, state=(mix, state_lse), residual=reads is not None)
        ctx.save_for_backward(out if partial is None else mixed, residual, stats, state_lse, query, norm_weight, alpha)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: Tensor):
        mix, residual, stats, state_lse, query, norm_weight, alpha = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        given = ctx.given
        if stats is None:  # first site of its group: no logits, its lse the state's (w0 = 1, dmix_1 = dout)
            stats = state_lse
        dnorm = torch.empty(state_lse.shape, dtype=state_lse.dtype, device=mix.device)
        # with in-group sources (or a gate) the state's share w0 < 1 (or dmix = alpha dout) is written
        write_state = ctx.reads is not None or alpha is not None
        dstate = None
        if write_state:
            dstate = given[0].row(given[1], mix, given[2]) if given is not None else \
                torch.empty(ctx.shape, dtype=mix.dtype, device=mix.device)
        reads, buffer = ctx.reads, ctx.buffer
        dq, dg, dalpha, _ = triton_routing.route_backward(
            grad_out, buffer.values if reads is not None else None, reads.slots if reads is not None else None, mix,
            query, norm_weight, ctx.heads, ctx.eps, stats, alpha,
            grads=buffer.gradients(reads) if reads is not None else None,
            accumulate=reads.accumulate if reads is not None else None, mix_residual=residual, state_lse=state_lse,
            state_grad=dstate, state_norm_grad=dnorm, param_dtype=triton_routing.common_dtype(query, norm_weight))
        if not write_state:
            dstate = grad_out
            if given is not None:  # the group's row holds it: phase 1's backward reads one tensor
                given[0].row(given[1], mix, given[2]).copy_(grad_out)
        return (None, None if given is not None else dstate, dnorm, None,
                cast_like(dq, query), cast_like(dg, norm_weight), grad_out if ctx.has_partial else None,
                None if alpha is None else cast_like(dalpha, alpha), None, None, None, None, None)


def merge(mix: Tensor, norm: Tensor, lse: Tensor, query: Tensor, norm_weight: Tensor, heads: int, eps: float,
          *late: Tensor, partial: Optional[Tensor] = None, alpha: Optional[Tensor] = None) -> Tensor:
    """Fused phase 2 at one grouped site over a list of in-group sources (module docstring;
    `grouped_reference.merge`'s contract), copied into a depth buffer of their own
    (`depth_buffer.stacked`); the models call `merge_buffer`.

    Args:
        mix: the site's phase-1 mix (B, T, d) in the sources' storage dtype
            (`triton_grouped.route_phase1`); norm, lse: its normaliser and log-sum-exp (B, T, H)
            fp32 (lse not differentiable).
        query, norm_weight: the site's pseudo-query and key-norm weight (d,).
        heads, eps: routing heads H and the RMSNorm epsilon.
        late: the m >= 0 in-group sources (B, T, d) in mix's dtype.
        partial, alpha: delta mode (MHAR_SPEC section 1.4): returns partial + alpha * mix.

    Returns:
        (B, T, d) in mix's dtype.

    Raises:
        RuntimeError: where the kernels cannot run (`op.can_run`); call `dispatch.merge`, which
            picks the eager merge there.
        ValueError: the mix is not in the sources' (or the partial's) dtype, or bad arguments as
            `contract.check_route_args` (the mix and the in-group sources checked together).
    """
    if not can_run(mix.device, mix.shape[-1], heads):
        raise RuntimeError(f"the fused merge cannot run here: {why_not(mix.device, mix.shape[-1], heads)}; call "
                           "mhar_kernels.dispatch.merge, which uses the eager merge where mhar_kernels.can_run() "
                           "is False")
    contract.check_route_args([mix, *late], query, norm_weight, heads, partial, alpha)
    if (late and late[0].dtype is not mix.dtype) or (partial is not None and partial.dtype is not mix.dtype):
        raise ValueError(f"the fused merge needs the phase-1 mix ({mix.dtype}) in the sources' dtype "
                         f"({late[0].dtype if late else partial.dtype}); phase 1 on the fused kernels writes it so")
    buffer, token, rows = depth_buffer.stacked(list(late)) if late else (None, None, None)
    return merge_buffer(mix, norm, lse, query, norm_weight, heads, eps, buffer, rows, token, partial=partial,
                        alpha=alpha)


def merge_buffer(mix: Tensor, norm: Tensor, lse: Tensor, query: Tensor, norm_weight: Tensor, heads: int, eps: float,
                 buffer: Optional[DepthBuffer], reads: Optional[Reads], token: Optional[Tensor], *,
                 partial: Optional[Tensor] = None, alpha: Optional[Tensor] = None,
                 given: Optional[tuple] = None) -> Tensor:
    """`merge` over the in-group rows `reads` of a depth buffer (None: the site reads none), after
    the write that made `token`; given: (`MixGradients`, the site's position, the group size)
    where the mix's gradient goes into the group's row. The arguments are the caller's to check."""
    return Merge.apply(token, mix, norm, lse, query, norm_weight, partial, alpha, buffer, reads, int(heads),
                       float(eps), given)
