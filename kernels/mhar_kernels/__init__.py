"""Depth routing for AttnRes / MHAR: every implementation and the one dispatcher (imported as
`mhar_kernels`).

A leaf package: imports torch and triton, nothing of the models. Contents:

- `contract`: the op's argument checks, compute dtype and null-source handling (torch only).
- `reference`: the readable eager reference (`route_reference`, with `return_weights` for
  analysis; `routing_logits`; `route_stacked`, the torch.compile body), the tests' oracle.
- `grouped_reference`: grouped routing's eager phase 1 and merge.
- `dispatch`: `backend(kernel, device, dim, heads)`, the ONE rule that picks an implementation,
  and `route` / `phase1` / `merge` (lists of sources) and `route_rows` / `phase1_rows` /
  `merge_rows` (rows of a depth buffer), which every caller uses.
- `depth_buffer`: one micro-batch's sources as rows of one tensor, the slot writes and their
  token chain, and the per-call `Reads` (torch only).
- `depth_mix`: weighted sums of depth-buffer rows with the buffer's backward protocol, the depth
  mixes of DenseFormer and MUDDFormer (torch only).
- `route(sources, query, norm_weight, heads, eps=1e-6, *, partial=None, alpha=None,
  null_source=None)`: the fused kernels as the registered custom op `mhar::depth_route` with
  autograd (`op.py`); `can_run(device, dim, heads)` says where it runs (CUDA; CPU under
  TRITON_INTERPRET=1).
- `route_phase1(queries, norm_weights, reads, heads, eps, *sources)`: the fused phase 1 of a
  grouped routing group (forward and backward, `triton_grouped.py`); `triton_merge.merge`, the
  fused merge (phase 2) of a grouped site on the per-call kernels.
- `routing_kernels`, `grouped_kernels`: the kernels' device code (`@triton.jit` only);
  `triton_routing` and `triton_grouped` are their launch side (configurations cached per shape,
  alignment, the launch wrappers `route_forward` / `route_backward` /
  `phase1_forward` / `phase1_backward`).
- `traffic`: bytes each routing launch reads and writes, against the floor.

The sm_90 compile report (registers, spills, vector width, pipelining, without a GPU) is a
measurement tool, not part of what the model runs: `python bench/compile_report.py`.

Names are exported lazily (`__getattr__`): importing the package, `contract`, `reference` or
`dispatch` does not import Triton or run any @triton.jit decorator, so TRITON_INTERPRET=1 may
still be set afterwards.
"""
_LAZY = {"route": "op", "route_unchecked": "op", "can_run": "op",
         "route_phase1": "triton_grouped",
         "route_reference": "reference", "routing_logits": "reference", "backend": "dispatch"}
_SUBMODULES = ("contract", "reference", "grouped_reference", "dispatch", "op", "triton_routing", "triton_grouped",
               "triton_merge", "depth_buffer", "depth_mix", "traffic", "routing_kernels", "grouped_kernels")

__all__ = [*_SUBMODULES[:4], *_LAZY]


def __getattr__(name: str):
    import importlib

    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'mhar_kernels' has no attribute {name!r}")
