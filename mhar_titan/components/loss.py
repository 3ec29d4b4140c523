"""The training loss: summed token cross-entropy of the LM head, and how the trainer normalises it.

The trainer backpropagates ``model(x, labels, loss_fn=loss_fn) / n_global * dp_world`` per
micro-batch: the model's forward ends with ``loss_fn(h, head_weight, labels)``, the summed loss
of its final hidden states (so under FSDP the LM head runs in the root module's forward, with its
weight gathered as usual). ``n_global`` is the number of target tokens (labels != -100) of the
whole step over all micro-batches and ranks. FSDP2 averages gradients over the ranks (divides by
``dp_world``), so the summed gradient is the one of the mean loss over all ``n_global`` tokens:
exact for any accumulation, world size and ignored labels.

With ``training.z_loss = z > 0`` the training loss adds ``z * logsumexp(logits)^2`` per target
token (the 8B recipe's z-loss 1e-4, MHAR_SPEC 3.4), so the step's loss is
``mean(cross-entropy) + z * mean(logsumexp^2)`` over the same tokens; validation reports the
cross-entropy alone. ``training.loss_path`` picks how the head and the loss run
(``models/cross_entropy.py``): "chunked" (default) never holds the (N, V) logits, "plain" does.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch

from mhar_titan.config import Compile
from mhar_titan.models.cross_entropy import (  # noqa: F401  (token_loss_sum: the evaluation's loss)
    IGNORE_INDEX, chunked_linear_cross_entropy, plain_linear_cross_entropy, token_loss_sum, z_loss_sum,
)

HeadLossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``fn(h (B, T, d), head_weight (V, d), labels (B, T)) -> 0-dim`` summed loss (what the model's forward calls)."""


def target_count(labels: torch.Tensor) -> torch.Tensor:
    """Number of labels that count in the loss (not ``IGNORE_INDEX``), a 0-dim int64 tensor."""
    return (labels != IGNORE_INDEX).sum()


def build_loss_fn(cfg: Compile, z_loss: float = 0.0, path: str = "chunked", chunk_tokens: int = 1024) -> HeadLossFn:
    """The summed training loss of the LM head for ``model(x, labels, loss_fn=...)``: cross-entropy
    plus ``z_loss * logsumexp^2`` per target token, through ``path`` ("chunked": ``chunk_tokens``
    tokens at a time; "plain": the full logits); compiled with ``cfg.backend`` when ``[compile]``
    enables "loss" (under "whole_model" it is traced with the model)."""
    if path == "plain":
        fn = functools.partial(plain_linear_cross_entropy, z_loss=z_loss)
    else:
        fn = functools.partial(chunked_linear_cross_entropy, z_loss=z_loss, chunk=chunk_tokens)
    if cfg.enable and "loss" in cfg.components:
        return torch.compile(fn, backend=cfg.backend)
    return fn
