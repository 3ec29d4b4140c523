"""`mhar_kernels.route`: fused depth routing with autograd, over rows of a depth buffer.

Eager (the models' path): `route_buffer(buffer, reads, token, ...)` runs one `_Route` call over
the rows `reads` of a `depth_buffer.DepthBuffer`, after the write that made `token`; the sources'
gradients go into the buffer's gradient rows in the kernel (written by the row's first reader in
the backward, added by the others, as the reads say). Saved for backward: the normalised mix (the
output itself in replacement mode; one extra (B, T, d) tensor in delta mode), for bf16 or fp16
sources what rounding that mix to the storage dtype lost (one (B, T, d) tensor, from which the
backward gets <dmix, mix> as the fp32 forward had it, without a second read of the sources), the
fp32 logits and lse as one statistics tensor, and the call's parameter rows. `route(sources, ...)`
takes a list of sources and copies them into a buffer of their own (`depth_buffer.stacked`).

Inside torch.compile (per block, fullgraph) a call is two registered custom ops, opaque graph nodes
over the list of sources with fake implementations (`triton_op` + `wrap_triton` fails under
compile with the interpreter: fake tensors have no data pointer):

    mhar::depth_route(sources, query, norm_weight, heads, eps, partial, alpha, null_source)
        -> (out (B, T, d), mix (B, T, d) in delta mode else (0,), mix residual (B, T, d) for bf16 /
            fp16 sources else (0,), stats (null + N + 1, B*T, H): the logits, then the lse)
    mhar::depth_route_backward(grad_out, sources, mix, residual, query, norm_weight, heads, eps, stats,
                               alpha, null_source)
        -> (the N sources' gradients (N, B, T, d), dq, dg, dalpha, dnull)

Both run the Triton kernels: on CUDA, and on CPU when TRITON_INTERPRET=1 was set before the
kernels were imported (`can_run`). Elsewhere they raise; the dispatcher (`dispatch.backend`)
picks the eager reference there instead.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from . import contract, depth_buffer
from .depth_buffer import DepthBuffer, Reads

try:
    from . import triton_routing
except ImportError:  # triton not installed: can_run() is False everywhere
    triton_routing = None


def can_run(device: torch.device, dim: int, heads: int) -> bool:
    """True when the Triton kernels can route (B, T, dim) sources on `device` with `heads` heads:
    triton is installed, the device is CUDA (or CPU under TRITON_INTERPRET=1), and one token's
    [HB, KB] tile fits the kernels' register budget (`triton_routing.fits_tile`; MHAR_SPEC
    section 4: larger tiles run the eager reference). Not cached: about a microsecond, and
    torch.compile traces it where a cached wrapper would warn. `why_not` says why it is False."""
    return triton_routing is not None and _on_device(device) and triton_routing.fits_tile(heads, dim // heads)


def _on_device(device: torch.device | str) -> bool:
    """Whether Triton runs on `device` here: CUDA, or CPU under the interpreter (triton installed)."""
    device = device if isinstance(device, torch.device) else torch.device(device)
    return device.type == "cuda" or (device.type == "cpu" and triton_routing.INTERPRET)


def why_not(device: torch.device, dim: int, heads: int) -> Optional[str]:
    """None where `can_run` is True, else why the kernels cannot run there, in words (the reason
    `route` raises with and the trainer warns with); both reasons where both hold."""
    if triton_routing is None:
        return "triton is not installed"
    fits = triton_routing.fits_tile(heads, dim // heads)
    tile = f"one token's tile at d={dim}, H={heads} exceeds the kernels' register budget"
    if _on_device(device):
        return None if fits else tile
    device_type = device.type if isinstance(device, torch.device) else torch.device(device).type
    where = ("on CPU they run only with TRITON_INTERPRET=1 set before the start" if device_type == "cpu" else
             f"they run on CUDA, or on CPU under TRITON_INTERPRET=1, not on {device_type}")
    return where if fits else f"{where}, and {tile}"


def _require(device: torch.device, dim: int, heads: int) -> None:
    """Raise RuntimeError saying why (`why_not`), where `can_run` is False."""
    why = why_not(device, dim, heads)
    if why is not None:
        raise RuntimeError(f"mhar_kernels.route cannot run here: {why}. Check mhar_kernels.can_run() first and use "
                           "an eager implementation (mhar_kernels.reference) where it is False, or call "
                           "mhar_kernels.dispatch.route, which does")


# ---------------------------------------------------------------------------- custom ops (torch.compile)
# Inside torch.compile a call is an opaque graph node over its list of sources: the op stacks them
# into a depth buffer of its own (a copy per call, which the eager path's one shared buffer avoids).
def _or_empty(t: Optional[Tensor], like: Tensor) -> Tensor:
    """t, or an empty (0,) tensor for a custom op's optional output."""
    return t if t is not None else like.new_empty((0,))


def _stack(sources: list[Tensor]) -> tuple[Tensor, Tensor]:
    """(values (N, B, T, d), int32 slots 0..N-1) of a list of sources."""
    return torch.stack(sources), torch.arange(len(sources), dtype=torch.int32, device=sources[0].device)


def cast_null(null_source: Optional[Tensor], dtype: torch.dtype) -> Optional[Tensor]:
    """The (d,) null source as the kernels read it (in the sources' `dtype`, contiguous), or None."""
    return None if null_source is None else null_source.to(dtype).contiguous()


@torch.library.custom_op("mhar::depth_route", mutates_args=())
def route_fwd(
    sources: list[Tensor],
    query: Tensor,
    norm_weight: Tensor,
    heads: int,
    eps: float,
    partial: Optional[Tensor],
    alpha: Optional[Tensor],
    null_source: Optional[Tensor],
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    _require(sources[0].device, sources[0].shape[-1], heads)
    values, slots = _stack(list(sources))
    out, mix, residual, stats = triton_routing.route_forward_saved(
        values, slots, query, norm_weight, heads, eps, null=cast_null(null_source, values.dtype), partial=partial,
        alpha=alpha)
    return out, _or_empty(mix, out), _or_empty(residual, out), stats


@route_fwd.register_fake
def _route_fwd_fake(sources, query, norm_weight, heads, eps, partial, alpha, null_source):
    full = sources[0]
    n = len(sources) + int(null_source is not None)
    bt = full.numel() // full.shape[-1]
    cdt = contract.compute_dtype(full.dtype)
    mix = full.new_empty(full.shape) if partial is not None else full.new_empty((0,))
    residual = full.new_empty(full.shape) if cdt != full.dtype else full.new_empty((0,))
    return full.new_empty(full.shape), mix, residual, full.new_empty((n + 1, bt, heads), dtype=cdt)


@torch.library.custom_op("mhar::depth_route_backward", mutates_args=())
def route_bwd(
    grad_out: Tensor,
    sources: list[Tensor],
    mix: Tensor,
    residual: Tensor,
    query: Tensor,
    norm_weight: Tensor,
    heads: int,
    eps: float,
    stats: Tensor,
    alpha: Optional[Tensor],
    null_source: Optional[Tensor],
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    _require(grad_out.device, grad_out.shape[-1], heads)
    values, slots = _stack(list(sources))
    grads = torch.empty_like(values)
    dq, dg, dalpha, dnull = triton_routing.route_backward(
        grad_out, values, slots, mix, query, norm_weight, heads, eps, stats, alpha,
        null=cast_null(null_source, values.dtype), grads=grads, mix_residual=residual if residual.numel() else None)
    # dq, dg (and dnull) are rows of one reduced tensor; a custom op's outputs may not alias
    return (grads, dq.to(query.dtype).clone(), dg.to(norm_weight.dtype).clone(),
            _or_empty(dalpha, dq), _or_empty(dnull if dnull is None else dnull.to(null_source.dtype), dq).clone())


@route_bwd.register_fake
def _route_bwd_fake(grad_out, sources, mix, residual, query, norm_weight, heads, eps, stats, alpha, null_source):
    return (
        sources[0].new_empty((len(sources), *sources[0].shape)),
        torch.empty_like(query),
        torch.empty_like(norm_weight),
        torch.empty_like(alpha) if alpha is not None else query.new_empty((0,)),
        torch.empty_like(null_source) if null_source is not None else query.new_empty((0,)),
    )


def _setup_context(ctx, inputs, output):
    sources, query, norm_weight, heads, eps, partial, alpha, null_source = inputs
    out, mix, residual, stats = output
    ctx.heads, ctx.eps = heads, eps
    ctx.partial_dtype = partial.dtype if partial is not None else None
    ctx.save_for_backward(out if partial is None else mix, residual, stats, query, norm_weight, alpha, null_source,
                          *sources)


def _backward(ctx, grad_out, _grad_mix, _grad_residual, _grad_stats):
    mix, residual, stats, query, norm_weight, alpha, null_source, *sources = ctx.saved_tensors
    grads, dq, dg, dalpha, dnull = route_bwd(grad_out, sources, mix, residual, query, norm_weight, ctx.heads, ctx.eps,
                                             stats, alpha, null_source)
    dpartial = grad_out.to(ctx.partial_dtype) if ctx.partial_dtype is not None else None
    return (list(grads.unbind(0)), dq, dg, None, None, dpartial, dalpha if alpha is not None else None,
            dnull if null_source is not None else None)


route_fwd.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------- eager autograd
class _Route(torch.autograd.Function):
    """One fused routing call over rows of a depth buffer (`depth_buffer`): forward(token, query,
    norm_weight, partial, alpha, null_source, buffer, reads, heads, eps) -> out (B, T, d). Its only
    tensor edges are the token and the call's own parameters and residual: the sources' gradients
    go into the buffer's gradient rows in the kernel. Saves its output (the mix), the mix residual
    and the statistics; reads the sources from the buffer again in the backward."""

    @staticmethod
    def forward(ctx, token, query, norm_weight, partial, alpha, null_source, buffer, reads, heads, eps):
        ctx.buffer, ctx.reads, ctx.heads, ctx.eps = buffer, reads, heads, eps
        ctx.partial_dtype = partial.dtype if partial is not None else None
        out, mix, residual, stats = triton_routing.route_forward_saved(
            buffer.values, reads.slots, query, norm_weight, heads, eps, null=cast_null(null_source, buffer.values.dtype),
            partial=partial, alpha=alpha)
        ctx.save_for_backward(out if partial is None else mix, residual, stats, query, norm_weight, alpha,
                              null_source)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        mix, residual, stats, query, norm_weight, alpha, null_source = ctx.saved_tensors
        buffer = ctx.buffer
        dq, dg, dalpha, dnull = triton_routing.route_backward(
            grad_out, buffer.values, ctx.reads.slots, mix, query, norm_weight, ctx.heads, ctx.eps, stats, alpha,
            null=cast_null(null_source, buffer.values.dtype), grads=buffer.gradients(ctx.reads), accumulate=ctx.reads.accumulate,
            mix_residual=residual, param_dtype=triton_routing.common_dtype(query, norm_weight, null_source))
        return (None, cast_like(dq, query), cast_like(dg, norm_weight),
                grad_out.to(ctx.partial_dtype) if ctx.partial_dtype is not None else None,
                cast_like(dalpha, alpha) if alpha is not None else None,
                cast_like(dnull, null_source) if null_source is not None else None, None, None, None, None)


def cast_like(gradient: Tensor, like: Tensor) -> Tensor:
    """gradient in like's dtype (no op where it already is)."""
    return gradient if gradient.dtype is like.dtype else gradient.to(like.dtype)


# ---------------------------------------------------------------------------- public API
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
    """Fused multi-head depth routing (MHAR_SPEC sections 2 and 4; delta mode section 1.4) over a
    list of sources, which are copied into a depth buffer of their own (`depth_buffer.stacked`; the
    models write each source into one shared buffer once instead, `route_buffer`).

    Args:
        sources: N tensors (B, T, d) of one dtype and device.
            For block granularity pass the block sums and the partial block as sources.
        query: pseudo-query (d,), viewed as `heads` contiguous slices of K = d/H.
        norm_weight: key RMSNorm weight g (d,); the RMS statistic is over the full d.
        heads: routing heads H, a positive int (d % H == 0; K need not be a power of two).
        eps: RMSNorm epsilon.
        partial, alpha: delta mode, residual stream (B, T, d) and gate (1,); returns
            partial + alpha * mix. Both or neither.
        null_source: learnable (d,) source, prepended as source 0 (broadcast over tokens).

    Returns:
        (B, T, d) in the sources' dtype: the mix (replacement) or partial + alpha * mix (delta).
        Statistics, softmax and accumulation in fp32 (fp64 for fp64 sources).

    Raises:
        ValueError: as `contract.check_route_args`: empty, non-floating or mismatched sources,
            heads not a positive int, d % H != 0, bad partial / alpha / null_source shapes,
            dtypes or devices.
        RuntimeError: where the kernels cannot run (`can_run` is False).
    """
    sources = list(sources)
    heads = contract.check_route_args(sources, query, norm_weight, heads, partial, alpha, null_source)
    return route_unchecked(sources, query, norm_weight, heads, eps, partial=partial, alpha=alpha,
                           null_source=null_source)


def route_unchecked(sources: list[Tensor], query: Tensor, norm_weight: Tensor, heads: int, eps: float = 1e-6, *,
                    partial: Optional[Tensor] = None, alpha: Optional[Tensor] = None,
                    null_source: Optional[Tensor] = None) -> Tensor:
    """`route` for arguments that `contract.check_route_args` already accepted (heads an int).
    Raises RuntimeError where the kernels cannot run (`can_run`)."""
    if torch.compiler.is_compiling():  # an opaque node in the graph
        return route_fwd(sources, query, norm_weight, heads, float(eps), partial, alpha, null_source)[0]
    _require(sources[0].device, sources[0].shape[-1], heads)
    buffer, token, rows = depth_buffer.stacked(sources)
    return route_buffer(buffer, rows, token, query, norm_weight, heads, eps, partial=partial, alpha=alpha,
                        null_source=null_source)


def route_buffer(buffer: DepthBuffer, reads: Reads, token: Optional[Tensor], query: Tensor, norm_weight: Tensor,
                 heads: int, eps: float = 1e-6, *, partial: Optional[Tensor] = None, alpha: Optional[Tensor] = None,
                 null_source: Optional[Tensor] = None) -> Tensor:
    """Fused routing (as `route`) over the rows `reads` of a depth buffer (`depth_buffer`), after
    the write that made `token` (the newest write's). The arguments are the caller's to check
    (the models' Router: the routing plan made the reads; `dispatch.route` checked the rest once).
    Returns (B, T, d) in the buffer's dtype."""
    return _Route.apply(token, query, norm_weight, partial, alpha, null_source, buffer, reads, int(heads), float(eps))
