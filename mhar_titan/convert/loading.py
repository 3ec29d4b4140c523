"""Stream a safetensors checkpoint into a built model, one tensor at a time.

The model already holds its parameter storage (a plain model, or FSDP2 DTensor shards); each
checkpoint tensor is read, copied into its parameter (or its row of a stacked routing
parameter) and dropped, shard by shard. Peak memory is therefore the model plus one mapped
shard, never two full copies of the weights. Everything is checked from the shard headers
(names, shapes) before the first tensor is read.
"""
from __future__ import annotations

import math
import os
from typing import Callable, Optional

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor

from .hf_config import ConversionError
from .names import IGNORED, Target
from .safetensors_io import _safetensors, iter_tensors, shard_paths


def header_shapes(folder: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` of every tensor of the checkpoint, from the shard headers only."""
    safe_open = _safetensors()
    shapes: dict[str, tuple[int, ...]] = {}
    for path in shard_paths(folder):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def _squeezed(shape) -> tuple[int, ...]:
    return tuple(n for n in shape if n != 1)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def assign(dest: torch.Tensor, src: torch.Tensor) -> None:
    """Copy the full tensor ``src`` into ``dest`` (a plain tensor, or this rank's shard of a
    DTensor, sliced locally without communication), casting to ``dest``'s dtype."""
    src = src.reshape(dest.shape)
    with torch.no_grad():
        if isinstance(dest, DTensor):
            local = distribute_tensor(src.to(dest.dtype), dest.device_mesh, dest.placements, src_data_rank=None)
            dest.to_local().copy_(local.to_local())
        else:
            dest.copy_(src)


def load_streamed(
    model: nn.Module,
    folder: str | os.PathLike,
    target: Callable[[str], Optional[Target]],
    required: Callable[[str], bool],
    *,
    skip: Callable[[str], bool] = lambda name: False,
) -> list[str]:
    """Copy the tensors of a safetensors checkpoint into ``model``; return the keys filled.

    Args:
        model: a built model (any device; plain or FSDP2-sharded; compile/AC wrappers are
            seen through, keys are the plain model's).
        folder: the checkpoint folder (see ``safetensors_io``).
        target: checkpoint name -> ``(our key, row)`` (row None: the whole tensor), or None
            for a name the model has no place for.
        required: which of our keys the checkpoint must fill completely.
        skip: checkpoint names to leave out on purpose (e.g. a tied LM head).

    Shapes must agree up to size-1 dimensions (an authors' (1, d) pseudo-query fills a (d,)
    row; a 0-dim gate fills a (1,) row).

    Raises:
        ConversionError (before any tensor is read): a checkpoint name with no target, a
        target key the model lacks, a shape mismatch, or a required key left unfilled.
    """
    state = get_model_state_dict(model)
    shapes = header_shapes(folder)
    problems, plan = [], {}
    filled_rows: dict[str, set] = {}
    for name, shape in sorted(shapes.items()):
        if IGNORED.search(name) or skip(name):
            continue
        where = target(name)
        if where is None:
            problems.append(f"{name}: no matching parameter in this model")
            continue
        key, row = where
        if key not in state:
            problems.append(f"{name}: maps to {key}, which this model does not have")
            continue
        full_shape = tuple(state[key].shape)
        expected = full_shape if row is None else full_shape[1:]
        if row is not None and not 0 <= row < full_shape[0]:
            problems.append(f"{name}: maps to row {row} of {key}, which has {full_shape[0]} rows")
            continue
        if _squeezed(shape) != _squeezed(expected) or math.prod(shape) != math.prod(expected):
            problems.append(f"{name}: shape {shape} in the checkpoint, {expected} in the model ({key})")
            continue
        plan[name] = where
        filled_rows.setdefault(key, set()).add(row)
    for key in sorted(k for k in state if required(k)):
        rows = filled_rows.get(key, set())
        if not rows:
            problems.append(f"{key}: not in the checkpoint")
        elif None not in rows and len(rows) != state[key].shape[0]:
            problems.append(f"{key}: only rows {sorted(rows)} of {state[key].shape[0]} are in the checkpoint")
    if problems:
        more = f"\n  ... and {len(problems) - 12} more" if len(problems) > 12 else ""
        raise ConversionError(
            f"checkpoint {folder} does not fit the model ({len(problems)} problem(s)); nothing was loaded:\n  "
            + "\n  ".join(problems[:12]) + more
        )

    row_buffers: dict[str, torch.Tensor] = {}
    for name, tensor in iter_tensors(folder):
        if name not in plan:
            continue
        key, row = plan[name]
        if row is None:
            assign(state[key], tensor)
        else:
            if key not in row_buffers:
                row_buffers[key] = _full(state[key]).detach().to("cpu", copy=True)
            row_buffers[key][row].copy_(tensor.reshape(row_buffers[key].shape[1:]))
        del tensor
    for key, buffer in row_buffers.items():
        assign(state[key], buffer)
    return sorted({key for key, _ in plan.values()})
