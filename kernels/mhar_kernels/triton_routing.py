"""The launch side of the fused per-call routing kernels (`routing_kernels`, the `@triton.jit`
code; MHAR_SPEC sections 2 and 4): launch configurations (cached per shape), the alignment rule
that picks the aligned variant, per-launch pointer tables for sources that are not rows of a
`launch.SourceTable`, and the launch wrappers `route_forward` / `route_backward` (the fused
merge, `triton_merge`, launches the same kernels with the phase-1 state).

Sources are N separate tensors, never stacked: the kernels read a device table of their data
pointers (int64) and row strides, the rows of the micro-batch's `launch.SourceTable` where the
sources are its consecutive entries, else a table built here per launch. A (d,) null source is
source 0 with row stride 0 (broadcast over tokens). The backward's dq, dg, dalpha and dnull come
as (programs, d) partial sums (`reduce_programs`) that the host reduces in a fixed order.

The kernels are looked up in this module's namespace at every launch (`_route_fwd_kernel`,
`_route_bwd_kernel`), so that the benchmarks can stub them out (`bench/routing_harness.py`).
"""
from __future__ import annotations

import array
import functools
import operator
from typing import Optional, Sequence

import torch
import triton.language as tl
from torch import Tensor

from .contract import MAX_TILE, _next_pow2, compute_dtype, fits_tile  # noqa: F401  (re-exported)
from .routing_kernels import (  # noqa: F401  (the device helpers, also for triton_grouped and compile_report)
    INTERPRET, _inv_rms_and_key, _load_source, _route_bwd_kernel, _route_fwd_kernel, _source_base, _to_storage,
)


_TL_DTYPES = {torch.float32: tl.float32, torch.float64: tl.float64}
# Register budget on a GPU: elements of one [BLOCK_T, HB, KB] tile per program; 8 warps keep
# the backward at <= 168 registers per thread (no spills) at the paper's shapes.
_FWD_TILE = 4096
_BWD_TILE = 2048
# Stages of the software pipeline over the sources (cp.async prefetch of the next sources).
NUM_STAGES = 3
# Persistent backward programs per streaming multiprocessor: dq / dg partials are
# (programs, d) fp32, a fraction of one (B*T, d) row set.
PROGRAMS_PER_SM = 2
# Under the interpreter programs run one after another in Python: few, large programs.
_INTERPRET_BLOCK_T = 128
# MAX_TILE, fits_tile: the register budget of one token's tile lives in `contract` (torch only),
# so that planning a GPU job (`dispatch.planned_backend`) needs no triton.


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def launch_config(bt: int, heads: int, head_dim: int, backward: bool) -> dict:
    """Tile sizes and warps for B*T tokens: {'BLOCK_T', 'HB', 'KB', 'num_warps'} (a new dict).

    One configuration under the interpreter (whole problem in as few programs as possible);
    on a GPU BLOCK_T fills a fixed register budget (the paper uses one token per program)."""
    return dict(_launch_config(bt, heads, head_dim, backward))


@functools.lru_cache(maxsize=256)
def _launch_config(bt: int, heads: int, head_dim: int, backward: bool) -> dict:
    """`launch_config`, cached (host time per launch); callers get copies."""
    hb, kb = _next_pow2(heads), _next_pow2(head_dim)
    if INTERPRET:
        block_t = min(_next_pow2(max(bt, 1)), _INTERPRET_BLOCK_T)
    else:
        budget = _BWD_TILE if backward else _FWD_TILE
        if backward and hb == 1 and kb <= _BWD_TILE // 2:
            # one head: the d-wide reductions need more registers per element; half the tile
            # (4 warps, still 8 elements per thread) keeps triton 3.6 from spilling at d = 512, 1024
            budget = _BWD_TILE // 2
        block_t = max(1, min(_next_pow2(max(bt, 1)), budget // (hb * kb)))
    tile = block_t * hb * kb
    num_warps = 8 if tile >= 2048 else 4 if tile >= 1024 else 2
    return dict(BLOCK_T=block_t, HB=hb, KB=kb, num_warps=num_warps)


def reduce_programs(tiles: int, device: torch.device) -> int:
    """Programs of the backward launch: PROGRAMS_PER_SM per streaming multiprocessor on CUDA
    (one under the interpreter), never more than there are token tiles."""
    if device.type != "cuda":
        return 1
    return max(1, min(tiles, PROGRAMS_PER_SM * _multiprocessors(device.index)))


@functools.lru_cache(maxsize=None)
def _multiprocessors(index: Optional[int]) -> int:
    return torch.cuda.get_device_properties(index if index is not None else torch.cuda.current_device()
                                            ).multi_processor_count


def aligned(pointers: Sequence[int], row_strides: Sequence[int], head_dim: int) -> bool:
    """True when the aligned (128-bit access) variant is safe: every data pointer the kernel
    addresses is on a 16-byte boundary, every source row stride and the head width K (so also d)
    are multiples of 8 elements. (One OR over each list: its low bits are zero exactly when
    every entry's are.)"""
    return functools.reduce(operator.or_, row_strides, head_dim) % 8 == 0 and \
        functools.reduce(operator.or_, pointers, 0) % 16 == 0


def _pointers(*tensors: Optional[Tensor]) -> list[int]:
    return [t.data_ptr() for t in tensors if t is not None]


def _rows(source: Tensor, d: int) -> tuple[Tensor, int]:
    """(tensor, row stride) such that token i's d values start at ptr + i * row_stride.

    A (d,) null source gets row stride 0. A (B, T, d) source is used in place when its
    tokens are equally spaced with a unit last stride; otherwise a transient contiguous copy
    is made for this launch only (never saved)."""
    if source.dim() == 1:
        return source.contiguous(), 0
    if source.is_contiguous():  # the common case, one check
        return source, d
    flat = source.reshape(-1, d) if source.stride(-1) == 1 else None
    if flat is None or flat.data_ptr() != source.data_ptr() or flat.stride(1) != 1:
        flat = source.contiguous().view(-1, d)
    return flat, flat.stride(0)


def _device_table(values: list[int], device: torch.device) -> Tensor:
    """One int64 table on `device` (one host-to-device copy per launch). Built from an int64
    array (a quarter of the host time of `torch.tensor` on a list of N = 73 pointers)."""
    table = torch.frombuffer(array.array("q", values), dtype=torch.int64)
    if device.type == "cuda":  # pinned + async: no host synchronisation per call
        return table.pin_memory().to(device, non_blocking=True)
    return table


def _empty_table(device: torch.device) -> Tensor:
    """The int64 pointer table of a launch over no source (grouped routing's merge at a group's
    first site): never read, but typed as every table is, so that the kernel compiles the same."""
    return torch.zeros(1, dtype=torch.int64, device=device)


def _source_table(sources: Sequence[Tensor], d: int, extra: Sequence[int] = ()):
    """(source views, their data pointers, their row strides, device table [pointers (N,), row
    strides (N,), extra]): one host-to-device copy carries every per-source value of a launch.
    Contiguous sources (the models' case) are taken as they are, in one pass per value."""
    if all(map(Tensor.is_contiguous, sources)):
        tensors = list(sources)
        strides = [d] * len(tensors)
        if tensors[0].dim() == 1:  # the null source: broadcast over tokens
            strides[0] = 0
    else:
        views = [_rows(s, d) for s in sources]
        tensors = [v for v, _ in views]
        strides = [st for _, st in views]
    ptrs = list(map(Tensor.data_ptr, tensors))
    table = _device_table(ptrs + strides + list(extra), tensors[0].device)
    return tensors, ptrs, strides, table


def common_dtype(*tensors: Optional[Tensor]) -> Optional[torch.dtype]:
    """The dtype the given tensors (None skipped) share, or None when they differ: the dtype
    `route_backward` may cast the parameters' gradients to in one go (`param_dtype`)."""
    dtypes = {t.dtype for t in tensors if t is not None}
    return dtypes.pop() if len(dtypes) == 1 else None


def needs_mix_residual(dtype: torch.dtype) -> bool:
    """True for storage dtypes narrower than the compute dtype (bf16, fp16): rounding the saved mix
    to them loses bits that <dmix, mix> in the backward needs (fp32 and fp64 lose nothing)."""
    return compute_dtype(dtype) != dtype


def route_forward(
    sources: Sequence[Tensor],
    query: Tensor,
    norm_weight: Tensor,
    heads: int,
    eps: float,
    *,
    partial: Optional[Tensor] = None,
    alpha: Optional[Tensor] = None,
    state: Optional[tuple[Tensor, Tensor]] = None,
    out_dtype: Optional[torch.dtype] = None,
    mix_residual: Optional[Tensor] = None,
    tables: Optional[tuple[Tensor, Tensor, bool]] = None,
) -> tuple[Tensor, Optional[Tensor], Tensor, Tensor]:
    """Launch the forward kernel. `sources[0]` may be a (d,) null source; the others are (B, T, d).

    state: optional incoming online-softmax state (mix (B, T, d) normalised, in the storage dtype
    or fp32, lse (B, T, H) or (B*T, H) fp32) of sources routed earlier with the same query/norm (grouped
    routing's phase 1); the result then covers both sets, and `sources` may be empty.
    mix_residual: optional (B, T, d) contiguous tensor (the sources' dtype) that receives
    fp32 mix - the saved mix rounded to the storage dtype (`needs_mix_residual`), for the
    backward. tables: (pointers (N,), row strides (N,), whether every source is 16-byte aligned)
    of the sources as `launch.SourceTable.views` gives them (no table is built then). Returns
    (out (B, T, d) in out_dtype or the sources' dtype, mix (B, T, d) in the
    sources' dtype in delta mode (None otherwise: out is the mix), stats (N + 1, B*T, H): rows
    0..N-1 the logits, row N the lse), statistics in fp32 (fp64 for fp64 sources)."""
    n = len(sources)
    full = sources[-1] if n and sources[-1].dim() != 1 else state[0]  # a null source can only come first
    shape, dtype, device = full.shape, full.dtype, full.device
    d = shape[-1]
    bt, head_dim = full.numel() // d, d // heads
    cdt = compute_dtype(dtype)
    out = torch.empty(shape, dtype=out_dtype or dtype, device=device)
    mix = torch.empty(shape, dtype=dtype, device=device) if partial is not None else None
    stats = torch.empty((n + 1, bt, heads), dtype=cdt, device=device)  # the logits, then the lse
    if bt == 0:  # no tokens: nothing to launch (a zero-size grid is an error under the interpreter)
        return out, mix, stats
    if partial is not None:
        partial = partial.contiguous()
    if state is not None:
        state = (state[0].contiguous(), state[1].contiguous())
    others = _pointers(partial, out, mix, mix_residual, state[0] if state else None)
    if tables is not None:  # a `launch.SourceTable`'s rows: nothing to build
        pointer_rows, stride_rows, sources_aligned = tables
        is_aligned = sources_aligned and aligned(others, (), head_dim)
    else:
        tensors, ptrs, strides, table = _source_table(sources, d) if n else ([full], [], [], _empty_table(device))
        is_aligned = aligned(ptrs + others, strides, head_dim)
        pointer_rows, stride_rows = table[:n], table[n:]
    cfg = _launch_config(bt, heads, head_dim, False)
    grid = (_cdiv(bt, cfg["BLOCK_T"]),)
    _route_fwd_kernel[grid](
        pointer_rows, stride_rows, full, query.contiguous(), norm_weight.contiguous(),
        partial if partial is not None else out, alpha if alpha is not None else stats,
        state[0] if state is not None else out, state[1] if state is not None else stats,
        out, mix if mix is not None else out, mix_residual if mix_residual is not None else out, stats,
        n, bt, d, heads, head_dim, eps,
        HAS_PARTIAL=partial is not None, HAS_STATE=state is not None, HAS_RES=mix_residual is not None,
        ALIGNED=is_aligned, NUM_STAGES=NUM_STAGES, CDT=_TL_DTYPES[cdt], RNE_BF16=INTERPRET, **cfg,
    )
    return out, mix, stats


def route_forward_saved(
    sources: Sequence[Tensor],
    query: Tensor,
    norm_weight: Tensor,
    heads: int,
    eps: float,
    *,
    partial: Optional[Tensor] = None,
    alpha: Optional[Tensor] = None,
    state: Optional[tuple[Tensor, Tensor]] = None,
    residual: bool = True,
    tables: Optional[tuple[Tensor, Tensor, bool]] = None,
) -> tuple[Tensor, Optional[Tensor], Optional[Tensor], Tensor]:
    """`route_forward` for an autograd forward: (out, mix or None, mix residual or None, stats
    (N + 1, B*T, H): the logits, then the lse), out in the storage dtype of the sources (or of the
    state's mix where there is no source); with `residual` and bf16 / fp16 storage
    (`needs_mix_residual`) the mix residual is written for the backward."""
    full = sources[-1] if sources and sources[-1].dim() != 1 else state[0]
    rounding = torch.empty(full.shape, dtype=full.dtype, device=full.device) \
        if residual and needs_mix_residual(full.dtype) else None
    out, mix, stats = route_forward(sources, query, norm_weight, heads, eps, partial=partial, alpha=alpha,
                                    state=state, out_dtype=full.dtype, mix_residual=rounding, tables=tables)
    return out, mix, rounding, stats


def route_backward(
    grad_out: Tensor,
    sources: Sequence[Tensor],
    mix: Tensor,
    query: Tensor,
    norm_weight: Tensor,
    heads: int,
    eps: float,
    stats: Tensor,
    alpha: Optional[Tensor] = None,
    grads: Optional[Sequence[Tensor]] = None,
    accumulate: Optional[Sequence[bool]] = None,
    mix_residual: Optional[Tensor] = None,
    state_lse: Optional[Tensor] = None,
    state_grad: Optional[Tensor] = None,
    state_norm_grad: Optional[Tensor] = None,
    param_dtype: Optional[torch.dtype] = None,
    tables: Optional[tuple] = None,
) -> tuple[list[Tensor], Tensor, Tensor, Optional[Tensor], Optional[Tensor]]:
    """Launch the backward kernel for `route_forward`'s call with the same sources; `mix` is the
    normalised mix that call produced (its output in replacement mode, its mix in delta mode),
    `stats` its (N + 1, B*T, H) statistics (the logits, then the lse), `mix_residual` what its
    rounding lost, when that call wrote it.

    state_lse: the lse (B, T, H) or (B*T, H), contiguous, of the incoming state of that call
    (grouped routing's merge; `sources` may then be empty). With it the kernel writes, per token
    and head, w0 = exp(state_lse - lse) (the state's share of the final softmax): state_norm_grad
    (state_lse's shape) fp32 receives -w0 <dmix, mix> and state_grad (B, T, d), if given, w0 dmix
    (`triton_merge`).

    grads: optional contiguous (B, T, d) buffers, one per (B, T, d) source, that receive the
    source gradients (new ones otherwise); accumulate: per buffer, True to add this call's
    gradient to what the buffer holds (read-modify-write in the kernel, one rounding to the
    storage dtype), False to overwrite it.

    param_dtype: the dtype of dq, dg and dnull (default the compute dtype), cast once; pass it
    only when the query, norm weight and null source share it (`common_dtype`).

    tables: (pointers, row strides, gradient pointers, accumulate flags or None, aligned) of the
    sources and their gradient buffers as `launch.SourceTable.backward_rows` gives them (the
    buffers already made): no table is built; grads / accumulate are then only returned / not read.

    Returns (gradients of the (B, T, d) sources in their dtype, dq, dg, dalpha (1,) or None,
    dnull (d,) or None); dalpha is in the compute dtype. All are reduced over the per-program
    partial sums in a fixed order (bitwise repeatable)."""
    n = len(sources)
    has_null = n > 0 and sources[0].dim() == 1
    full = sources[-1] if n and sources[-1].dim() != 1 else grad_out  # a null source can only come first
    d = full.shape[-1]
    bt, head_dim = full.numel() // d, d // heads
    cdt = stats.dtype
    device = full.device
    if grads is None and tables is None:
        grads = [torch.empty_like(full, memory_format=torch.contiguous_format) for _ in sources[int(has_null):]]
    has_accum = (tables[3] is not None) if tables is not None else accumulate is not None and any(accumulate)
    if bt == 0:  # no tokens: empty source gradients, zero parameter gradients
        dq, dg = (torch.zeros(d, dtype=param_dtype or cdt, device=device) for _ in range(2))
        dalpha = torch.zeros(1, dtype=cdt, device=device) if alpha is not None else None
        return grads, dq, dg, dalpha, dq.new_zeros(d) if has_null else None
    grad_out, mix = grad_out.contiguous(), mix.contiguous()
    others = _pointers(grad_out, mix, mix_residual, state_grad)
    if tables is not None:  # a `launch.SourceTable`'s rows: nothing to build
        pointer_rows, stride_rows, grad_rows, accum_rows, sources_aligned = tables
        is_aligned = sources_aligned and aligned(others, (), head_dim)
        accum_rows = accum_rows if has_accum else pointer_rows
    else:
        dptrs = list(map(Tensor.data_ptr, grads))
        extra = [0] + dptrs if has_null else dptrs
        if has_accum:
            extra += [0] + list(map(int, accumulate)) if has_null else list(map(int, accumulate))
        _, ptrs, strides, table = _source_table(sources, d, extra=extra) if n else \
            ([grad_out], [], [], _empty_table(device))
        is_aligned = aligned(ptrs + dptrs + others, strides, head_dim)
        pointer_rows, stride_rows, grad_rows = table[:n], table[n:2 * n], table[2 * n:3 * n]
        accum_rows = table[3 * n:] if has_accum else table
    cfg = _launch_config(bt, heads, head_dim, True)
    programs = reduce_programs(_cdiv(bt, cfg["BLOCK_T"]), device)
    parts = torch.empty((2 + has_null, programs, d), dtype=cdt, device=device)
    dalpha_part = torch.empty((programs,), dtype=cdt, device=device) if alpha is not None else parts
    # the table's parts as separate arguments: pointers computed in the kernel would hold registers
    _route_bwd_kernel[(programs,)](
        pointer_rows, stride_rows, grad_rows, accum_rows, full if n else grad_out,
        query.contiguous(), norm_weight.contiguous(),
        alpha if alpha is not None else stats, grad_out, mix, mix_residual if mix_residual is not None else mix,
        stats, parts, dalpha_part,
        state_lse if state_lse is not None else stats, state_grad if state_grad is not None else grad_out,
        state_norm_grad if state_norm_grad is not None else stats,
        n, bt, d, heads, head_dim, eps,
        HAS_ALPHA=alpha is not None, HAS_NULL=has_null, HAS_ACCUM=has_accum, HAS_RES=mix_residual is not None,
        HAS_STATE=state_lse is not None, WRITE_DSTATE=state_grad is not None, ALIGNED=is_aligned,
        NUM_STAGES=NUM_STAGES, CDT=_TL_DTYPES[cdt], RNE_BF16=INTERPRET, **cfg,
    )
    dalpha = dalpha_part.sum(0, keepdim=True) if alpha is not None else None
    sums = parts.sum(1)
    if param_dtype is not None:
        sums = sums.to(param_dtype)
    dq, dg, *dnull = sums.unbind(0)
    return grads, dq, dg, dalpha, dnull[0] if has_null else None
