"""Phase 1 of grouped depth routing on the fused kernels (`grouped_kernels`, the `@triton.jit`
code; docs/DESIGN.md "Grouped routing"): the launch side (site chunks and tiles per launch,
cached per shape; the (sources, sites) read table, made once per group shape), the autograd
Function `Phase1` over rows of a depth buffer (`depth_buffer`), the holder of the group's mix
gradients that its fused merges write into (`MixGradients`) and, for torch.compile, the custom ops
`mhar::phase1` / `mhar::phase1_backward`.

The kernels are looked up in this module's namespace at every launch (`_phase1_fwd_kernel`,
`_phase1_bwd_kernel`), so that the benchmarks can stub them out.
"""
from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch
from torch import Tensor

from . import contract, depth_buffer
from .depth_buffer import DepthBuffer, Reads
from .grouped_kernels import _phase1_bwd_kernel, _phase1_fwd_kernel
from .op import can_run, cast_null, why_not
from .triton_routing import _TL_DTYPES, INTERPRET, NUM_STAGES, _cdiv, _next_pow2, aligned, reduce_programs

# GPU layout: `contract.grouped_layout` (triton-free, so that the dry run plans a grouped job's
# traffic without triton installed).
# ptxas's register limit for the backward (.maxnreg): without one it stays at 128 registers at
# H = 1 by spilling two values; the forward needs no limit (at most 128 registers).
_BWD_MAX_REGISTERS = 168
_INTERPRET_BLOCK_T = 128


def launch_config(bt: int, group: int, heads: int, head_dim: int, backward: bool,
                  site_block: Optional[int] = None) -> dict:
    """{'BLOCK_T', 'SB', 'HB', 'KB', 'num_warps', 'maxnreg'} for B*T tokens and a group of
    `group` sites, forward or backward launch.

    On a GPU each thread holds _ROW_ELEMENTS elements of the [BLOCK_T, HB, KB] source tile (one
    token per program at the paper's shapes: 2, 4 and 8 warps at d = 512, 1024, 1280) and SB
    (sites per program, a power of two) is the whole group where SB of those elements per thread
    fit _TILE_PER_THREAD, else the largest power of two that does (2 at the paper's shapes).
    maxnreg is ptxas's register limit (the backward's; None for the forward). site_block
    overrides SB (tests of the chunked path). Under the interpreter BLOCK_T is large (few
    programs); SB follows the GPU's rule so that CPU tests run the GPU's chunking. (A new dict;
    the launches use the cached `_launch_config`.)"""
    return dict(_launch_config(bt, group, heads, head_dim, backward, site_block))


@functools.lru_cache(maxsize=256)
def _launch_config(bt: int, group: int, heads: int, head_dim: int, backward: bool,
                   site_block: Optional[int]) -> dict:
    """`launch_config`, cached (host time per launch); callers must not change it."""
    layout = contract.grouped_layout(bt, group, heads, head_dim, site_block)
    if INTERPRET:
        layout["BLOCK_T"] = min(_next_pow2(max(bt, 1)), _INTERPRET_BLOCK_T)
    return dict(layout, maxnreg=_BWD_MAX_REGISTERS if backward else None)


def _read_table(reads: Sequence[Sequence[bool]], n: int, padded: int, device: torch.device) -> Tensor:
    """int8 (n, padded): entry [j, i] = 1 when site i reads source j (padded sites read nothing).
    Made once per (reads, shape, device) and shared by every launch with them (the kernels only
    read it): a step's groups repeat at every step."""
    return _cached_read_table(tuple(map(tuple, reads)), n, padded, device)


@functools.lru_cache(maxsize=None)  # one per group shape of the models built: never rebuilt per step
def _cached_read_table(reads: tuple, n: int, padded: int, device: torch.device) -> Tensor:
    table = torch.zeros((n, padded), dtype=torch.int8)
    table[:, :len(reads)] = torch.tensor(reads, dtype=torch.int8).T
    return table.to(device)


def phase1_forward(values: Tensor, slots: Tensor, queries: Tensor, norm_weights: Tensor,
                   reads: Sequence[Sequence[bool]], heads: int, eps: float, null: Optional[Tensor] = None,
                   site_block: Optional[int] = None, read_table: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Launch the phase-1 forward over the depth-buffer rows `slots` (int32 (n,)) of `values`
    (capacity, B, T, d); null: the (d,) null source in the buffer's dtype, source 0 before the
    rows, or None. queries, norm_weights (g, d); reads[i][j]: site i reads source j (the null
    first). read_table: the launch's `_read_table`, where the caller has it.
    Returns (mixes (g, B, T, d) in the sources' dtype, lse (g, B, T, H) in the compute dtype:
    site i's are the contiguous mixes[i] and lse[i])."""
    full = values[0]
    d, g = full.shape[-1], queries.shape[0]
    bt, head_dim = full.numel() // d, d // heads
    cdt = contract.compute_dtype(full.dtype)
    mixes = torch.empty((g, *full.shape), dtype=full.dtype, device=full.device)
    lse = torch.empty((g, *full.shape[:-1], heads), dtype=cdt, device=full.device)
    if bt == 0:
        return mixes, lse
    n = slots.shape[0]
    cfg = _launch_config(bt, g, heads, head_dim, False, site_block)
    chunks = _cdiv(g, cfg["SB"])
    if read_table is None:
        read_table = _read_table(reads, n + (null is not None), chunks * cfg["SB"], full.device)
    grid = (chunks * _cdiv(bt, cfg["BLOCK_T"]),)
    _phase1_fwd_kernel[grid](
        values, slots, null if null is not None else values, read_table, mixes,
        queries.contiguous(), norm_weights.contiguous(), lse,
        n, g, chunks, bt, d, heads, head_dim, eps,
        HAS_NULL=null is not None, ALIGNED=aligned(head_dim, values, mixes), NUM_STAGES=NUM_STAGES,
        CDT=_TL_DTYPES[cdt], RNE_BF16=INTERPRET, **cfg,
    )
    return mixes, lse


def phase1_backward(dmixes: Tensor, dnorm: Tensor, values: Tensor, slots: Tensor, queries: Tensor,
                    norm_weights: Tensor, reads: Sequence[Sequence[bool]], heads: int, eps: float, lse: Tensor,
                    grads: Tensor, accumulate: Optional[Tensor] = None, null: Optional[Tensor] = None,
                    site_block: Optional[int] = None, read_table: Optional[Tensor] = None,
                    ) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    """Launch the phase-1 backward. dmixes (g, B, T, d): the gradients of the mixes in the
    sources' dtype; dnorm (g, B, T, H) of the normalisers; lse from `phase1_forward`; values,
    slots, null as there. grads: the buffer's gradient buffer (values' shape): source j's
    gradient goes to row slots[j], written, or added where accumulate[j] != 0 (int32 (n,), None:
    every row written). Returns (dq (g, d), dg (g, d), dnull (d,) or None) in the compute dtype,
    the partial sums reduced in a fixed order (bitwise repeatable)."""
    has_null = null is not None
    full = values[0]
    d, g = full.shape[-1], queries.shape[0]
    bt, head_dim = full.numel() // d, d // heads
    cdt, device = lse.dtype, full.device
    n = slots.shape[0]
    cfg = _launch_config(bt, g, heads, head_dim, True, site_block)
    chunks = _cdiv(g, cfg["SB"])
    if bt == 0:
        zeros = torch.zeros((g, d), dtype=cdt, device=device)
        return zeros, zeros.clone(), zeros.new_zeros(d) if has_null else None
    # chunk c > 0 of a token tile adds into what chunk c - 1 stored: every source's row is added into
    has_accum = chunks > 1 or accumulate is not None
    if read_table is None:
        read_table = _read_table(reads, n + has_null, chunks * cfg["SB"], device)
    programs = reduce_programs(_cdiv(bt, cfg["BLOCK_T"]), device)
    t_part = torch.zeros((programs, g, d), dtype=cdt, device=device)
    dnull_part = torch.empty((programs, d), dtype=cdt, device=device) if has_null else t_part
    q, w = queries.contiguous(), norm_weights.contiguous()
    dmixes = dmixes.contiguous()
    _phase1_bwd_kernel[(programs,)](
        values, slots, grads, accumulate if accumulate is not None else torch.zeros_like(slots),
        null if has_null else values, read_table, dmixes, q, w,
        dnorm.to(cdt).contiguous(), lse, t_part, dnull_part,
        n, g, chunks, bt, d, heads, head_dim, eps,
        HAS_NULL=has_null, HAS_ACCUM=has_accum, CHUNKED=chunks > 1, ALIGNED=aligned(head_dim, values, grads, dmixes),
        NUM_STAGES=NUM_STAGES, CDT=_TL_DTYPES[cdt], RNE_BF16=INTERPRET, **cfg,
    )
    t_sum = t_part.sum(0)
    dnull = dnull_part.sum(0) if has_null else None
    return t_sum * w.to(cdt), t_sum * q.to(cdt), dnull


class MixGradients:
    """The (g, B, T, d) gradient of one group's phase-1 mixes, in the sources' dtype, which the
    group's fused merges write straight into their rows (`triton_merge`) so that phase 1's backward
    reads one tensor (no stacking of g gradients). `rows` is made at the first write; `given`: the
    sites whose row was written."""

    __slots__ = ("rows", "given")

    def __init__(self):
        self.rows: Optional[Tensor] = None
        self.given: set = set()

    def row(self, site: int, like: Tensor, sites: int) -> Tensor:
        """Site `site`'s row (like's shape and dtype) to write, of `sites` rows in all."""
        if self.rows is None:
            self.rows = torch.empty((sites, *like.shape), dtype=like.dtype, device=like.device)
        self.given.add(site)
        return self.rows[site]


def _upstream(grad_mixes: Sequence[Optional[Tensor]], grad_norms: Sequence[Optional[Tensor]], lse: Tensor, d: int,
              dtype: torch.dtype, given: Optional[MixGradients] = None) -> tuple[Tensor, Tensor]:
    """Phase 1's incoming gradients as its backward launch takes them: the g mix gradients as one
    (g, B, T, d) tensor in the sources' `dtype` (the rows the merges wrote into `given`, plus any
    gradient autograd passed; zeros where neither) and the normaliser gradients stacked to
    (g, B, T, H) (zeros where autograd passed None)."""
    g = lse.shape[0]
    rows = given.rows if given is not None and given.rows is not None else None
    if rows is None:
        rows = torch.empty((g, *lse.shape[1:-1], d), dtype=dtype, device=lse.device)
    written = given.given if given is not None else set()
    for i, x in enumerate(grad_mixes):
        if i in written:
            if x is not None:
                rows[i] += x
        elif x is not None:
            rows[i].copy_(x)
        else:
            rows[i].zero_()
    dnorm = torch.stack([torch.zeros_like(lse[0]) if x is None else x for x in grad_norms])
    return rows, dnorm


class Phase1(torch.autograd.Function):
    """Phase 1 of one group on the fused kernels over rows of a depth buffer: forward(token,
    queries (g, d), norm_weights (g, d), null (d,) or None, buffer, reads, site_reads (per site,
    one bool per source, the null first), heads, eps, given (`MixGradients` or None)) ->
    (mix_1..mix_g (B, T, d), norm_1..norm_g (B, T, H), lse (g, B, T, H)): the mixes in the
    sources' dtype (the fused merge reads them so; rows of one tensor), the rest in the compute
    dtype; otherwise the contract of the eager phase 1, `grouped_reference.phase1`. lse is not
    differentiable; norm_i is 1 (its gradient carries the softmax term, module docstring).
    Saves lse and the parameter rows; reads the sources from the buffer again in the backward,
    where their gradients go into the buffer's gradient rows. site_block: sites per program
    (`launch_config`; None: its choice)."""

    @staticmethod
    def forward(ctx, token, queries: Tensor, norm_weights: Tensor, null: Optional[Tensor], buffer, reads,
                site_reads: tuple, heads: int, eps: float, given: Optional[MixGradients], site_block: Optional[int]):
        ctx.set_materialize_grads(False)  # the merges write the mixes' gradients into `given`: no zero rows
        full = buffer.values[0]
        d, g = full.shape[-1], queries.shape[0]
        cfg = _launch_config(full.numel() // d, g, heads, d // heads, False, site_block)
        ctx.read_table = _read_table(site_reads, reads.slots.shape[0] + (null is not None),
                                     _cdiv(g, cfg["SB"]) * cfg["SB"], full.device)
        # (positional arguments: tests spy on phase1_forward with a plain *args wrapper)
        mixes, lse = phase1_forward(buffer.values, reads.slots, queries, norm_weights, site_reads, heads, eps,
                                    cast_null(null, full.dtype), site_block, ctx.read_table)
        # the normalisers (identically 1): rows of one tensor
        norms = torch.ones(lse.shape, dtype=lse.dtype, device=lse.device).unbind(0)
        ctx.save_for_backward(lse, queries, norm_weights, null)
        ctx.buffer, ctx.reads, ctx.site_reads, ctx.heads, ctx.eps, ctx.given = buffer, reads, site_reads, heads, eps, given
        ctx.site_block = site_block
        ctx.mark_non_differentiable(lse)
        return (*mixes.unbind(0), *norms, lse)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        lse, queries, norm_weights, null = ctx.saved_tensors
        g, buffer = queries.shape[0], ctx.buffer
        dtype = buffer.values.dtype
        dmixes, dnorm = _upstream(grads[:g], grads[g:2 * g], lse, queries.shape[1], dtype, ctx.given)
        if ctx.given is not None:
            ctx.given.given.clear()  # read: a later backward over the graph (retain_graph) starts afresh
        dq, dg, dnull = phase1_backward(dmixes, dnorm, buffer.values, ctx.reads.slots, queries, norm_weights,
                                        ctx.site_reads, ctx.heads, ctx.eps, lse, buffer.gradients(ctx.reads),
                                        ctx.reads.accumulate, cast_null(null, dtype), ctx.site_block, ctx.read_table)
        return (None, dq.to(queries.dtype), dg.to(norm_weights.dtype),
                None if null is None else dnull.to(null.dtype), None, None, None, None, None, None, None)



# ---------------------------------------------------------------------------- custom ops
# Inside torch.compile the phase 1 is two registered custom ops (opaque graph nodes: fake tensors
# have no data pointer) over the list of sources, stacked into a buffer of their own (a copy per
# call), as the per-call kernels are (op.py); reads are flattened, site-major.
def _unflatten_reads(reads: list[bool], sites: int) -> tuple:
    n = len(reads) // sites
    return tuple(tuple(reads[i * n:(i + 1) * n]) for i in range(sites))


def _stacked(sources: list[Tensor]) -> tuple[Optional[Tensor], Tensor, Tensor]:
    """(null source or None, values (n, B, T, d), int32 slots) of a source list."""
    null, full = contract.split_null_source(sources)
    return null, torch.stack(full), torch.arange(len(full), dtype=torch.int32, device=full[0].device)


@torch.library.custom_op("mhar::phase1", mutates_args=())
def phase1_op(sources: list[Tensor], queries: Tensor, norm_weights: Tensor, reads: list[bool], heads: int,
              eps: float) -> tuple[Tensor, Tensor, Tensor]:
    null, values, slots = _stacked(list(sources))
    mixes, lse = phase1_forward(values, slots, queries, norm_weights, _unflatten_reads(reads, queries.shape[0]),
                                heads, eps, cast_null(null, values.dtype))
    return mixes, torch.ones(lse.shape, dtype=lse.dtype, device=lse.device), lse


@phase1_op.register_fake
def _phase1_fake(sources, queries, norm_weights, reads, heads, eps):
    full = sources[-1]
    cdt = contract.compute_dtype(full.dtype)
    g = queries.shape[0]
    return (full.new_empty((g, *full.shape)), full.new_empty((g, *full.shape[:-1], heads), dtype=cdt),
            full.new_empty((g, *full.shape[:-1], heads), dtype=cdt))


@torch.library.custom_op("mhar::phase1_backward", mutates_args=())
def phase1_backward_op(dmixes: Tensor, dnorm: Tensor, sources: list[Tensor], queries: Tensor,
                       norm_weights: Tensor, reads: list[bool], heads: int, eps: float,
                       lse: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    null, values, slots = _stacked(list(sources))
    grads = torch.empty_like(values)
    dq, dg, dnull = phase1_backward(dmixes.to(values.dtype), dnorm, values, slots, queries, norm_weights,
                                    _unflatten_reads(reads, queries.shape[0]), heads, eps, lse, grads,
                                    null=cast_null(null, values.dtype))
    dnull = dnull.to(null.dtype) if null is not None else dq.new_empty((0,))
    return grads, dq.to(queries.dtype), dg.to(norm_weights.dtype), dnull


@phase1_backward_op.register_fake
def _phase1_backward_fake(dmixes, dnorm, sources, queries, norm_weights, reads, heads, eps, lse):
    null, full = contract.split_null_source(sources)
    return (full[0].new_empty((len(full), *full[0].shape)), torch.empty_like(queries), torch.empty_like(norm_weights),
            torch.empty_like(null) if null is not None else queries.new_empty((0,)))


def _phase1_setup_context(ctx, inputs, output):
    sources, queries, norm_weights, reads, heads, eps = inputs
    ctx.save_for_backward(queries, norm_weights, output[2], *sources)
    ctx.reads, ctx.heads, ctx.eps = reads, heads, eps


def _phase1_op_backward(ctx, grad_mixes, grad_norms, _grad_lse):
    queries, norm_weights, lse, *sources = ctx.saved_tensors
    grads, dq, dg, dnull = phase1_backward_op(grad_mixes, grad_norms, sources, queries, norm_weights, ctx.reads,
                                              ctx.heads, ctx.eps, lse)
    source_grads = list(grads.unbind(0))
    if sources[0].dim() == 1:
        source_grads = [dnull, *source_grads]
    return source_grads, dq, dg, None, None, None


phase1_op.register_autograd(_phase1_op_backward, setup_context=_phase1_setup_context)


def _check(queries: Tensor, reads: tuple, heads: int, n: int, device: torch.device, dim: int) -> None:
    if not torch.compiler.is_compiling() and not can_run(device, dim, heads):
        raise RuntimeError(f"the phase-1 kernels cannot run here: {why_not(device, dim, heads)}; check "
                           "mhar_kernels.can_run() first and use the eager phase 1 where it is False, or call "
                           "mhar_kernels.dispatch.phase1, which does")
    if len(reads) != queries.shape[0] or any(len(r) != n for r in reads):
        raise ValueError(f"reads must be {queries.shape[0]} tuples of {n} bools (one per site and "
                         f"source), got {[len(r) for r in reads]}")


def route_phase1(queries: Tensor, norm_weights: Tensor, reads: tuple, heads: int, eps: float,
                 *sources: Tensor) -> tuple[Tensor, ...]:
    """Phase 1 of one routing group on the fused kernels over a list of sources, with autograd
    (`Phase1` over a depth buffer of their own, `depth_buffer.stacked`; inside torch.compile the
    custom op `mhar::phase1`, an opaque graph node). The models call `phase1_buffer` instead.

    Args:
        queries, norm_weights: the group's pseudo-queries and key-norm weights, (g, d) each.
        reads: g tuples of one bool per source: site i reads source j.
        heads, eps: routing heads H (d % H == 0) and RMSNorm epsilon.
        sources: the n entries that exist when the group starts, (B, T, d) each of one dtype; a
            leading (d,) tensor is the null source (in the sources' dtype).

    Returns:
        (mix_1..mix_g (B, T, d) in the sources' dtype, norm_1..norm_g (B, T, H), lse (g, B, T, H)
        in the compute dtype (fp32, fp64 for fp64 sources)).

    Raises:
        RuntimeError: where the kernels cannot run (`op.can_run` is False: the per-call kernels' rule).
        ValueError: reads not g tuples of n bools, no (B, T, d) source, or bad arguments as
            `contract.check_route_args` (checked outside torch.compile).
    """
    full = sources[-1]
    _check(queries, reads, heads, len(sources), full.device, full.shape[-1])
    if torch.compiler.is_compiling():
        mixes, norms, lse = phase1_op(list(sources), queries, norm_weights, [bool(x) for r in reads for x in r],
                                      int(heads), float(eps))
        return (*mixes.unbind(0), *norms.unbind(0), lse)
    null, rest = contract.split_null_source(sources)
    if not rest:
        raise ValueError("route_phase1 needs at least one (B, T, d) source besides a null source")
    heads = contract.check_route_args(rest, queries[0], norm_weights[0], heads, null_source=null)
    buffer, token, rows = depth_buffer.stacked(rest)
    return phase1_buffer(buffer, rows, token, queries, norm_weights, reads, heads, eps, null)


def phase1_buffer(buffer: DepthBuffer, reads: Reads, token: Optional[Tensor], queries: Tensor, norm_weights: Tensor,
                  site_reads: tuple, heads: int, eps: float, null: Optional[Tensor] = None,
                  given: Optional[MixGradients] = None, site_block: Optional[int] = None) -> tuple[Tensor, ...]:
    """`route_phase1` over the rows `reads` of a depth buffer, after the write that made `token`;
    null: the (d,) null source (source 0 of `site_reads`) or None; given: where the group's fused
    merges write their mix gradients (`MixGradients`), None when the mixes' gradients come through
    autograd; site_block: sites per program (`launch_config`; None: its choice). The arguments are the
    caller's to check."""
    return Phase1.apply(token, queries, norm_weights, null, buffer, reads, site_reads, int(heads), float(eps), given,
                        site_block)
