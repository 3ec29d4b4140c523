"""The routing op's contract: argument checks, compute dtype and null-source handling; and which
shapes the fused kernels take and how they lay them out (`fits_tile`, `grouped_layout`), torch-only
so that planning a GPU job (the dry run) needs no triton.

Every routing path (the eager reference, `torch.compile`, the fused kernels) obeys this one
contract; the dispatcher (`dispatch.route`) checks a call's arguments here once and then runs
whichever implementation `dispatch.backend` picked. Imports torch only.
"""
from __future__ import annotations

import numbers
from typing import Optional, Sequence

import torch
from torch import Tensor


_COMPUTE_DTYPES = {dt: torch.promote_types(dt, torch.float32)
                   for dt in (torch.bfloat16, torch.float16, torch.float32, torch.float64)}


# Largest [HB, KB] tile of one token (elements) the fused kernels take; larger ones run the eager
# reference (MHAR_SPEC section 4), also under the interpreter so that CPU tests see the GPU's choice.
MAX_TILE = 8192


def _next_pow2(n: int) -> int:
    """Smallest power of two >= n (n >= 1); plain Python: `triton.next_power_of_2` is a
    constexpr function whose call costs microseconds of host time per launch."""
    return 1 << (n - 1).bit_length()


def fits_tile(heads: int, head_dim: int) -> bool:
    """True when one token's [next_pow2(H), next_pow2(K)] tile is at most MAX_TILE elements."""
    return _next_pow2(heads) * _next_pow2(head_dim) <= MAX_TILE


# Grouped phase 1's GPU layout (`triton_grouped.launch_config`). A program's source tile
# [BLOCK_T, HB, KB] gives each thread ROW_ELEMENTS contiguous elements of a source row (in the
# aligned variant one 16-byte cp.async of bf16), so the warps follow the tile: one token per program
# (BLOCK_T > 1 only where one token is less than one warp's share), at most MAX_WARPS warps (beyond
# that a thread holds more of the row). SB sites make the [BLOCK_T, SB, HB, KB] fp32 tile SB times a
# thread's source elements: at most TILE_PER_THREAD (2 sites of 8 elements) keeps both kernels
# within 168 registers per thread.
ROW_ELEMENTS = 8
TILE_PER_THREAD = 16
MAX_WARPS = 8


def grouped_layout(bt: int, group: int, heads: int, head_dim: int, site_block: Optional[int] = None) -> dict:
    """{'BLOCK_T', 'SB', 'HB', 'KB', 'num_warps'} of grouped phase 1 on a GPU for B*T tokens and a
    group of `group` sites (the comment above; site_block overrides SB). A new dict."""
    hb, kb = _next_pow2(heads), _next_pow2(head_dim)
    token = hb * kb  # one token's [HB, KB] tile
    warp_share = 32 * ROW_ELEMENTS
    block_t = min(_next_pow2(max(bt, 1)), max(1, warp_share // token))
    num_warps = max(1, min(MAX_WARPS, block_t * token // warp_share))
    per_thread = max(1, block_t * token // (32 * num_warps))  # source elements per thread
    sb = site_block or min(_next_pow2(group), max(1, TILE_PER_THREAD // per_thread))
    return dict(BLOCK_T=block_t, SB=sb, HB=hb, KB=kb, num_warps=num_warps)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of the statistics, softmax and accumulation: float32 for 16/32-bit storage,
    float64 stays float64 (MHAR_SPEC section 4). The common storage dtypes are looked up (this
    runs at every routing launch)."""
    return _COMPUTE_DTYPES.get(dtype) or torch.promote_types(dtype, torch.float32)


def split_null_source(sources: Sequence[Tensor]) -> tuple[Optional[Tensor], list[Tensor]]:
    """(null source or None, the (B, T, d) sources): a leading (d,) tensor is the null source."""
    sources = list(sources)
    if sources and sources[0].dim() == 1:
        return sources[0], sources[1:]
    return None, sources


def with_null_source(null_source: Optional[Tensor], sources: list[Tensor]) -> list[Tensor]:
    """The null source, cast to the sources' dtype (as the fused kernels load it), then the sources."""
    return sources if null_source is None else [null_source.to(sources[0].dtype), *sources]


def check_route_args(
    sources: Sequence[Tensor],
    query: Tensor,
    norm_weight: Tensor,
    heads: int,
    partial: Optional[Tensor] = None,
    alpha: Optional[Tensor] = None,
    null_source: Optional[Tensor] = None,
) -> int:
    """Validate the arguments of one routing call (MHAR_SPEC sections 2 and 1.4).

    Args:
        sources: the N >= 1 (B, T, d) sources (any matching leading dims), null source excluded.
        query, norm_weight: pseudo-query and key RMSNorm weight, (d,) each.
        heads: routing heads H; d % H == 0.
        partial, alpha: delta mode, residual stream like the sources and gate (1,); both or neither.
        null_source: learnable (d,) source, or None.

    Returns:
        heads as a Python int (numpy integers are accepted).

    Raises:
        ValueError naming the bad argument: no sources; non-floating or mismatched sources (shape,
        dtype, device); sources with d = 0; heads not a positive int (bools rejected); d % H != 0 (naming d and H);
        query / norm_weight / null_source not (d,); partial not like the sources; alpha not (1,);
        only one of partial / alpha; a tensor on another device than the sources (on CUDA the
        kernels would read an illegal address).
    """
    if len(sources) == 0:
        raise ValueError("depth routing needs at least one (B, T, d) source")
    full = sources[0]
    # One cheap pass (this runs once per routing call, N up to 73): the same shape as a source
    # of >= 2 dims, the same dtype object and the same device (index; off CUDA, where the index
    # is -1, whether it is the CPU). Only a failing call looks for the culprits.
    shape, dtype, index, on_cpu = full.shape, full.dtype, full.get_device(), full.is_cpu
    mismatched = []
    if full.dim() < 2:
        mismatched = [0]
    elif not all(s.shape == shape and s.dtype is dtype and s.get_device() == index and s.is_cpu is on_cpu
                 for s in sources):
        mismatched = [i for i, s in enumerate(sources)
                      if s.shape != shape or s.dtype is not dtype or s.get_device() != index
                      or s.device.type != full.device.type]
    for i in mismatched:
        s = sources[i]
        if s.dim() < 2:
            raise ValueError(
                f"source {i} has shape {tuple(s.shape)}; sources must be (B, T, d) tensors: a (d,) null source "
                "goes first in route()/route_reference() or as null_source= in mhar_kernels.route()"
            )
        raise ValueError(f"source {i} is {tuple(s.shape)} {s.dtype} on {s.device}; every source must match "
                         f"source 0: {tuple(full.shape)} {full.dtype} on {full.device}")
    if not full.is_floating_point():
        raise ValueError(f"sources must be floating point, got {full.dtype}")
    d = full.shape[-1]
    if d == 0:
        raise ValueError(f"sources {tuple(full.shape)} have no features (d = 0): depth routing needs d >= 1")
    if type(heads) is not int and (isinstance(heads, bool) or not isinstance(heads, numbers.Integral)) \
            or heads <= 0:  # (a plain int first: the ABC check costs a Python call per routing call)
        raise ValueError(f"routing heads must be a positive int, got {heads!r} ({type(heads).__name__})")
    if d % heads:
        raise ValueError(f"dim d={d} is not divisible by routing heads H={heads}: heads are contiguous d/H slices")
    if (partial is None) != (alpha is None):
        raise ValueError("delta routing needs both `partial` and `alpha` (or neither for replacement routing)")
    for name, tensor, size in (("query", query, d), ("norm_weight", norm_weight, d), ("alpha", alpha, 1),
                               ("null_source", null_source, d)):
        if tensor is None:
            continue
        if tensor.dim() != 1 or tensor.shape[0] != size:
            why = " (FSDP rejects 0-dim parameters)" if name == "alpha" else ""
            raise ValueError(f"{name} must have shape {(size,)}{why}, got {tuple(tensor.shape)}")
        if not tensor.is_floating_point() or tensor.get_device() != index or tensor.is_cpu is not on_cpu:
            raise ValueError(f"{name} must be a floating-point tensor on the sources' device {full.device}, "
                             f"got {tensor.dtype} on {tensor.device}")
    if partial is not None and (partial.shape != shape or partial.dtype is not dtype or partial.get_device() != index
                                or partial.is_cpu is not on_cpu):
        raise ValueError(f"partial must match the sources: {tuple(full.shape)} {full.dtype} on {full.device}, "
                         f"got {tuple(partial.shape)} {partial.dtype} on {partial.device}")
    return int(heads)
