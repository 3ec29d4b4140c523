"""`mhar_kernels.route`: fused depth routing as registered custom ops with autograd.

Two ops, so that `torch.compile` (per block, fullgraph) traces them as opaque nodes and
never touches a data pointer (`triton_op` + `wrap_triton` fails under compile with the
interpreter: fake tensors have no data pointer):

    mhar::depth_route(sources, query, norm_weight, heads, eps, partial, alpha, null_source)
        -> (out (B, T, d), mix (B, T, d) in delta mode else (0,), mix residual (B, T, d) for bf16 /
            fp16 sources else (0,), stats (N + 1, B*T, H): the logits, then the lse)
    mhar::depth_route_backward(grad_out, sources, mix, residual, query, norm_weight, heads, eps, stats,
                             alpha, null_source)
        -> (grads of the N sources, dq, dg, dalpha, dnull)

Both run the Triton kernels: on CUDA, and on CPU when TRITON_INTERPRET=1 was set before the
kernels were imported (`can_run`). Elsewhere they raise; the dispatcher (`dispatch.backend`)
picks the eager reference there instead. Outside torch.compile the same forward and backward
run through a plain autograd.Function (`_EagerRoute`): no custom-op dispatch and no pytree
handling of the N sources (about a quarter of the host time of a call at N = 73).

Saved for backward: the source tensors (no copies; plain references where every source is a
shared entry that outlives its block, `launch.save_with_sources`), query, norm weight,
alpha, null source (plain references outside torch.compile), the fp32 logits and lse as one
statistics tensor ((N + 1) * B*T*H elements) and the normalised mix
(the output itself in replacement mode; one extra (B, T, d) tensor in delta mode) and, for bf16
or fp16 sources, what rounding that mix to the storage dtype lost (one (B, T, d) tensor in the
sources' dtype), from which the backward gets <dmix, mix> as the fp32 forward had it, without a
second read of the sources. The only state shared
between calls is a source's gradient buffer (`share_gradient`): it belongs to the sharing
view's autograd node of the original forward, so a block recomputed by activation
checkpointing adds into the same buffer, and the view's backward runs after every reader's,
whatever their order (FSDP2 prefetching, pipeline schedules).
"""
from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch
from torch import Tensor

from . import contract, launch

try:
    from . import triton_routing
except ImportError:  # triton not installed: can_run() is False everywhere
    triton_routing = None


def can_run(device: torch.device, dim: int, heads: int) -> bool:
    """True when the Triton kernels can route (B, T, dim) sources on `device` with `heads` heads:
    triton is installed, the device is CUDA (or CPU under TRITON_INTERPRET=1), and one token's
    [HB, KB] tile fits the kernels' register budget (`triton_routing.fits_tile`; MHAR_SPEC
    section 4: larger tiles run the eager reference). Answers are cached per (device, dim, heads)
    and interpreter setting (it is asked at every routing call)."""
    if triton_routing is None:
        return False
    device = device if isinstance(device, torch.device) else torch.device(device)
    return _can_run(device, dim, heads, triton_routing.INTERPRET)


@functools.lru_cache(maxsize=256)
def _can_run(device: torch.device, dim: int, heads: int, interpret: bool) -> bool:
    on_device = device.type == "cuda" or (device.type == "cpu" and interpret)
    return on_device and triton_routing.fits_tile(heads, dim // heads)


def _require(device: torch.device, dim: int, heads: int) -> None:
    """Raise RuntimeError saying why, where `can_run` is False."""
    if can_run(device, dim, heads):
        return
    if triton_routing is None:
        why = "triton is not installed"
    elif device.type == "cuda" or (device.type == "cpu" and triton_routing.INTERPRET):
        why = f"one token's tile at d={dim}, H={heads} exceeds the kernels' register budget"
    else:
        why = f"Triton cannot run on {device} (on CPU only with TRITON_INTERPRET=1 set before the kernels load)"
    raise RuntimeError(f"mhar_kernels.route cannot run here: {why}. Check mhar_kernels.can_run() first and use "
                       "an eager implementation (mhar_kernels.reference) where it is False, or call "
                       "mhar_kernels.dispatch.route, which does")


# ---------------------------------------------------------------------------- forward op
def _forward_values(sources, query, norm_weight, heads, eps, partial, alpha, null_source):
    """(out, mix or None, mix residual or None, stats) from the forward kernel; the checks
    are the caller's (`dispatch.route` / `route`, and `_require`)."""
    return triton_routing.route_forward_saved(contract.with_null_source(null_source, sources), query, norm_weight,
                                              heads, eps, partial=partial, alpha=alpha)


def _or_empty(t: Optional[Tensor], like: Tensor) -> Tensor:
    """t, or an empty (0,) tensor for a custom op's optional output."""
    return t if t is not None else like.new_empty((0,))


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
    out, mix, residual, stats = _forward_values(list(sources), query, norm_weight, heads, eps, partial, alpha,
                                                null_source)
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


# ---------------------------------------------------------------------------- backward op
def _backward_values(grad_out, sources, mix, residual, query, norm_weight, heads, eps, stats, alpha,
                     null_source, grads=None, accumulate=None):
    """(source gradients, dq, dg, dalpha or None, dnull or None), the parameters' gradients in
    their dtypes. residual: the forward's mix residual or None. grads / accumulate: the source
    gradient buffers and whether to add into each (`triton_routing.route_backward`)."""
    srcs = contract.with_null_source(null_source, sources)
    grads, dq, dg, dalpha, dnull = triton_routing.route_backward(
        grad_out, srcs, mix, query, norm_weight, heads, eps, stats, alpha, grads=grads, accumulate=accumulate,
        mix_residual=residual, param_dtype=triton_routing.common_dtype(query, norm_weight, null_source),
    )
    return (grads, dq.to(query.dtype), dg.to(norm_weight.dtype),
            dalpha.to(alpha.dtype) if alpha is not None else None,
            dnull.to(null_source.dtype) if null_source is not None else None)


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
) -> tuple[list[Tensor], Tensor, Tensor, Tensor, Tensor]:
    _require(grad_out.device, grad_out.shape[-1], heads)
    grads, dq, dg, dalpha, dnull = _backward_values(grad_out, list(sources), mix, residual if residual.numel() else None,
                                                    query, norm_weight, heads, eps, stats, alpha, null_source)
    # dq, dg (and dnull) are rows of one reduced tensor; a custom op's outputs may not alias
    return grads, dq.clone(), dg.clone(), _or_empty(dalpha, dq), _or_empty(dnull, dq).clone()


@route_bwd.register_fake
def _route_bwd_fake(grad_out, sources, mix, residual, query, norm_weight, heads, eps, stats, alpha,
                    null_source):
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
    out, mix, residual, stats = output
    ctx.heads, ctx.eps = heads, eps
    ctx.partial_dtype = partial.dtype if partial is not None else None
    ctx.save_for_backward(out if partial is None else mix, residual, stats, query, norm_weight, alpha, null_source,
                          *sources)


def _gradients(ctx, grad_out, backward, saved=None) -> tuple:
    """(source gradients, dq, dg, dpartial, dalpha, dnull) of the call saved in ctx (None for
    what the call did not have), from backward = the backward op (under torch.compile, whose
    optional tensors are empty (0,) ones) or `_backward_values` (eager). saved: ctx.saved_tensors
    where the caller already unpacked them (they can be unpacked once)."""
    mix, residual, stats, query, norm_weight, alpha, null_source, *sources = \
        ctx.saved_tensors if saved is None else saved
    grads, dq, dg, dalpha, dnull = backward(
        grad_out, sources, mix, residual, query, norm_weight, ctx.heads, ctx.eps, stats, alpha, null_source
    )
    dpartial = grad_out.to(ctx.partial_dtype) if ctx.partial_dtype is not None else None
    return (grads, dq, dg, dpartial, dalpha if alpha is not None else None,
            dnull if null_source is not None else None)


def _backward(ctx, grad_out, _grad_mix, _grad_residual, _grad_stats):
    grads, dq, dg, dpartial, dalpha, dnull = _gradients(ctx, grad_out, route_bwd)
    return list(grads), dq, dg, None, None, dpartial, dalpha, dnull


route_fwd.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------- shared source gradients
class GradientSink:
    """The gradient buffer of one source, shared by every routing call that reads it.

    `grad` is None until the first reader's backward (the deepest site: backward runs in
    reverse) writes it; later readers add into it in their kernel; `share_gradient`'s node
    hands it on and empties the sink."""

    __slots__ = ("grad", "table", "slot", "outlives", "remade")

    def __init__(self, outlives: bool = False):
        self.grad: Optional[Tensor] = None
        self.table = None  # the `launch.SourceTable` the source is registered in, and its slot
        self.slot = 0
        self.outlives = outlives  # the entry outlives its block: readers keep it by reference (`launch`)
        self.remade: Optional[Tensor] = None  # the entry recomputed under AC, its slot's tensor (`launch.remake`)


SINK_ATTRIBUTE = launch.SINK_ATTRIBUTE


class _ShareGradient(torch.autograd.Function):
    """Identity whose backward returns the source's gradient accumulated in its sink (plus any
    gradient reaching the view by other paths). Autograd runs it only after the backward of
    every op that read the view, so the sum is complete, whatever the order of those backwards
    (activation checkpointing recompute, FSDP2 prefetch) and whichever ops they are."""

    @staticmethod
    def forward(ctx, source, sink):
        ctx.set_materialize_grads(False)  # the routing calls return None: no zero tensor to add
        ctx.sink = sink
        return source.view_as(source)

    @staticmethod
    def backward(ctx, grad):
        sink = ctx.sink
        total, sink.grad, sink.remade = sink.grad, None, None
        if sink.table is not None:
            sink.table.handed_on(sink)
        if grad is None:
            return total, None
        return (grad if total is None else grad + total), None


def sinks_of(sources) -> list[Optional[GradientSink]]:
    """The gradient sink of each (B, T, d) source made by `share_gradient` (None for others);
    (d,) null sources are skipped."""
    return [getattr(s, SINK_ATTRIBUTE, None) for s in sources if s.dim() != 1]


def gradient_buffers(sinks, size, dtype, device) -> tuple[list[Tensor], list[bool]]:
    """For a backward launch: per source, the (size) buffer its gradient goes to and whether the
    kernel adds into it. A sink whose buffer a deeper site already wrote is added into; otherwise
    a new contiguous buffer is written, and becomes the sink's buffer when there is a sink."""
    buffers, accumulate = [], []
    for sink in sinks:
        if sink is not None and sink.grad is not None:
            buffers.append(sink.grad)
            accumulate.append(True)
            continue
        buffers.append(torch.empty(size, dtype=dtype, device=device))
        accumulate.append(False)
        if sink is not None:
            sink.grad = buffers[-1]
    return buffers, accumulate


def share_gradient(source: Tensor, outlives: bool = False, remakes: Optional[GradientSink] = None) -> Tensor:
    """A view of `source` (B, T, d) whose routing gradients are accumulated in one buffer.

    Every `route` call (outside torch.compile) that reads the returned view adds its gradient
    for it, in its backward kernel, into one (B, T, d) buffer in the source's dtype (the first
    writer overwrites, later ones read-modify-write with one rounding each), instead of
    returning a new gradient tensor that autograd then adds (k - 1 additions of three rows for
    a source read by k sites). The finished buffer reaches the source's producer through this
    view's backward. Gradients from ops other than `route` (or from `route` under
    torch.compile, whose custom op returns them as usual) are added there.

    outlives: the entry is alive for the whole backward anyway (an input of a later block, or read
    by a site outside the blocks): routing calls whose sources all outlive keep them as plain
    references instead of saving them (`launch.save_with_sources`: no saved-tensor hooks under
    activation checkpointing). Pass it only for such entries (the models' Router knows them from
    the routing plan); a transient entry kept so would live until the backward ends.

    remakes: the sink of the same entry made by the block's first forward, when activation
    checkpointing recomputes the block (inside the backward; ignored elsewhere). The recomputed
    entry then carries that sink: its readers' recomputed forwards find the first forward's table
    slots (the table path, not a table per launch), and its slot points at the recomputed tensor
    (`launch.remake`). Nothing is registered, and the view's own backward never runs
    (checkpointing detaches what it recomputes).

    A tensor that does not require grad, or grad mode off, returns `source` itself."""
    if not (torch.is_grad_enabled() and source.requires_grad):
        return source
    if remakes is not None and torch._C._current_graph_task_id() != -1 and launch.remake(remakes, source):
        view = launch.apply(_ShareGradient, source, remakes)
        setattr(view, SINK_ATTRIBUTE, remakes)
        return view
    sink = GradientSink(outlives)
    view = launch.apply(_ShareGradient, source, sink)
    setattr(view, SINK_ATTRIBUTE, sink)
    if source.dim() > 1:
        launch.register(sink, view)
    return view


class _EagerRoute(torch.autograd.Function):
    """The same forward and backward as the custom ops, called directly: outside torch.compile
    this skips the custom-op dispatch and pytree handling of the N sources (host time per call).
    Sources made by `share_gradient` get their gradient added into their sink by the kernel and
    return None here. Sources that are consecutive entries of one `launch.SourceTable` (the
    models' per-call sites; `looked_up` = (their sinks, (table, first slot) as `launch.lookup`
    gives it), made once by the caller) reach the kernels through the table's rows (no per-call
    table)."""

    @staticmethod
    def forward(ctx, looked_up, query, norm_weight, heads, eps, partial, alpha, null_source, *sources):
        # looked_up: (the sources' gradient sinks, their `launch.lookup`), made once by the caller; the
        # backward uses these sinks (under activation checkpointing the saved sources are recomputed views)
        ctx.sinks, found = looked_up
        ctx.found = None
        ctx.heads, ctx.eps = heads, eps
        ctx.partial_dtype = partial.dtype if partial is not None else None
        if found is not None:
            table, first = found
            cast = table.null_source(null_source) if null_source is not None else None
            if null_source is None or (cast is not None and first == 1):
                lo, hi = first - (cast is not None), first + len(sources)
                pointers, strides = table.views(lo, hi)[:2]
                srcs = sources if cast is None else (cast, *sources)
                out, mix, residual, stats = triton_routing.route_forward_saved(
                    srcs, query, norm_weight, heads, eps, partial=partial, alpha=alpha,
                    tables=(pointers, strides, table.aligned))
                ctx.found = (table, lo, hi, cast)
        if ctx.found is None:
            out, mix, residual, stats = triton_routing.route_forward_saved(
                contract.with_null_source(null_source, list(sources)), query, norm_weight, heads, eps, partial=partial,
                alpha=alpha)
        launch.save_with_sources(ctx, ctx.sinks, (out if partial is None else mix, residual, stats), sources,
                                 (query, norm_weight, alpha, null_source))
        return out

    @staticmethod
    @launch.once_differentiable
    def backward(ctx, grad_out):
        saved = launch.saved_with_sources(ctx)  # (unpacked once: activation checkpointing allows no more)
        if ctx.found is not None:
            result = _table_backward(ctx, grad_out, saved)
            if result is not None:
                return result
        sinks = ctx.sinks
        buffers, accumulate = gradient_buffers(sinks, grad_out.shape, grad_out.dtype, grad_out.device)
        _, dq, dg, dpartial, dalpha, dnull = _gradients(
            ctx, grad_out, lambda *args: _backward_values(*args, grads=buffers, accumulate=accumulate), saved=saved)
        head = (None, dq, dg, None, None, dpartial, dalpha, dnull)
        if all(sinks):  # every source shared (the models' case): nothing to hand to autograd
            return head + (None,) * len(sinks)
        return head + tuple(None if sink is not None else buffer for sink, buffer in zip(sinks, buffers))


def _table_backward(ctx, grad_out, saved) -> Optional[tuple]:
    """The backward of a call whose forward read a `launch.SourceTable` (ctx.found), through the
    table's rows, or None where the saved sources are not the registered ones (a recomputed block
    under activation checkpointing) or their gradient buffers are in mixed states: the caller
    takes the general path."""
    table, lo, hi, cast = ctx.found
    ctx.found = None  # a second backward (retain_graph) takes the general path: the table may be reused by then
    mix, residual, stats, query, norm_weight, alpha, null_source, *sources = saved
    # sources kept by reference are the registered tensors themselves: their pointers need no check
    rows = table.backward_rows(lo, hi, cast is not None, sources, grad_out.shape, grad_out.device,
                               registered=ctx.sources_kept)
    if rows is None:
        return None
    srcs = sources if cast is None else [cast, *sources]
    # the gradient buffers are in the table's rows (and in the sinks): the launch needs no list of them
    _, dq, dg, dalpha, dnull = triton_routing.route_backward(
        grad_out, srcs, mix, query, norm_weight, ctx.heads, ctx.eps, stats, alpha, mix_residual=residual,
        param_dtype=triton_routing.common_dtype(query, norm_weight, null_source), tables=rows)
    return (None, cast_like(dq, query), cast_like(dg, norm_weight), None, None,
            grad_out.to(ctx.partial_dtype) if ctx.partial_dtype is not None else None,
            cast_like(dalpha, alpha) if alpha is not None else None,
            cast_like(dnull, null_source) if null_source is not None else None) + (None,) * len(sources)


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
    """Fused multi-head depth routing (MHAR_SPEC sections 2 and 4; delta mode section 1.4).

    Args:
        sources: N tensors (B, T, d) of one dtype and device, passed separately (never stacked).
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


def route_unchecked(
    sources: list[Tensor],
    query: Tensor,
    norm_weight: Tensor,
    heads: int,
    eps: float = 1e-6,
    *,
    partial: Optional[Tensor] = None,
    alpha: Optional[Tensor] = None,
    null_source: Optional[Tensor] = None,
    looked_up: Optional[tuple] = None,
) -> Tensor:
    """`route` for arguments that `contract.check_route_args` already accepted (heads an int):
    the dispatcher (`dispatch.route`) checks each call once and then calls this. looked_up:
    (`launch.sinks(sources)`, their `launch.lookup`) where the caller already made them.
    Raises RuntimeError where the kernels cannot run (`can_run`)."""
    if torch.compiler.is_compiling():  # an opaque node in the graph
        return route_fwd(sources, query, norm_weight, heads, float(eps), partial, alpha, null_source)[0]
    _require(sources[0].device, sources[0].shape[-1], heads)
    if looked_up is None:
        sinks = launch.sinks(sources)
        looked_up = sinks, launch.lookup(sinks)
    return launch.apply(_EagerRoute, looked_up, query, norm_weight, heads, float(eps), partial, alpha, null_source,
                        *sources)
