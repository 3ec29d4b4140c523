"""Fused Triton depth-routing kernels for AttnRes / MHAR (imported as `mhar_kernels`).

A leaf package: imports torch and triton, nothing of the models. Contents:

- `contract`: the op's argument checks, compute dtype and null-source handling (torch only).
- `route(sources, query, norm_weight, heads, eps=1e-6, *, partial=None, alpha=None,
  null_source=None)`: the registered custom op `mhar::depth_route` with autograd (`op.py`);
  `can_run(device, dim, heads)` says where it runs (CUDA; CPU under TRITON_INTERPRET=1).
- `route_with_state` / `merge_states`: the online-softmax state, forward only (`online_state.py`).
- `route_phase1(queries, norm_weights, reads, heads, eps, *sources)`: phase 1 of a grouped
  routing group (every site's online-softmax state over the group's start sources in one pass,
  forward and backward, `triton_grouped.py`); `can_run_phase1(device, dim, heads)` says where.
- `traffic`: bytes each routing launch reads and writes, against the floor.
- `compile_report`: the kernels compiled for sm_90 without a GPU (`python -m
  mhar_kernels.compile_report`: registers, spills, vector width, pipelining).

`route`, `can_run`, `route_with_state`, `merge_states`, `route_phase1` and `can_run_phase1`
import Triton on first use, so importing the package (or `mhar_kernels.contract`) does not run
any @triton.jit decorator: TRITON_INTERPRET=1 may still be set afterwards.
"""
from . import contract

_LAZY = {"route": "op", "route_unchecked": "op", "can_run": "op",
         "route_with_state": "online_state", "merge_states": "online_state",
         "route_phase1": "triton_grouped", "can_run_phase1": "triton_grouped"}

__all__ = ["contract", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'mhar_kernels' has no attribute {name!r}")
