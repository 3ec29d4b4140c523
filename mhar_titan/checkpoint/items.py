"""The non-tensor items of a checkpoint: safe encoding, RNG states, export casting.

LR scheduler, train state, data position and RNG states are stored as ``torch.save``
bytes of plain data, one DCP byte item each (``encode``), and read back with
``weights_only=True`` (``decode``), so a checkpoint from an untrusted
``initial_load_path`` cannot run code through pickle.
"""
from __future__ import annotations

import io
import pickle
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mhar_titan.config.checkpoint import CheckpointError


def encode(obj: Any) -> bytes:
    """``torch.save`` bytes of plain data (dicts, lists, tuples, numbers, strings, tensors)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def decode(blob: bytes, key: str, path: Path) -> Any:
    """Inverse of ``encode`` with ``weights_only=True``: no arbitrary classes or callables.

    Raises:
        CheckpointError: ``blob`` (item ``key`` of checkpoint ``path``) holds anything else,
            e.g. a pickle that would import and call a function.
    """
    try:
        return torch.load(io.BytesIO(blob), weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f"checkpoint {path}: item {key!r} is not plain data and was refused (loading it could run "
            f"arbitrary code): {first}. Only load checkpoints written by this trainer from a source you trust."
        ) from None


def rng_state() -> dict:
    """This process's python, numpy, torch CPU (and CUDA, once initialised) RNG states, as plain data."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    numpy_state = (kind, keys.tolist(), int(pos), int(has_gauss), float(gauss))  # plain data, no ndarray
    state = {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Inverse of ``rng_state``."""
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def cast_floats(state: dict, dtype_name: str) -> dict:
    """``state`` with every floating-point tensor cast to the torch dtype named ``dtype_name``."""
    dtype = getattr(torch, dtype_name)
    return {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in state.items()}
