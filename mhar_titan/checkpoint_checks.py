"""What ``CheckpointManager.load`` checks before it changes anything, and safe decoding.

* ``check_fingerprint``: the run's fingerprint (model arguments, tokenizer...) recorded
  in ``complete.json`` must equal this run's.
* ``check_keys``: every key this run asks for exists in the DCP metadata with the same
  shape, and every saved model key is used.
* ``check_no_newer``: ``checkpoint.load_step`` may not go back behind newer complete
  checkpoints of the same folder (they would be deleted by retention later, or win
  again over the new saves on the next ``load_step = -1``).
* ``decode``: the non-tensor items (LR scheduler, train state, data position, RNG) are
  ``torch.save`` bytes; they are read with ``weights_only=True``, so a checkpoint from an
  untrusted ``initial_load_path`` cannot run code through pickle.

Every check raises before any tensor is read, so nothing in memory or on disk changes.
"""
from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used (missing, incomplete, wrong kind, bad config, unsafe content)."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint was made for a different model, tokenizer or optimizer setup."""


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


def flatten_plain(tree: Any, prefix: str = "") -> dict:
    """Nested dict -> ``{"a.b": leaf}`` (used for fingerprints)."""
    if isinstance(tree, dict):
        out = {}
        for key in sorted(tree, key=str):
            out.update(flatten_plain(tree[key], f"{prefix}{key}."))
        return out
    return {prefix[:-1]: tree}


def json_safe(tree: Any) -> Any:
    """Fingerprints go into JSON: tuples become lists, unknown objects their ``repr``."""
    if isinstance(tree, dict):
        return {str(k): json_safe(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [json_safe(v) for v in tree]
    if tree is None or isinstance(tree, (bool, int, float, str)):
        return tree
    return repr(tree)


def check_no_newer(folder: Path, wanted: int, complete: list[int]) -> None:
    """``load_step = wanted`` is allowed only when no complete checkpoint is newer.

    Raises:
        CheckpointError: naming the newer ``step-N`` folders and what to do with them.
    """
    newer = [s for s in complete if s > wanted]
    if newer:
        names = ", ".join(str(folder / f"step-{s}") for s in newer)
        raise CheckpointError(
            f"checkpoint.load_step={wanted} is older than the newest complete checkpoint(s) of this run: {names}. "
            "Training on from there would start a new branch: retention would later delete its saves first, "
            "and a later resume (load_step = -1) would pick the abandoned newer step. Nothing was loaded or "
            "deleted. To go back, move those folders out of the checkpoint folder (or delete them), or "
            f"start a new run (job.name) with checkpoint.initial_load_path={folder / f'step-{wanted}'} "
            "and checkpoint.initial_load_model_only=false."
        )


def check_fingerprint(path: Path, saved: dict, current: dict) -> None:
    """Raise ``CheckpointMismatchError`` listing the settings that differ (up to 8)."""
    saved, current = flatten_plain(saved), flatten_plain(current)
    diffs = [
        f"{key}: checkpoint {saved.get(key, '<unset>')!r}, this run {current.get(key, '<unset>')!r}"
        for key in sorted(set(saved) | set(current))
        if saved.get(key, "<unset>") != current.get(key, "<unset>")
    ]
    if diffs:
        raise CheckpointMismatchError(
            f"checkpoint {path} was made with different settings ({len(diffs)} differ), e.g.\n  "
            + "\n  ".join(diffs[:8])
            + "\nNothing was loaded. Use the original settings, a new run folder (job.name), or "
            "checkpoint.initial_load_path with a matching model."
        )


def _shape(value: Any):
    return tuple(value.size()) if isinstance(value, torch.Tensor) else None


def check_keys(path: Path, requested: dict, metadata: Metadata, has_model: bool) -> None:
    """Every requested (flattened) key must exist with the same shape; with ``has_model``,
    every saved ``model.*`` key must be requested. Raises ``CheckpointMismatchError``."""
    saved = metadata.state_dict_metadata
    missing = [k for k in requested if k not in saved]
    shapes = []
    for key, value in requested.items():
        meta = saved.get(key)
        if isinstance(meta, TensorStorageMetadata) and _shape(value) is not None:
            if tuple(meta.size) != _shape(value):
                shapes.append(f"{key}: checkpoint {tuple(meta.size)}, this run {_shape(value)}")
        elif isinstance(meta, BytesStorageMetadata) and _shape(value) is not None:
            shapes.append(f"{key}: checkpoint holds an object, this run a tensor {_shape(value)}")
    unexpected = [k for k in saved if k.startswith("model.") and k not in requested] if has_model else []
    if missing or shapes or unexpected:
        lines = []
        if shapes:
            lines.append(f"shape mismatch ({len(shapes)}): " + "; ".join(shapes[:5]))
        if missing:
            lines.append(f"missing from the checkpoint ({len(missing)}): " + ", ".join(missing[:5]))
        if unexpected:
            lines.append(f"in the checkpoint but not in this model ({len(unexpected)}): " + ", ".join(unexpected[:5]))
        raise CheckpointMismatchError(
            f"checkpoint {path} does not match this run:\n  " + "\n  ".join(lines)
            + "\nNothing was loaded. Check [model] (flavor, residual, routing_heads) against the run that "
            "saved it, or list parts to skip in checkpoint.exclude_from_loading."
        )
