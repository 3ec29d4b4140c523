"""The dispatcher: which implementation computes a routing call, decided by one rule (`backend`).

Every caller (the models' Router, the dry run's memory model, the benchmarks, and through the
model the analysis) asks `backend` and calls the functions below, never an implementation
directly. Implementations (MHAR_SPEC sections 2 and 4, docs/DESIGN.md "Grouped routing"):

| backend   | per-call routing (`route`)                 | grouped phase 1 (`phase1`)        | merge (`merge`)           |
|-----------|--------------------------------------------|-----------------------------------|---------------------------|
| "eager"   | `reference.route_reference`                | `grouped_reference.phase1`        | `grouped_reference.merge` |
| "compile" | `reference.route_compiled`                 | `grouped_reference.phase1`        | `grouped_reference.merge` |
| "triton"  | `op.route_unchecked` (fused)               | `triton_grouped.route_phase1`     | `triton_merge.merge`      |

On "triton", callers that keep one depth buffer per micro-batch (`depth_buffer`; the models'
Router outside torch.compile) call `route_rows`, `phase1_rows` and `merge_rows` instead, which
read the buffer's rows; `route` / `phase1` / `merge` take lists of sources.

The rule: the kernel names "eager" and "compile" are taken as they are; "triton" runs the fused
kernels where they can run (`op.can_run`: triton installed, CUDA or CPU under
TRITON_INTERPRET=1, one token's tile within the register budget), else eager; "auto" is
"triton" on CUDA and "eager" elsewhere. The Triton modules are imported on first use, so
importing this module (torch only) does not run any @triton.jit decorator.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from . import contract, grouped_reference, reference

def _module(name: str):
    """The Triton-side module `name`, imported on first use by plain imports (so that
    tests/test_layers.py sees the edges; a repeated import is a lookup in sys.modules, about half a
    microsecond, and torch.compile traces it, which it would not a cached wrapper)."""
    if name == "op":
        from . import op as module
    elif name == "triton_grouped":
        from . import triton_grouped as module
    elif name == "triton_merge":
        from . import triton_merge as module
    else:
        raise KeyError(name)
    return module


KERNELS = ("eager", "compile", "triton", "auto")  # values of the models' routing_kernel field
BACKENDS = ("eager", "compile", "triton")


def _named(kernel: str) -> str | None:
    """The implementation `kernel` names ("eager", "compile") or None where the device decides
    ("triton", "auto"). Raises ValueError for an unknown kernel name, listing the valid ones."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown routing kernel {kernel!r}; choose one of {KERNELS}")
    return kernel if kernel in ("eager", "compile") else None


def backend(kernel: str, device: torch.device | str, dim: int, heads: int) -> str:
    """The implementation that computes routing of (..., dim) sources on `device` with `heads`
    routing heads for the configured `kernel` (one of KERNELS): "eager", "compile" or "triton"
    (module docstring). `device` may be a string ("cuda", "cpu").

    Raises:
        ValueError: an unknown kernel name, listing the valid ones.
    """
    named = _named(kernel)
    if named is not None:
        return named
    if isinstance(device, str):
        device = torch.device(device)
    if kernel == "auto" and device.type != "cuda":
        return "eager"
    return "triton" if _module("op").can_run(device, dim, heads) else "eager"


def fused_unavailable(device: torch.device | str, dim: int, heads: int) -> str | None:
    """Why the fused kernels cannot route (..., dim) sources on `device` with `heads` heads, in
    words (`op.why_not`: triton missing, no CUDA and no TRITON_INTERPRET=1, or one token's tile over
    the register budget); None where they can."""
    return _module("op").why_not(torch.device(device) if isinstance(device, str) else device, dim, heads)


def planned_backend(kernel: str, device_type: str, dim: int, heads: int) -> str:
    """The implementation `backend` picks on a device of `device_type` ("cuda" or "cpu") of a
    machine set up as the project installs it, whatever this machine has: for planning a job
    elsewhere (the dry run). On "cuda" the rule assumes triton is installed (CUDA builds of torch
    bring it), so "auto" and "triton" plan the fused kernels where one token's tile fits the
    register budget (`contract.fits_tile`) and eager beyond it; on "cpu" they plan eager (the fused
    kernels run on CPU only under the TRITON_INTERPRET=1 test interpreter, not a way to train).

    Raises:
        ValueError: an unknown kernel name, listing the valid ones.
    """
    named = _named(kernel)
    if named is not None:
        return named
    if device_type != "cuda":
        return "eager"
    return "triton" if contract.fits_tile(heads, dim // heads) else "eager"


def route(
    sources: Sequence[Tensor],
    query: Tensor,
    norm_weight: Tensor,
    heads: int,
    eps: float = 1e-6,
    kernel: str = "eager",
    *,
    partial: Tensor | None = None,
    alpha: Tensor | None = None,
    permutation: Tensor | None = None,
) -> Tensor:
    """Depth routing over `sources` by the implementation `backend(kernel, ...)` picks.

    sources: N tensors (B, T, d) of one dtype; a leading (d,) tensor is the null source.
    query, norm_weight: (d,). Replacement mode returns the mix (B, T, d). Delta mode
    (MHAR_SPEC section 1.4) passes the residual `partial` (B, T, d, the sources' dtype) and the
    gate `alpha` (1,) and returns partial + alpha * mix; with alpha = 0 the result equals
    `partial` bit for bit. `permutation` (the permuted head layout, `reference.route_reference`)
    runs on the eager backend only. The arguments are checked once per call.

    Raises:
        ValueError: unknown kernel, a permutation with a kernel other than "eager", or bad
            arguments as `contract.check_route_args`.
    """
    null_source, full = contract.split_null_source(sources)
    if kernel not in KERNELS:
        raise ValueError(f"unknown routing kernel {kernel!r}; choose one of {KERNELS}")
    heads = contract.check_route_args(full, query, norm_weight, heads, partial, alpha, null_source)
    if permutation is not None and kernel != "eager":
        raise ValueError(f"the permuted head layout runs on the eager path only, not routing_kernel={kernel!r}; "
                         "set routing_kernel='eager'")
    chosen = backend(kernel, full[0].device, full[0].shape[-1], heads)
    if chosen == "triton":
        return _module("op").route_unchecked(full, query, norm_weight, heads, eps, partial=partial, alpha=alpha,
                                             null_source=null_source)
    sources = contract.with_null_source(null_source, full)
    if chosen == "compile":
        mix = reference.route_compiled(sources, query, norm_weight, heads, eps)
    else:
        mix, _ = reference.route_checked(sources, query, norm_weight, heads, eps, permutation)
    if partial is None:
        return mix
    return partial + alpha.to(mix.dtype) * mix


def route_rows(buffer, reads, token: Tensor | None, query: Tensor, norm_weight: Tensor, heads: int, eps: float, *,
               partial: Tensor | None = None, alpha: Tensor | None = None,
               null_source: Tensor | None = None) -> Tensor:
    """Per-call routing (as `route`) over the rows `reads` of a depth buffer
    (`depth_buffer.DepthBuffer`, `depth_buffer.Reads`) after the write that made `token`: the
    fused kernels' path for callers that keep one buffer per micro-batch (the models' Router, where
    `backend` is "triton" outside torch.compile). null_source: the (d,) null source, source 0, or
    None. The caller checked the arguments (the buffer's rows share one shape, dtype and device)."""
    return _module("op").route_buffer(buffer, reads, token, query, norm_weight, heads, eps, partial=partial,
                                      alpha=alpha, null_source=null_source)


def phase1_rows(buffer, reads, token: Tensor | None, queries: Tensor, norm_weights: Tensor, site_reads: tuple,
                heads: int, eps: float, null_source: Tensor | None = None) -> tuple:
    """Phase 1 (as `phase1`) over the rows `reads` of a depth buffer after the write that made
    `token`, on the fused kernels; null_source: the (d,) null source (source 0 of `site_reads`) or
    None. Returns (mix_1..g (B, T, d) in the buffer's dtype, norm_1..g, lse (g, B, T, H), the
    group's `triton_grouped.MixGradients`, which its merges (`merge_rows`) write their mix
    gradients into)."""
    grouped = _module("triton_grouped")
    given = grouped.MixGradients()
    return (*grouped.phase1_buffer(buffer, reads, token, queries, norm_weights, site_reads, heads, eps, null_source,
                                   given), given)


def merge_rows(mix: Tensor, norm: Tensor, lse: Tensor, query: Tensor, norm_weight: Tensor, heads: int, eps: float,
               buffer, reads, token: Tensor | None, given: tuple | None, *, partial: Tensor | None = None,
               alpha: Tensor | None = None) -> Tensor:
    """The merge (as `merge`) of a grouped site whose in-group sources are the rows `reads` of a
    depth buffer (None: it reads none) after the write that made `token`, on the fused kernels;
    given: (the group's `MixGradients` from `phase1_rows`, the site's position, the group size)."""
    return _module("triton_merge").merge_buffer(mix, norm, lse, query, norm_weight, heads, eps, buffer, reads, token,
                                                partial=partial, alpha=alpha, given=given)


def phase1(queries: Tensor, norm_weights: Tensor, reads: tuple, heads: int, eps: float, kernel: str,
           *sources: Tensor) -> tuple:
    """Phase 1 of one grouped-routing group (`grouped_reference.phase1`'s contract: (g, d) rows,
    per site one bool per source, sources with a leading (d,) null source cast to their dtype;
    returns (mix_1..g, norm_1..g, lse)) by the implementation `backend` picks: the fused
    `triton_grouped.route_phase1` for "triton" (an opaque custom op inside torch.compile; its
    mixes are in the sources' dtype), else the eager reference (mixes in the compute dtype).
    The sources and the first site's rows are checked once per call, as `route` checks them.

    Raises:
        ValueError: no (B, T, d) source, or bad arguments as `contract.check_route_args`."""
    null_source, shared = contract.split_null_source(sources)
    heads = contract.check_route_args(shared, queries[0], norm_weights[0], heads, null_source=null_source)
    full = sources[-1]
    if backend(kernel, full.device, full.shape[-1], heads) == "triton":
        return _module("triton_grouped").route_phase1(queries, norm_weights, reads, heads, float(eps), *sources)
    return grouped_reference.phase1(queries, norm_weights, reads, heads, eps, *sources)


def merge(mix: Tensor, norm: Tensor, lse: Tensor, query: Tensor, norm_weight: Tensor, heads: int, eps: float,
          dtype: torch.dtype, kernel: str, *late: Tensor, partial: Tensor | None = None,
          alpha: Tensor | None = None) -> Tensor:
    """Phase 2 at one grouped site (`grouped_reference.merge`'s contract: the phase-1 state mix
    (B, T, d), norm and lse (B, T, H) merged with the in-group sources `late`, each (B, T, d) in
    `dtype`) by the implementation `backend` picks: the fused `triton_merge.merge` for "triton"
    outside torch.compile, else the eager merge. Delta mode passes `partial` (B, T, d) and
    `alpha` (1,) and gets partial + alpha * mix (MHAR_SPEC section 1.4). Returns (B, T, d) in
    `dtype`. The in-group sources are checked once per call (`route`'s rule) against the query and
    norm weight. Raises ValueError for bad arguments as `contract.check_route_args`."""
    if late:
        heads = contract.check_route_args(list(late), query, norm_weight, heads)
    if (backend(kernel, mix.device, mix.shape[-1], heads) == "triton" and not torch.compiler.is_compiling()
            and mix.dtype == dtype):
        return _module("triton_merge").merge(mix, norm, lse, query, norm_weight, heads, eps, *late, partial=partial,
                                             alpha=alpha)
    out = grouped_reference.merge(mix, norm, lse, query, norm_weight, heads, eps, dtype, *late)
    return out if partial is None else partial + alpha.to(out.dtype) * out
