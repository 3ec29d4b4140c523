"""What ``CheckpointManager.load`` checks before it changes anything (besides the fingerprint,
``mhar_titan.checkpoint.fingerprint``).

* ``check_keys``: every key this run asks for exists in the DCP metadata with the same
  shape, and every saved model key is used.
* ``unreadable_error``: the error for a checkpoint whose files cannot be read, naming the
  previous complete step to fall back to.
* ``check_no_newer``: ``checkpoint.load_step`` may not go back behind newer complete
  checkpoints of the same folder (they would be deleted by retention later, or win
  again over the new saves on the next ``load_step = -1``).

Every check raises before any tensor is read, so nothing in memory or on disk changes.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from mhar_titan.config.checkpoint import CheckpointError, CheckpointMismatchError
from mhar_titan.checkpoint.layout import is_complete, step_folders, step_of


def optimizer_kind(keys) -> Optional[str]:
    """The optimizer whose state these flattened DCP keys hold: "Muon" (``MuonWithAdamW``: a
    ``momentum_buffer`` beside AdamW's moments), "AdamW" (``exp_avg`` only), None (no optimizer state)."""
    kind = None
    for key in keys:
        if key.startswith("optimizer.state."):
            if key.endswith(".momentum_buffer"):
                return "Muon"
            if key.endswith(".exp_avg"):
                kind = "AdamW"
    return kind


def check_optimizer(path: Path, saved: Optional[str], current: Optional[str], model_only_hint: str) -> None:
    """A checkpoint's optimizer state loads only into the optimizer it was saved with.

    Raises:
        CheckpointMismatchError: ``saved`` and ``current`` are both known and differ; the message names
            both and the two ways on (the saved optimizer, or ``model_only_hint``: loading without the
            optimizer state).
    """
    if saved is None or current is None or saved == current:
        return
    raise CheckpointMismatchError(
        f"{path} holds {saved} optimizer state and this run has optimizer.name = \"{current}\": switching "
        f"optimizer at a resume is refused. Resume with --optimizer.name={saved}, or {model_only_hint} (the "
        f"{current} state then starts fresh)")


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


def _first_line(error: BaseException) -> str:
    """A one-line reason from ``error``, unwrapping DCP's per-rank ``CheckpointException``."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, wrapped = sorted(failures.items())[0]
        inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        return f"rank {rank}: {_first_line(inner)}"
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


def unreadable_error(folder: Path, path: Path, error: BaseException, reader: bool = False) -> CheckpointError:
    """The error for checkpoint ``path`` (a ``step-N`` of ``folder``, or an ``initial_load_path``)
    whose files cannot be read (truncated, corrupted): names the way out; nothing is deleted.
    ``reader``: the caller only reads weights (eval, generate, analysis, convert), so the way out is
    the previous complete checkpoint's folder or ``--step N``, not a training resume."""
    step = step_of(path)
    if path.parent == folder and step is not None:
        older = sorted(s for s, p in step_folders(folder).items() if s < step and is_complete(p))
        if reader:
            way_out = (f"read the previous complete checkpoint instead: pass {folder / f'step-{older[-1]}'} "
                       f"(or the run folder with --step {older[-1]})" if older else
                       "train again: this run has no earlier complete checkpoint")
        else:
            way_out = (
                f"move it out of the way (e.g. `mv {path} {path}.corrupt`; folders not named step-N are ignored), "
                + (f"then resume with the same command: the previous complete checkpoint, step-{older[-1]}, is "
                   "loaded" if older else
                   "then resume: there is no earlier complete checkpoint, so the run starts from step 0")
            )
    else:
        way_out = "point checkpoint.initial_load_path at another checkpoint"
    return CheckpointError(
        f"checkpoint {path} cannot be read ({_first_line(error)}); its files are truncated or corrupted. "
        f"Nothing was loaded or deleted. To continue, {way_out}."
    )
