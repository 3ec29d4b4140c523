"""The training loss: summed token cross-entropy, and how the trainer normalises it.

The trainer backpropagates ``token_loss_sum(logits, labels) / n_global * dp_world`` per
micro-batch, where ``n_global`` is the number of target tokens (labels != -100) of the
whole step over all micro-batches and ranks. FSDP2 averages gradients over the ranks
(divides by ``dp_world``), so the summed gradient is the one of the mean loss over all
``n_global`` tokens: exact for any accumulation, world size and ignored labels.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from mhar_titan.config import Compile

IGNORE_INDEX = -100
"""Label value that the loss ignores (padding, masked targets)."""

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def target_count(labels: torch.Tensor) -> torch.Tensor:
    """Number of labels that count in the loss (not ``IGNORE_INDEX``), a 0-dim int64 tensor."""
    return (labels != IGNORE_INDEX).sum()


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy (nats) of (B, T, V) logits against (B, T) labels, computed in
    fp32; ``IGNORE_INDEX`` labels are ignored. Returns a 0-dim tensor."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")


def build_loss_fn(cfg: Compile) -> LossFn:
    """``token_loss_sum``, compiled with ``cfg.backend`` when ``[compile]`` enables "loss"."""
    if cfg.enable and "loss" in cfg.components:
        return torch.compile(token_loss_sum, backend=cfg.backend)
    return token_loss_sum
