"""Phase 1 of grouped depth routing on the fused kernels (`grouped_kernels`, the `@triton.jit`
code; docs/DESIGN.md "Grouped routing"): the launch side (site chunks and tiles per launch,
cached per shape; the (sources, sites) read table, made once per group shape; pointer tables,
the rows of the micro-batch's `launch.SourceTable` where the group's start entries are its
consecutive entries), the autograd Function `Phase1` and, for torch.compile, the custom ops
`mhar::phase1` / `mhar::phase1_backward`.

The kernels are looked up in this module's namespace at every launch (`_phase1_fwd_kernel`,
`_phase1_bwd_kernel`), so that the benchmarks can stub them out.
"""
from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch
from torch import Tensor

from . import contract, launch
from .grouped_kernels import _phase1_bwd_kernel, _phase1_fwd_kernel
from .op import can_run, gradient_buffers
from .triton_routing import (
    _TL_DTYPES, INTERPRET, NUM_STAGES, _cdiv, _device_table, _next_pow2, _source_table, aligned, reduce_programs,
)

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


@functools.lru_cache(maxsize=64)
def _cached_read_table(reads: tuple, n: int, padded: int, device: torch.device) -> Tensor:
    table = torch.zeros((n, padded), dtype=torch.int8)
    table[:, :len(reads)] = torch.tensor(reads, dtype=torch.int8).T
    return table.to(device)


def phase1_forward(sources: Sequence[Tensor], queries: Tensor, norm_weights: Tensor,
                   reads: Sequence[Sequence[bool]], heads: int, eps: float,
                   site_block: Optional[int] = None, tables: Optional[tuple[Tensor, Tensor, bool]] = None,
                   read_table: Optional[Tensor] = None) -> tuple[list[Tensor], Tensor]:
    """Launch the phase-1 forward. sources: n tensors (B, T, d), sources[0] may be a (d,) null
    source; queries, norm_weights (g, d); reads[i][j]: site i reads source j. tables: (pointers
    (n,), row strides (n,), whether every source is 16-byte aligned) of the sources as
    `launch.SourceTable.views` gives them (no source table is built then: only the g mix
    pointers are); read_table: the launch's `_read_table`, where the caller has it.
    Returns (g mixes (B, T, d) in the sources' dtype, lse (g, B, T, H) in the compute dtype: site
    i's lse is the contiguous lse[i])."""
    full = sources[-1]
    d, g = full.shape[-1], queries.shape[0]
    bt, head_dim = full.numel() // d, d // heads
    cdt = contract.compute_dtype(full.dtype)
    mixes = [torch.empty(full.shape, dtype=full.dtype, device=full.device) for _ in range(g)]
    lse = torch.empty((g, *full.shape[:-1], heads), dtype=cdt, device=full.device)
    if bt == 0:
        return mixes, lse
    n = len(sources)
    cfg = _launch_config(bt, g, heads, head_dim, False, site_block)
    chunks = _cdiv(g, cfg["SB"])
    mix_ptrs = [m.data_ptr() for m in mixes]
    if tables is not None:  # a `launch.SourceTable`'s rows
        pointer_rows, stride_rows, sources_aligned = tables
        mix_rows = _device_table(mix_ptrs, full.device)
        is_aligned = sources_aligned and aligned(mix_ptrs, (), head_dim)
        first = sources[0]
    else:
        tensors, ptrs, strides, table = _source_table(sources, d, extra=mix_ptrs)
        is_aligned = aligned(ptrs + mix_ptrs, strides, head_dim)
        pointer_rows, stride_rows, mix_rows, first = table[:n], table[n:2 * n], table[2 * n:], tensors[0]
    if read_table is None:
        read_table = _read_table(reads, n, chunks * cfg["SB"], full.device)
    grid = (chunks * _cdiv(bt, cfg["BLOCK_T"]),)
    _phase1_fwd_kernel[grid](
        pointer_rows, stride_rows, read_table, mix_rows,
        first, queries.contiguous(), norm_weights.contiguous(), lse,
        n, g, chunks, bt, d, heads, head_dim, eps,
        ALIGNED=is_aligned, NUM_STAGES=NUM_STAGES, CDT=_TL_DTYPES[cdt], RNE_BF16=INTERPRET, **cfg,
    )
    return mixes, lse


def phase1_backward(dmixes: Sequence[Tensor], dnorm: Tensor, sources: Sequence[Tensor], queries: Tensor,
                    norm_weights: Tensor, reads: Sequence[Sequence[bool]], heads: int, eps: float, lse: Tensor,
                    site_block: Optional[int] = None, grads: Optional[Sequence[Tensor]] = None,
                    accumulate: Optional[Sequence[bool]] = None, tables: Optional[tuple] = None,
                    read_table: Optional[Tensor] = None,
                    ) -> tuple[Optional[list[Tensor]], Tensor, Tensor, Optional[Tensor]]:
    """Launch the phase-1 backward. dmixes: g gradients (B, T, d) of the mixes; dnorm (g, B, T, H)
    of the normalisers; lse from `phase1_forward`. grads: optional contiguous (B, T, d) buffers,
    one per (B, T, d) source, that receive the source gradients (new ones otherwise);
    accumulate: per buffer, True to add into it (a shared gradient buffer another reader already
    wrote; in the kernel), False to overwrite. tables: (pointers, row strides, gradient pointers,
    per-source add flags, whether every buffer is added into, aligned) of the sources (no null
    source) and their gradient buffers (already made) as a `launch.SourceTable` gives them: no
    source table is built, grads / accumulate are not read and no source gradient list is
    returned (None). read_table: as `phase1_forward`.
    Returns (gradients of the (B, T, d) sources in their dtype, dq (g, d), dg (g, d) and dnull
    (d,) or None in the compute dtype), the partial sums reduced in a fixed order (bitwise
    repeatable)."""
    has_null = sources[0].dim() == 1
    full = sources[-1]
    d, g = full.shape[-1], queries.shape[0]
    bt, head_dim = full.numel() // d, d // heads
    cdt, device = lse.dtype, full.device
    n = len(sources)
    cfg = _launch_config(bt, g, heads, head_dim, True, site_block)
    chunks = _cdiv(g, cfg["SB"])
    n_rows = n - int(has_null)
    out = None
    if tables is None:
        accumulate = list(accumulate) if accumulate is not None else [False] * n_rows
        out = list(grads) if grads is not None else \
            [torch.empty_like(full, memory_format=torch.contiguous_format) for _ in range(n_rows)]
    if bt == 0:
        zeros = torch.zeros((g, d), dtype=cdt, device=device)
        return out, zeros, zeros.clone(), zeros.new_zeros(d) if has_null else None
    dmixes = [x.to(full.dtype).contiguous() for x in dmixes]
    dmix_ptrs = [x.data_ptr() for x in dmixes]
    # chunk c > 0 of a token tile adds into what chunk c - 1 stored: every source's buffer is added into
    if tables is not None:  # a `launch.SourceTable`'s rows: only the g incoming gradients' pointers are a new table
        pointer_rows, stride_rows, grad_rows, flag_rows, adds, sources_aligned = tables
        has_accum = chunks > 1 or adds
        dmix_rows = _device_table(dmix_ptrs, device)
        is_aligned = sources_aligned and aligned(dmix_ptrs, (), head_dim)
        first = sources[0]
    else:
        has_accum = chunks > 1 or any(accumulate)
        dptrs = [0] * int(has_null) + [x.data_ptr() for x in out]
        flags = [0] * int(has_null) + [int(a) for a in accumulate] if has_accum else []
        tensors, ptrs, strides, table = _source_table(sources, d, extra=dptrs + dmix_ptrs + flags)
        is_aligned = aligned(ptrs + [p for p in dptrs if p] + dmix_ptrs, strides, head_dim)
        dmix_at = 3 * n
        pointer_rows, stride_rows, grad_rows = table[:n], table[n:2 * n], table[2 * n:dmix_at]
        flag_rows, dmix_rows = table[dmix_at + g:], table[dmix_at:dmix_at + g]
        first = tensors[0]
    if read_table is None:
        read_table = _read_table(reads, n, chunks * cfg["SB"], device)
    programs = reduce_programs(_cdiv(bt, cfg["BLOCK_T"]), device)
    t_part = torch.zeros((programs, g, d), dtype=cdt, device=device)
    dnull_part = torch.empty((programs, d), dtype=cdt, device=device) if has_null else t_part
    q, w = queries.contiguous(), norm_weights.contiguous()
    _phase1_bwd_kernel[(programs,)](
        pointer_rows, stride_rows, grad_rows, flag_rows if has_accum else pointer_rows,
        read_table, dmix_rows, first, q, w,
        dnorm.to(cdt).contiguous(), lse, t_part, dnull_part,
        n, g, chunks, bt, d, heads, head_dim, eps,
        HAS_NULL=has_null, HAS_ACCUM=has_accum, CHUNKED=chunks > 1, ALIGNED=is_aligned, NUM_STAGES=NUM_STAGES,
        CDT=_TL_DTYPES[cdt], RNE_BF16=INTERPRET, **cfg,
    )
    t_sum = t_part.sum(0)
    dnull = dnull_part.sum(0) if has_null else None
    return out, t_sum * w.to(cdt), t_sum * q.to(cdt), dnull


def _upstream(grad_mixes: Sequence[Optional[Tensor]], grad_norms: Sequence[Optional[Tensor]], lse: Tensor, d: int,
              dtype: torch.dtype) -> tuple[list[Tensor], Tensor]:
    """Phase 1's incoming gradients as its backward launch takes them: the g mix gradients
    (B, T, d) in the sources' `dtype` and the normaliser gradients stacked to (g, B, T, H),
    zeros where autograd passed None (a site whose output was not used)."""
    dmixes = [torch.zeros(lse.shape[1:-1] + (d,), dtype=dtype, device=lse.device) if x is None else x
              for x in grad_mixes]
    dnorm = torch.stack([torch.zeros_like(lse[0]) if x is None else x for x in grad_norms])
    return dmixes, dnorm


class Phase1(torch.autograd.Function):
    """Phase 1 of one group on the fused kernels: forward(queries (g, d), norm_weights (g, d),
    reads (per site, one bool per source), heads, eps, *sources) -> (mix_1..mix_g (B, T, d),
    norm_1..norm_g (B, T, H), lse (g, B, T, H)): the mixes in the sources' dtype (the fused merge,
    `triton_merge`, reads them so), the rest in the compute dtype; otherwise the contract of the
    eager phase 1, `grouped_reference.phase1` (a leading (d,) source is the null source).
    lse is not differentiable; norm_i is 1 (its gradient carries the softmax term, module docstring).

    Saves for backward: lse (g H values per token); kept as plain references
    (`launch.save_with_sources`): the query and key-norm rows and the sources. No (B, T, d)
    tensor. A source made by `op.share_gradient` gets its gradient added into its shared buffer
    (as the per-call kernels do) and None returned."""

    site_block: Optional[int] = None  # tests: force the chunked path (launch_config's site_block)

    @staticmethod
    def forward(ctx, queries: Tensor, norm_weights: Tensor, reads: tuple, heads: int, eps: float, *sources: Tensor):
        has_null = sources[0].dim() == 1
        shared = sources[1:] if has_null else sources
        ctx.sinks = launch.sinks(shared)
        # sources that are consecutive entries of one source table launch on its rows (no null source:
        # the model hands phase 1 its own cast of it, which no table slot holds)
        found = launch.lookup(ctx.sinks) if not has_null else None
        ctx.found, tables = None, None
        if found is not None:
            table, first = found
            ctx.found = (table, first, first + len(shared))
            tables = (*table.views(first, first + len(shared))[:2], table.aligned)
        full = sources[-1]
        d, g = full.shape[-1], queries.shape[0]
        cfg = _launch_config(full.numel() // d, g, heads, d // heads, False, Phase1.site_block)
        ctx.read_table = _read_table(reads, len(sources), _cdiv(g, cfg["SB"]) * cfg["SB"], full.device)
        # (positional arguments: tests spy on phase1_forward with a plain *args wrapper)
        mixes, lse = phase1_forward(sources, queries, norm_weights, reads, heads, eps, Phase1.site_block, tables,
                                    ctx.read_table)
        # the normalisers (identically 1): rows of one tensor
        norms = torch.ones(lse.shape, dtype=lse.dtype, device=lse.device).unbind(0)
        launch.save_with_sources(ctx, ctx.sinks, (lse,), sources, (queries, norm_weights))
        ctx.heads, ctx.reads, ctx.eps = heads, reads, eps
        ctx.mark_non_differentiable(lse)
        return (*mixes, *norms, lse)

    @staticmethod
    @launch.once_differentiable
    def backward(ctx, *grads):
        lse, queries, norm_weights, *sources = launch.saved_with_sources(ctx)
        g = queries.shape[0]
        full = sources[-1]  # shared gradient buffers (op.share_gradient), as the per-call op uses them
        dmixes, dnorm = _upstream(grads[:g], grads[g:2 * g], lse, queries.shape[1], full.dtype)
        rows = None
        if ctx.found is not None:
            table, lo, hi = ctx.found
            ctx.found = None  # a second backward takes the general path (the table may be reused by then)
            rows = table.backward_rows(lo, hi, False, sources, full.shape, full.device)
        if rows is not None:  # every source shared, its gradient added into its buffer in the kernel
            pointers, strides, grad_rows, ones, aligned_rows = rows
            flags = ones if ones is not None else table.views(lo, hi)[4]
            _, dq, dg, dnull = phase1_backward(
                dmixes, dnorm, sources, queries, norm_weights, ctx.reads, ctx.heads, ctx.eps, lse, Phase1.site_block,
                tables=(pointers, strides, grad_rows, flags, ones is not None, aligned_rows),
                read_table=ctx.read_table)
            out = [None] * len(sources)
        else:
            buffers, accumulate = gradient_buffers(ctx.sinks, full.shape, full.dtype, full.device)
            out, dq, dg, dnull = phase1_backward(dmixes, dnorm, sources, queries, norm_weights, ctx.reads,
                                                 ctx.heads, ctx.eps, lse, Phase1.site_block, grads=buffers,
                                                 accumulate=accumulate, read_table=ctx.read_table)
            out = [None if sink is not None else x for x, sink in zip(out, ctx.sinks)]
            if dnull is not None:
                out = [dnull.to(sources[0].dtype), *out]
            out = [x if need else None for x, need in zip(out, ctx.needs_input_grad[5:])]
        return (dq.to(queries.dtype), dg.to(norm_weights.dtype), None, None, None, *out)


# ---------------------------------------------------------------------------- custom ops
# Inside torch.compile the phase 1 is two registered custom ops (opaque graph nodes: fake tensors
# have no data pointer), as the per-call kernels are (op.py); reads are flattened, site-major.
def _unflatten_reads(reads: list[bool], sites: int) -> tuple:
    n = len(reads) // sites
    return tuple(tuple(reads[i * n:(i + 1) * n]) for i in range(sites))


@torch.library.custom_op("mhar::phase1", mutates_args=())
def phase1_op(sources: list[Tensor], queries: Tensor, norm_weights: Tensor, reads: list[bool], heads: int,
              eps: float) -> tuple[list[Tensor], list[Tensor], Tensor]:
    mixes, lse = phase1_forward(sources, queries, norm_weights, _unflatten_reads(reads, queries.shape[0]), heads,
                                eps, Phase1.site_block)
    return mixes, [torch.ones(lse.shape[1:], dtype=lse.dtype, device=lse.device) for _ in mixes], lse


@phase1_op.register_fake
def _phase1_fake(sources, queries, norm_weights, reads, heads, eps):
    full = sources[-1]
    cdt = contract.compute_dtype(full.dtype)
    g = queries.shape[0]
    return ([full.new_empty(full.shape) for _ in range(g)],
            [full.new_empty((*full.shape[:-1], heads), dtype=cdt) for _ in range(g)],
            full.new_empty((g, *full.shape[:-1], heads), dtype=cdt))


@torch.library.custom_op("mhar::phase1_backward", mutates_args=())
def phase1_backward_op(dmixes: list[Tensor], dnorm: Tensor, sources: list[Tensor], queries: Tensor,
                       norm_weights: Tensor, reads: list[bool], heads: int, eps: float,
                       lse: Tensor) -> tuple[list[Tensor], Tensor, Tensor]:
    grads, dq, dg, dnull = phase1_backward(dmixes, dnorm, sources, queries, norm_weights,
                                           _unflatten_reads(reads, queries.shape[0]), heads, eps, lse,
                                           Phase1.site_block)
    if dnull is not None:
        grads = [dnull.to(sources[0].dtype), *grads]
    return grads, dq.to(queries.dtype), dg.to(norm_weights.dtype)


@phase1_backward_op.register_fake
def _phase1_backward_fake(dmixes, dnorm, sources, queries, norm_weights, reads, heads, eps, lse):
    return [s.new_empty(s.shape) for s in sources], torch.empty_like(queries), torch.empty_like(norm_weights)


def _phase1_setup_context(ctx, inputs, output):
    sources, queries, norm_weights, reads, heads, eps = inputs
    ctx.save_for_backward(queries, norm_weights, output[2], *sources)
    ctx.reads, ctx.heads, ctx.eps = reads, heads, eps


def _phase1_op_backward(ctx, grad_mixes, grad_norms, _grad_lse):
    queries, norm_weights, lse, *sources = ctx.saved_tensors
    dmixes, dnorm = _upstream(grad_mixes, grad_norms, lse, queries.shape[1], sources[-1].dtype)
    grads, dq, dg = phase1_backward_op(dmixes, dnorm, sources, queries, norm_weights, ctx.reads, ctx.heads, ctx.eps,
                                       lse)
    return list(grads), dq, dg, None, None, None


phase1_op.register_autograd(_phase1_op_backward, setup_context=_phase1_setup_context)


def route_phase1(queries: Tensor, norm_weights: Tensor, reads: tuple, heads: int, eps: float,
                 *sources: Tensor) -> tuple[Tensor, ...]:
    """Phase 1 of one routing group on the fused kernels, with autograd (`Phase1`; inside
    torch.compile the custom op `mhar::phase1`, an opaque graph node).

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
        ValueError: reads not g tuples of n bools.
    """
    full = sources[-1]
    if not torch.compiler.is_compiling() and not can_run(full.device, full.shape[-1], heads):
        raise RuntimeError(f"the phase-1 kernels cannot run on {full.device} at d={full.shape[-1]}, H={heads} "
                           "(CUDA, or CPU with TRITON_INTERPRET=1, within the register budget); check "
                           "mhar_kernels.can_run() first and use the eager phase 1 where it is False, or call "
                           "mhar_kernels.dispatch.phase1, which does")
    if len(reads) != queries.shape[0] or any(len(r) != len(sources) for r in reads):
        raise ValueError(f"reads must be {queries.shape[0]} tuples of {len(sources)} bools (one per site and "
                         f"source), got {[len(r) for r in reads]}")
    if torch.compiler.is_compiling():
        mixes, norms, lse = phase1_op(list(sources), queries, norm_weights, [bool(x) for r in reads for x in r],
                                      int(heads), float(eps))
        return (*mixes, *norms, lse)
    return launch.apply(Phase1, queries, norm_weights, reads, int(heads), float(eps), *sources)
