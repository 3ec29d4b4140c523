"""The launch side of the fused per-call routing kernels (`routing_kernels`, the `@triton.jit`
code; MHAR_SPEC sections 2 and 4): launch configurations (cached per shape), the alignment rule
that picks the aligned variant, and the launch wrappers `route_forward` / `route_backward` (the
fused merge, `triton_merge`, launches the same kernels with the phase-1 state).

A call reads its sources as rows of one depth buffer (`depth_buffer`): the kernels take the
buffer, the call's int32 slot vector and B*T*d (the row stride), so a launch's arguments are
tensors the host never writes to and integers that are the same at every step. A (d,) null
source is a separate argument, source 0 (broadcast over tokens). The backward writes or adds
each source's gradient into the same row of the buffer's gradient buffer; its dq, dg, dalpha
and dnull come as (programs, d) partial sums (`reduce_programs`) that the host reduces in a
fixed order.

The kernels are looked up in this module's namespace at every launch (`_route_fwd_kernel`,
`_route_bwd_kernel`), so that the benchmarks can stub them out (`bench/routing_harness.py`).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import triton.language as tl
from torch import Tensor

from .contract import MAX_TILE, _next_pow2, compute_dtype, fits_tile  # noqa: F401  (re-exported)
from .routing_kernels import (  # noqa: F401  (the device helpers, also for triton_grouped and bench/compile_report.py)
    INTERPRET, _inv_rms_and_key, _load_null, _load_source, _route_bwd_kernel, _route_fwd_kernel, _slot_base,
    _to_storage,
)
from . import grouped_kernels  # noqa: F401, E402  (decorated now: every kernel under the one INTERPRET above)


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


def aligned(head_dim: int, *tensors: Optional[Tensor]) -> bool:
    """True when the aligned (128-bit access) variant is safe: the head width K (so also d) is a
    multiple of 8 elements and every tensor the kernel addresses (None skipped) starts 16 bytes
    into its storage's allocation or a multiple of that (torch's allocators align storages to 64
    bytes and more). Read from storage offsets: no data pointer is read on the host."""
    return head_dim % 8 == 0 and all(t.storage_offset() * t.element_size() % 16 == 0 for t in tensors
                                     if t is not None)


def _dummy_slots(device: torch.device) -> Tensor:
    """The slot vector of a launch over no depth-buffer row (grouped routing's merge at a group's
    first site): never read, but typed as every slot vector is, so that the kernel compiles the same."""
    return torch.zeros(1, dtype=torch.int32, device=device)


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
    values: Optional[Tensor],
    slots: Optional[Tensor],
    query: Tensor,
    norm_weight: Tensor,
    heads: int,
    eps: float,
    *,
    null: Optional[Tensor] = None,
    partial: Optional[Tensor] = None,
    alpha: Optional[Tensor] = None,
    state: Optional[tuple[Tensor, Tensor]] = None,
    out_dtype: Optional[torch.dtype] = None,
    mix_residual: Optional[Tensor] = None,
) -> tuple[Tensor, Optional[Tensor], Tensor]:
    """Launch the forward kernel over the depth-buffer rows `slots` of `values`.

    values: the depth buffer (capacity, B, T, d), contiguous (`depth_buffer.DepthBuffer.values`);
    slots: int32 (n,) on its device, the rows the call reads in order (None or n = 0: no row).
    null: the (d,) null source in the buffer's dtype, source 0 before the rows (broadcast over
    tokens). state: optional incoming online-softmax state (mix (B, T, d) normalised, in the
    storage dtype or fp32, lse (B, T, H) or (B*T, H) fp32) of sources routed earlier with the same
    query/norm (grouped routing's merge); the result then covers both, and there may be no row.
    mix_residual: optional (B, T, d) contiguous tensor (the sources' dtype) that receives fp32 mix
    - the saved mix rounded to the storage dtype (`needs_mix_residual`), for the backward.
    Returns (out (B, T, d) in out_dtype or the sources' dtype, mix (B, T, d) in the sources' dtype
    in delta mode (None otherwise: out is the mix), stats (null + n + 1, B*T, H): the logits rows,
    then the lse row), statistics in fp32 (fp64 for fp64 sources)."""
    n = 0 if slots is None else slots.shape[0]
    full = values[0] if n else state[0]
    shape, dtype, device = full.shape, (values if n else full).dtype, full.device
    d = shape[-1]
    bt, head_dim = full.numel() // d, d // heads
    cdt = compute_dtype(dtype)
    out = torch.empty(shape, dtype=out_dtype or dtype, device=device)
    mix = torch.empty(shape, dtype=dtype, device=device) if partial is not None else None
    stats = torch.empty((n + (null is not None) + 1, bt, heads), dtype=cdt, device=device)
    if bt == 0:  # no tokens: nothing to launch (a zero-size grid is an error under the interpreter)
        return out, mix, stats
    if partial is not None:
        partial = partial.contiguous()
    if state is not None:
        state = (state[0].contiguous(), state[1].contiguous())
    is_aligned = aligned(head_dim, values if n else None, partial, out, mix, mix_residual,
                         state[0] if state else None)
    cfg = _launch_config(bt, heads, head_dim, False)
    grid = (_cdiv(bt, cfg["BLOCK_T"]),)
    _route_fwd_kernel[grid](
        values if n else out, slots if n else _dummy_slots(device), null if null is not None else out,
        query.contiguous(), norm_weight.contiguous(),
        partial if partial is not None else out, alpha if alpha is not None else stats,
        state[0] if state is not None else out, state[1] if state is not None else stats,
        out, mix if mix is not None else out, mix_residual if mix_residual is not None else out, stats,
        n, bt, d, heads, head_dim, eps,
        HAS_NULL=null is not None, HAS_PARTIAL=partial is not None, HAS_STATE=state is not None,
        HAS_RES=mix_residual is not None, ALIGNED=is_aligned, NUM_STAGES=NUM_STAGES, CDT=_TL_DTYPES[cdt],
        RNE_BF16=INTERPRET, **cfg,
    )
    return out, mix, stats


def route_forward_saved(
    values: Optional[Tensor],
    slots: Optional[Tensor],
    query: Tensor,
    norm_weight: Tensor,
    heads: int,
    eps: float,
    *,
    null: Optional[Tensor] = None,
    partial: Optional[Tensor] = None,
    alpha: Optional[Tensor] = None,
    state: Optional[tuple[Tensor, Tensor]] = None,
    residual: bool = True,
) -> tuple[Tensor, Optional[Tensor], Optional[Tensor], Tensor]:
    """`route_forward` for an autograd forward: (out, mix or None, mix residual or None, stats),
    out in the storage dtype of the sources (or of the state's mix where there is no row); with
    `residual` and bf16 / fp16 storage (`needs_mix_residual`) the mix residual is written for the
    backward."""
    n = 0 if slots is None else slots.shape[0]
    like = values[0] if n else state[0]
    rounding = torch.empty(like.shape, dtype=like.dtype, device=like.device) \
        if residual and needs_mix_residual(like.dtype) else None
    out, mix, stats = route_forward(values, slots, query, norm_weight, heads, eps, null=null, partial=partial,
                                    alpha=alpha, state=state, out_dtype=like.dtype, mix_residual=rounding)
    return out, mix, rounding, stats


def route_backward(
    grad_out: Tensor,
    values: Optional[Tensor],
    slots: Optional[Tensor],
    mix: Tensor,
    query: Tensor,
    norm_weight: Tensor,
    heads: int,
    eps: float,
    stats: Tensor,
    alpha: Optional[Tensor] = None,
    *,
    null: Optional[Tensor] = None,
    grads: Optional[Tensor] = None,
    accumulate: Optional[Tensor] = None,
    mix_residual: Optional[Tensor] = None,
    state_lse: Optional[Tensor] = None,
    state_grad: Optional[Tensor] = None,
    state_norm_grad: Optional[Tensor] = None,
    param_dtype: Optional[torch.dtype] = None,
) -> tuple[Tensor, Tensor, Optional[Tensor], Optional[Tensor]]:
    """Launch the backward kernel for `route_forward`'s call over the same rows; `mix` is the
    normalised mix that call produced (its output in replacement mode, its mix in delta mode),
    `stats` its statistics (the logits, then the lse), `mix_residual` what its rounding lost, when
    that call wrote it.

    grads: the depth buffer's gradient buffer (values' shape): the gradient of the source in row
    slots[i] goes to grads[slots[i]], written, or added to what the row holds where
    accumulate[i] != 0 (accumulate: int32 (n,) on the device, None: every row written; one
    rounding to the storage dtype per addition).

    state_lse: the lse (B, T, H) or (B*T, H), contiguous, of the incoming state of that call
    (grouped routing's merge; there may be no row). With it the kernel writes, per token and
    head, w0 = exp(state_lse - lse) (the state's share of the final softmax): state_norm_grad
    (state_lse's shape) fp32 receives -w0 <dmix, mix> and state_grad (B, T, d), if given, w0 dmix
    (`triton_merge`).

    param_dtype: the dtype of dq, dg and dnull (default the compute dtype), cast once; pass it
    only when the query, norm weight and null source share it (`common_dtype`).

    Returns (dq, dg, dalpha (1,) or None, dnull (d,) or None); dalpha is in the compute dtype. All
    are reduced over the per-program partial sums in a fixed order (bitwise repeatable)."""
    n = 0 if slots is None else slots.shape[0]
    has_null = null is not None
    d = grad_out.shape[-1]
    bt, head_dim = grad_out.numel() // d, d // heads
    cdt = stats.dtype
    device = grad_out.device
    if bt == 0:  # no tokens: zero parameter gradients
        dq, dg = (torch.zeros(d, dtype=param_dtype or cdt, device=device) for _ in range(2))
        dalpha = torch.zeros(1, dtype=cdt, device=device) if alpha is not None else None
        return dq, dg, dalpha, dq.new_zeros(d) if has_null else None
    grad_out, mix = grad_out.contiguous(), mix.contiguous()
    is_aligned = aligned(head_dim, values if n else None, grads if n else None, grad_out, mix, mix_residual,
                         state_grad)
    cfg = _launch_config(bt, heads, head_dim, True)
    programs = reduce_programs(_cdiv(bt, cfg["BLOCK_T"]), device)
    parts = torch.empty((2 + has_null, programs, d), dtype=cdt, device=device)
    dalpha_part = torch.empty((programs,), dtype=cdt, device=device) if alpha is not None else parts
    slots = slots if n else _dummy_slots(device)
    _route_bwd_kernel[(programs,)](
        values if n else grad_out, slots, grads if n else grad_out, accumulate if accumulate is not None else slots,
        null if has_null else grad_out, query.contiguous(), norm_weight.contiguous(),
        alpha if alpha is not None else stats, grad_out, mix, mix_residual if mix_residual is not None else mix,
        stats, parts, dalpha_part,
        state_lse if state_lse is not None else stats, state_grad if state_grad is not None else grad_out,
        state_norm_grad if state_norm_grad is not None else stats,
        n, bt, d, heads, head_dim, eps,
        HAS_ALPHA=alpha is not None, HAS_NULL=has_null, HAS_ACCUM=accumulate is not None and n > 0,
        HAS_RES=mix_residual is not None, HAS_STATE=state_lse is not None, WRITE_DSTATE=state_grad is not None,
        ALIGNED=is_aligned, NUM_STAGES=NUM_STAGES, CDT=_TL_DTYPES[cdt], RNE_BF16=INTERPRET, **cfg,
    )
    dalpha = dalpha_part.sum(0, keepdim=True) if alpha is not None else None
    sums = parts.sum(1)
    if param_dtype is not None:
        sums = sums.to(param_dtype)
    dq, dg, *dnull = sums.unbind(0)
    return dq, dg, dalpha, dnull[0] if has_null else None
