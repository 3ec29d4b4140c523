"""Batch geometry: how a step's global batch splits into ranks and micro-batches."""
from __future__ import annotations

from typing import Iterator

import torch

from mhar_titan.config import ConfigError, Training
from mhar_titan.data.sources import DataError


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


def check_token_ids(tokens: torch.Tensor, vocab_size: int, step: int) -> None:
    """Refuse a batch whose token ids leave [0, ``vocab_size``), read on the host before the batch
    goes to the device (so the model's forward need not read them back: ``Transformer.check_token_ids``).

    Raises:
        DataError: an id out of range (the tokenizer does not match the model), naming the step.
    """
    low, high = (int(v) for v in torch.aminmax(tokens))
    if low < 0 or high >= vocab_size:
        raise DataError(f"the batch of step {step} holds token ids in [{low}, {high}] but the model's vocab_size is "
                        f"{vocab_size}: the tokenizer does not match the model; set the model's vocab_size to the "
                        "tokenizer's vocabulary padded up to a multiple of 128")


def next_micro_batches(it: Iterator, grad_accum: int, device: torch.device,
                       step: int, vocab_size: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The ``grad_accum`` (inputs, labels) pairs of optimizer step ``step``, each (B, T) int64 on ``device``.
    With ``vocab_size`` each input batch's ids are checked on the host first (``check_token_ids``).

    Raises:
        RuntimeError: the training data ran out (names ``data.infinite`` and ``training.steps``).
        DataError: with ``vocab_size``, an id out of range.
    """
    batches = []
    for _ in range(grad_accum):
        try:
            x, y = next(it)
        except StopIteration:
            raise RuntimeError(
                f"the training data ran out at step {step}; set data.infinite = true or lower training.steps"
            ) from None
        if vocab_size is not None:
            check_token_ids(x, vocab_size, step)
        batches.append((x.to(device, non_blocking=True), y.to(device, non_blocking=True)))
    return batches
