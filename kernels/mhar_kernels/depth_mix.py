"""Weighted sums of depth-buffer rows (torch only): the depth mix of DenseFormer and MUDDFormer.

`mix_rows(buffer, reads, token, weights)` reads the rows `reads.rows` of a `DepthBuffer` (a slice of
slots: a view, no copy) after the write that made `token`, and sums them with `weights`:

- weights (n,), one per row (DenseFormer's depth-weighted average): out (B, T, d) =
  sum_j weights[j] rows[j], one matrix-vector product over the rows;
- weights (B, T, C, n), per token and stream (MUDDFormer's dynamic dense weights): out (C, B, T, d)
  with out[c, b, t] = sum_j weights[b, t, c, j] rows[j, b, t], one batched matrix product over the
  tokens.

The backward follows the depth buffer's protocol (depth_buffer.py): each row's gradient is written
by the row's first reader in the backward and added into by the others (`Reads.accumulate`), and the
write of a row hands it on to the row's producer; autograd sees O(1) edges per call whatever n is.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .depth_buffer import DepthBuffer, Reads, _first_derivative_only


def host_reads(rows: tuple[int, ...], adds: tuple[bool, ...]) -> Reads:
    """The `Reads` of a `mix_rows` call: its rows (evenly spaced slots) and, per row, whether a later
    reader in the forward (an earlier one in the backward) wrote the row's gradient first, so this
    call adds into it. Host data only (no slot vector on the device: the mix reads a slice of the
    buffer), made once per model."""
    return Reads(None, None, tuple(rows), frozenset(row for row, add in zip(rows, adds) if add))


def mix_rows(buffer: DepthBuffer, reads: Reads, token: Tensor | None, weights: Tensor) -> Tensor:
    """The weighted sum of the rows `reads.rows` of `buffer` (module docstring).

    Args:
        buffer: the forward's depth buffer, its rows (capacity, B, T, d).
        reads: the rows, as consecutive slots or slots of one stride (`Reads.rows`), and which of
            them this call adds its gradient into (`Reads.adds`).
        token: the newest write's token (`DepthBuffer.write`), so the backward runs before the
            rows' writes hand their gradients on.
        weights: (n,) or (B, T, C, n), n = len(reads.rows), in any float dtype (cast to the rows').

    Returns:
        (B, T, d) for (n,) weights, (C, B, T, d) for per-token weights, in the rows' dtype.

    Raises:
        ValueError: the rows are not evenly spaced, or the weights' shape does not match them.
    """
    rows = reads.rows
    if len(rows) > 1 and len({b - a for a, b in zip(rows, rows[1:])}) != 1:
        raise ValueError(f"mix_rows reads evenly spaced rows, got {rows}")
    if weights.shape[-1] != len(rows) or weights.dim() not in (1, 4):
        raise ValueError(f"weights {tuple(weights.shape)} do not match {len(rows)} rows: (n,) or (B, T, C, n)")
    return _Mix.apply(weights, token, buffer, reads)


def _rows(buffer: DepthBuffer, rows: tuple[int, ...]) -> slice:
    step = rows[1] - rows[0] if len(rows) > 1 else 1
    return slice(rows[0], rows[-1] + 1, step)


class _Mix(torch.autograd.Function):

    @staticmethod
    def forward(ctx, weights: Tensor, token: Tensor | None, buffer: DepthBuffer, reads: Reads) -> Tensor:
        ctx.set_materialize_grads(False)
        ctx.buffer, ctx.reads = buffer, reads
        rows = buffer.values[_rows(buffer, reads.rows)]  # (n, B, T, d), a view
        w = weights.to(rows.dtype)
        ctx.save_for_backward(w)
        ctx.weights_dtype = weights.dtype
        n, B, T, d = rows.shape
        if w.dim() == 1:
            return (w @ rows.view(n, -1)).view(B, T, d)
        C = w.shape[2]
        mixed = torch.bmm(w.reshape(B * T, C, n), rows.view(n, B * T, d).transpose(0, 1))  # (BT, C, d)
        return mixed.view(B, T, C, d).permute(2, 0, 1, 3)

    @staticmethod
    def backward(ctx, grad: Tensor | None):
        _first_derivative_only()
        if grad is None:
            return None, None, None, None
        (w,) = ctx.saved_tensors
        buffer, reads = ctx.buffer, ctx.reads
        index = _rows(buffer, reads.rows)
        rows, grads = buffer.values[index], buffer.gradients(reads)[index]  # (n, B, T, d) views
        n, B, T, d = rows.shape
        written = [i for i, row in enumerate(reads.rows) if row not in reads.adds]
        if w.dim() == 1:
            g = grad.reshape(-1)
            grad_w = rows.view(n, -1) @ g
            contribution = w.view(n, 1) * g.view(1, -1)  # (n, BTd)
            target = grads.view(n, -1)  # views of the gradient rows: written in place
        else:
            C = w.shape[2]
            g = grad.permute(1, 2, 0, 3).reshape(B * T, C, d)
            grad_w = torch.bmm(g, rows.view(n, B * T, d).permute(1, 2, 0)).view(B, T, C, n)
            contribution = torch.bmm(w.reshape(B * T, C, n).transpose(1, 2), g)  # (BT, n, d)
            target = grads.view(n, B * T, d).transpose(0, 1)
            written = [(slice(None), i) for i in written]
        for i in written:  # this call is the row's first reader in the backward: it writes the row
            target[i].zero_()
        target.add_(contribution)
        return grad_w.to(ctx.weights_dtype), None, None, None
