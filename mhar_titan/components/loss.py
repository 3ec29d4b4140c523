"""The training loss: summed token cross-entropy, and how the trainer normalises it.

The trainer backpropagates ``token_loss_sum(logits, labels) / n_global * dp_world`` per
micro-batch, where ``n_global`` is the number of target tokens (labels != -100) of the
whole step over all micro-batches and ranks. FSDP2 averages gradients over the ranks
(divides by ``dp_world``), so the summed gradient is the one of the mean loss over all
``n_global`` tokens: exact for any accumulation, world size and ignored labels.

With ``training.z_loss = z > 0`` the training loss adds ``z * logsumexp(logits)^2`` per target
token (the 8B recipe's z-loss 1e-4, MHAR_SPEC 3.4), so the step's loss is
``mean(cross-entropy) + z * mean(logsumexp^2)`` over the same tokens; validation reports the
cross-entropy alone.
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


def z_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed squared log-partition ``logsumexp(logits)^2`` (fp32) over the target tokens
    (labels != ``IGNORE_INDEX``) of (B, T, V) logits. Returns a 0-dim tensor."""
    lse = torch.logsumexp(logits.flatten(0, 1).float(), dim=-1)
    return torch.where(labels.flatten() != IGNORE_INDEX, lse.square(), 0.0).sum()


def build_loss_fn(cfg: Compile, z_loss: float = 0.0) -> LossFn:
    """The summed training loss: ``token_loss_sum``, plus ``z_loss * z_loss_sum`` when
    ``z_loss > 0``; compiled with ``cfg.backend`` when ``[compile]`` enables "loss"."""
    fn = token_loss_sum
    if z_loss > 0:
        def fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return token_loss_sum(logits, labels) + z_loss * z_loss_sum(logits, labels)
    if cfg.enable and "loss" in cfg.components:
        return torch.compile(fn, backend=cfg.backend)
    return fn
