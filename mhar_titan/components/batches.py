"""Batch geometry: how a step's global batch splits into ranks and micro-batches."""
from __future__ import annotations

from typing import Iterator

import torch

from mhar_titan.config import ConfigError, Training


def batch_geometry(t: Training, world_size: int) -> tuple[int, int]:
    """(global batch in sequences, gradient-accumulation steps) for ``world_size`` data-parallel ranks.

    ``t.global_batch_size = -1`` means local_batch_size x world_size (no accumulation).

    Raises:
        ConfigError: the global batch is not a multiple of local_batch_size x world_size.
    """
    per_micro = t.local_batch_size * world_size
    global_batch = per_micro if t.global_batch_size == -1 else t.global_batch_size
    if global_batch % per_micro:
        raise ConfigError(
            f"'training.global_batch_size' ({global_batch}) must be a multiple of "
            f"local_batch_size x ranks = {t.local_batch_size} x {world_size} = {per_micro}; change one of them "
            f"(for example --training.global_batch_size={max(per_micro, global_batch // per_micro * per_micro)})"
        )
    return global_batch, global_batch // per_micro


def next_micro_batches(it: Iterator, grad_accum: int, device: torch.device,
                       step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The ``grad_accum`` (inputs, labels) pairs of optimizer step ``step``, each (B, T) int64 on ``device``.

    Raises:
        RuntimeError: the training data ran out (names ``data.infinite`` and ``training.steps``).
    """
    batches = []
    for _ in range(grad_accum):
        try:
            x, y = next(it)
        except StopIteration:
            raise RuntimeError(
                f"the training data ran out at step {step}; set data.infinite = true or lower training.steps"
            ) from None
        batches.append((x.to(device, non_blocking=True), y.to(device, non_blocking=True)))
    return batches
