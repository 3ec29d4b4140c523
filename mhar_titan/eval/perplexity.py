"""Validation loss and perplexity of a model on held-out token batches."""
from __future__ import annotations

import dataclasses
import math
from typing import Iterable

import torch
from torch import Tensor

from mhar_titan.components.loss import target_count, token_loss_sum
from mhar_titan.progress import progress


@dataclasses.dataclass(frozen=True)
class Perplexity:
    """Mean cross-entropy over the target tokens and its exponential."""

    loss: float
    """nats per target token."""
    tokens: int
    """target tokens scored (labels != -100)."""

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss)


@torch.no_grad()
def evaluate_perplexity(model: torch.nn.Module, batches: Iterable[tuple[Tensor, Tensor]],
                        desc: str = "perplexity") -> Perplexity:
    """Score ``(inputs, labels)`` batches, each (B, T) int64, labels -100 ignored.

    The loss is the summed token cross-entropy over all batches divided by the number of
    target tokens (not a mean of batch means). A progress bar shows on a terminal.

    Raises:
        ValueError: no target token at all.
    """
    device = next(model.parameters()).device
    total, count = 0.0, 0
    total_batches = len(batches) if hasattr(batches, "__len__") else None
    for x, y in progress(batches, total=total_batches, desc=desc, unit="batch"):
        x, y = x.to(device), y.to(device)
        total += token_loss_sum(model(x), y).item()  # the trainer's loss, so the numbers compare
        count += int(target_count(y))
    if count == 0:
        raise ValueError("no target tokens to score (every label is -100, or there were no batches)")
    return Perplexity(loss=total / count, tokens=count)
