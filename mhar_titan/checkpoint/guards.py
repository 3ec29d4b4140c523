"""What ``CheckpointManager.save`` checks around a save, so that a save never costs the run
its last complete checkpoint.

* ``nonfinite_entries``: names of the state's floating-point tensors (model, optimizer, EMA)
  holding NaN or infinity; such a state is never written (it would become the newest
  checkpoint, and every resume would load it).
* ``state_bytes`` / ``space_warning``: the size of one checkpoint, and a warning before the
  first save when the free space cannot hold the checkpoints that retention keeps
  (``keep_latest_k``) plus the one being written.
* ``save_failure``: the one-line ``CheckpointSaveError`` for a save that failed on an OS error
  (a full disk, a read-only or vanished folder), however DCP wrapped it.

The manager removes what a failed save wrote; the last complete checkpoint stays the newest.
"""
from __future__ import annotations

import errno
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from mhar_titan.config.checkpoint import CheckpointError
from mhar_titan.files import free_bytes, os_error_of, os_error_text


class CheckpointSaveError(CheckpointError):
    """A checkpoint could not be written (disk full, OS error) or was refused (non-finite state);
    the folder's last complete checkpoint is kept and stays the newest."""


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # a DTensor's shard on this rank


def _tensors(tree: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(tree, torch.Tensor):
        yield prefix, _local(tree)
    elif isinstance(tree, dict):
        for k, v in tree.items():
            yield from _tensors(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from _tensors(v, f"{prefix}.{i}")


def nonfinite_entries(state: dict) -> list[str]:
    """Dotted names of the floating-point tensors in ``state`` (this rank's shards) with a NaN or
    infinite value, e.g. ``model.layers.0.attention.wq.weight`` or ``optimizer.state.<fqn>.exp_avg``."""
    return [name for name, t in _tensors(state)
            if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all())]


def state_bytes(state: dict) -> int:
    """Bytes this rank writes for ``state``: its tensors' (local shards') bytes plus its byte items."""
    total = 0
    stack = [state]
    while stack:
        node = stack.pop()
        if isinstance(node, torch.Tensor):
            t = _local(node)
            total += t.numel() * t.element_size()
        elif isinstance(node, (bytes, bytearray)):
            total += len(node)
        elif isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, (list, tuple)):
            stack.extend(node)
    return total


def _size(n: int) -> str:
    return f"{n / 2 ** 20:,.1f} MiB ({n:,} bytes)"


def space_warning(folder: Path, size: int, keep_latest_k: int, complete: int) -> Optional[str]:
    """The warning to log when ``folder``'s filesystem cannot hold the next saves, or None.

    Args:
        folder: the checkpoint folder (``run_dir / checkpoint.folder``; need not exist yet).
        size: bytes of one checkpoint (all ranks).
        keep_latest_k: ``checkpoint.keep_latest_k`` (0 keeps all).
        complete: complete checkpoints in the folder now.

    While a save is written the folder holds the ``keep_latest_k`` kept ones plus the new one
    (retention runs after the new one is complete), so up to ``keep_latest_k + 1 - complete``
    more checkpoints must fit (at least one; with ``keep_latest_k = 0`` every save adds one).
    """
    free = free_bytes(folder)
    if free is None:
        return None
    more = max(1, keep_latest_k + 1 - complete) if keep_latest_k > 0 else 1
    if free >= more * size:
        return None
    fits = free // size if size else 0
    return (f"checkpoint folder {folder} has {_size(free)} free, but one checkpoint takes about {_size(size)} "
            f"and keep_latest_k={keep_latest_k} needs room for {more} more while a save is written "
            f"({fits} fit): a coming save will fail; free space, lower checkpoint.keep_latest_k or move "
            f"job.dump_folder to a larger filesystem")


def save_failure(e: BaseException, path: Path, needed: int) -> Optional[CheckpointSaveError]:
    """The error to raise for a save of ``path`` that failed with ``e``; None when ``e`` is not about the
    disk (a bug: re-raise it as it is).

    A disk-full failure is recognised as every writer's is (``mhar_titan.files.os_error_of``: its
    ``ENOSPC`` / ``EDQUOT`` anywhere in ``e``'s chain or DCP's per-rank failures, also when only a
    library's message names it), or,
    since torch's zip writer can report a short write as ``RuntimeError: ... unexpected pos``,
    by the filesystem having less free space than the checkpoint needs.
    """
    err = os_error_of(e)
    free = free_bytes(path)
    if err is None and free is not None and free < needed:
        err = OSError(errno.ENOSPC, "No space left on device")
    if err is None:
        return None
    return CheckpointSaveError(
        f"checkpoint {path} could not be saved: {os_error_text(err, path, needed)}; the partly written folder "
        f"was removed and the last complete checkpoint is kept as the newest (relaunch resumes from it)"
    )


def nonfinite_error(path: Path, names: list[str], count: int, newest: Optional[Path]) -> CheckpointSaveError:
    """The refusal to save ``path`` from a state with ``count`` non-finite tensors (``names``: some of them)."""
    kept = f"the newest checkpoint stays {newest}" if newest is not None else "no checkpoint was written"
    return CheckpointSaveError(
        f"refusing to save checkpoint {path}: {count} tensor(s) of the model or optimizer state hold NaN or "
        f"infinity (e.g. {', '.join(names[:3]) or 'on another rank'}); {kept}. The run diverged: lower "
        f"optimizer.lr or training.max_norm, or check the data, then resume from the last checkpoint"
    )
