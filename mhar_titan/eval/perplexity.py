"""Validation loss and perplexity of a model on held-out token batches."""
from __future__ import annotations

import dataclasses
import math
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import Tensor

from mhar_titan.progress import progress

IGNORE_INDEX = -100


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
        logits = model(x)
        total += F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), ignore_index=IGNORE_INDEX,
                                 reduction="sum").item()
        count += int((y != IGNORE_INDEX).sum())
    if count == 0:
        raise ValueError("no target tokens to score (every label is -100, or there were no batches)")
    return Perplexity(loss=total / count, tokens=count)
