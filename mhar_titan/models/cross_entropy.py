"""The LM head's cross-entropy: the plain path (full logits) and a chunked path that never holds them.

Both compute the summed loss of hidden states h (N, d) through the head weight W (V, d) against
labels (N,): ``sum_t [lse_t - logit_t[y_t]] + z * sum_t lse_t^2`` over the target tokens
(labels != ``IGNORE_INDEX``), ``lse_t = logsumexp(h_t W^T)`` (the z-loss of MHAR_SPEC 3.4,
``z = 0`` disables it). The logits are computed in the storage dtype of h and W and reduced in fp32 (fp64 for fp64 inputs).

- ``plain``: ``logits = h W^T`` (N, V), then ``token_loss_sum`` / ``z_loss_sum``. Autograd keeps
  the logits, their fp32 copy and log-probabilities, and backward makes an (N, V) gradient.
- ``chunked``: ``ChunkedLinearCrossEntropy``, over chunks of ``chunk`` tokens: forward keeps only
  h, W, the labels and the (N,) fp32 lse; backward recomputes each chunk's logits and turns them
  into that chunk's gradient, ``dlogits = g (p (1 + 2 z lse) - onehot(y))`` with ``p = softmax``,
  then ``dh = dlogits W`` and ``dW += dlogits^T h`` (accumulated in fp32). At most one chunk of
  (chunk, V) values exists at a time, so the loss path's memory is O(chunk V + V d), not O(N V).

No maintained fused linear cross-entropy is used on CUDA: the chunked path is the one
implementation everywhere (and the plain path the reference).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

IGNORE_INDEX = -100
"""Label value that the loss ignores (padding, masked targets)."""


def at_least_fp32(x: Tensor) -> Tensor:
    """x in fp32, or in fp64 when it is fp64 (the reduction dtype of the loss)."""
    return x if x.dtype == torch.float64 else x.float()


def token_loss_sum(logits: Tensor, labels: Tensor) -> Tensor:
    """Summed cross-entropy (nats) of (B, T, V) logits against (B, T) labels, computed in
    fp32 (fp64 for fp64 logits); ``IGNORE_INDEX`` labels are ignored. Returns a 0-dim tensor."""
    return F.cross_entropy(at_least_fp32(logits.flatten(0, 1)), labels.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")


def z_loss_sum(logits: Tensor, labels: Tensor) -> Tensor:
    """Summed squared log-partition ``logsumexp(logits)^2`` (fp32, fp64 for fp64 logits) over the
    target tokens (labels != ``IGNORE_INDEX``) of (B, T, V) logits. Returns a 0-dim tensor."""
    lse = torch.logsumexp(at_least_fp32(logits.flatten(0, 1)), dim=-1)
    return torch.where(labels.flatten() != IGNORE_INDEX, lse.square(), 0.0).sum()


def plain_linear_cross_entropy(h: Tensor, weight: Tensor, labels: Tensor, z_loss: float = 0.0) -> Tensor:
    """The plain path: logits (B, T, V) = h (B, T, d) W^T, then ``token_loss_sum`` plus
    ``z_loss * z_loss_sum``. Returns a 0-dim fp32 tensor."""
    logits = F.linear(h, weight)
    loss = token_loss_sum(logits, labels)
    return loss + z_loss * z_loss_sum(logits, labels) if z_loss > 0 else loss


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """``apply(h (N, d), weight (V, d), labels (N,) int64, z_loss, chunk) -> 0-dim fp32`` summed loss
    (module docstring), equal to ``plain_linear_cross_entropy`` up to fp32 rounding. What backward
    needs goes through ``save_for_backward`` only (h, weight, labels, lse); ``ctx`` keeps just the
    two Python numbers z_loss and chunk. No gradient flows to labels, z_loss or chunk."""

    @staticmethod
    def forward(ctx, h: Tensor, weight: Tensor, labels: Tensor, z_loss: float, chunk: int) -> Tensor:
        acc = torch.float64 if h.dtype == torch.float64 else torch.float32
        lse = torch.empty(h.shape[0], dtype=acc, device=h.device)
        total = torch.zeros((), dtype=acc, device=h.device)
        for start in range(0, h.shape[0], chunk):
            logits = at_least_fp32(F.linear(h[start:start + chunk], weight))
            y = labels[start:start + chunk]
            valid = y != IGNORE_INDEX
            chunk_lse = torch.logsumexp(logits, dim=-1)
            target = logits.gather(1, torch.where(valid, y, 0).unsqueeze(1)).squeeze(1)
            per_token = chunk_lse - target
            if z_loss > 0:
                per_token = per_token + z_loss * chunk_lse.square()
            total = total + torch.where(valid, per_token, 0.0).sum()
            lse[start:start + chunk] = chunk_lse
        ctx.save_for_backward(h, weight, labels, lse)
        ctx.z_loss, ctx.chunk = z_loss, chunk
        return total

    @staticmethod
    def backward(ctx, grad: Tensor):
        h, weight, labels, lse = ctx.saved_tensors
        grad_h = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(weight.shape, dtype=lse.dtype, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        for start in range(0, h.shape[0], ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            y = labels[rows]
            valid = y != IGNORE_INDEX
            scale = torch.where(valid, grad.to(lse.dtype), 0.0)  # (n,): d loss / d per-token loss
            row_scale = scale * (1 + 2 * ctx.z_loss * lse[rows]) if ctx.z_loss > 0 else scale
            # softmax, then its share of the gradient, in place on the chunk's fresh logits
            dlogits = at_least_fp32(F.linear(h[rows], weight)).sub_(lse[rows].unsqueeze(1)).exp_()
            dlogits.mul_(row_scale.unsqueeze(1))
            dlogits.scatter_add_(1, torch.where(valid, y, 0).unsqueeze(1), -scale.unsqueeze(1))
            dlogits = dlogits.to(h.dtype)
            if grad_h is not None:
                grad_h[rows] = dlogits @ weight
            if grad_w is not None:
                grad_w += at_least_fp32(dlogits.t() @ h[rows])
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None


def chunked_linear_cross_entropy(h: Tensor, weight: Tensor, labels: Tensor, z_loss: float = 0.0,
                                 chunk: int = 1024) -> Tensor:
    """The chunked path on h (B, T, d) or (N, d), weight (V, d), labels of h's leading shape:
    the summed loss as ``plain_linear_cross_entropy``, without (N, V) logits (``chunk`` tokens at a
    time). Returns a 0-dim fp32 tensor. Raises ValueError for chunk < 1."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1 token, got {chunk}")
    return ChunkedLinearCrossEntropy.apply(h.reshape(-1, h.shape[-1]), weight, labels.reshape(-1), z_loss, chunk)


def loss_path_bytes(tokens: int, vocab: int, dim: int, compute_bytes: int, path: str, chunk: int = 1024) -> int:
    """Modelled peak bytes of the loss path (the LM head and the loss, forward and backward) for
    `tokens` tokens of one micro-batch, beyond its inputs h and W (the dry run's ``loss_path``).

    plain: the logits in the compute dtype (c bytes per entry) and fp32 log-probabilities and
    their gradient (8): tokens x vocab x (c + 8). chunked: one chunk's fp32 logits, probabilities
    and gradient (12 per entry), the fp32 head-weight gradient (4 vocab dim) and the fp32 lse (4 per
    token): min(chunk, tokens) x vocab x 12 + 4 vocab dim + 4 tokens."""
    if path == "plain":
        return tokens * vocab * (compute_bytes + 8)
    return min(chunk, tokens) * vocab * 12 + 4 * vocab * dim + 4 * tokens
