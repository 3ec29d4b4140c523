"""The depth buffer: one micro-batch's routing sources as rows of one tensor (torch only).

Every (B, T, d) source the fused routing calls read (the embedding, the sublayer outputs or block
sums) is written once into its row (slot) of one (capacity, B, T, d) tensor in the sources'
dtype, and every fused call (per call, grouped phase 1, the merge; replace and delta) reads its
sources through that tensor, its int32 slot vector and the row stride B*T*d. The backward writes
each source's gradient into the same row of a gradient buffer of the same shape. The slot vectors
and, per row, whether a call writes or adds its gradient there are fixed by the routing plan and
made once per model and device (`Reads`), so a step's launches take tensors the host never writes
to: nothing is copied from the host during forward and backward, which CUDA graphs need.

Autograd sees O(1) edges per call, ordered by zero-size tokens (docs/DESIGN.md "The depth
buffer"): `DepthBuffer.write` copies a source into its slot and returns a token chained to the
previous write's; every reader takes the newest token. So the backward runs every reader of slot
i (each writing or adding its gradient rows) before the write of slot i, whose backward hands
`grads[i]` to the source's producer. A block recomputed under activation checkpointing writes the
same values into the same slots again.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch
from torch import Tensor


class Reads(NamedTuple):
    """The depth-buffer rows one fused call reads, made once per call site and device.

    slots: int32 (n,) on the device, the rows in the call's source order. accumulate: int32
    (n,), 1 where the call's backward adds its gradient to what a later reader (earlier in the
    backward) wrote into the row, 0 where it is the row's first writer; None: every row written.
    rows: the slots as ints (the host's copy); adds: the slots whose gradient row the call adds
    into, a set."""

    slots: Tensor
    accumulate: Optional[Tensor]
    rows: tuple[int, ...] = ()
    adds: frozenset = frozenset()


def reads(slots: Sequence[int], adds: Sequence[bool], device: torch.device) -> Reads:
    """`Reads` of these slots (ints) and add flags (bools, one per slot) on `device` (one
    host-to-device copy: call once per call site and device, never per step)."""
    table = torch.tensor([list(slots), [int(a) for a in adds]], dtype=torch.int32).to(device)
    return Reads(table[0], table[1] if any(adds) else None, tuple(slots),
                 frozenset(slot for slot, add in zip(slots, adds) if add))


class DepthBuffer:
    """One micro-batch's depth buffer (module docstring).

    values: (capacity, B, T, d) contiguous, in the sources' dtype and on their device. grads: the
    same shape, made at the first backward reader (`gradients`), None before. written: the slots
    whose gradient row holds this backward's sum so far."""

    __slots__ = ("values", "grads", "written")

    def __init__(self, capacity: int, like: Tensor):
        self.values = torch.empty((capacity, *like.shape), dtype=like.dtype, device=like.device)
        self.grads: Optional[Tensor] = None
        self.written: set = set()

    def gradients(self, reads: Reads) -> Tensor:
        """The gradient buffer (values' shape) for a reader of `reads`, made on first use. Each row
        is written by the first reader of its slot in the backward and added into by the others
        (`Reads`). Where a call would add into a row no reader has written in this backward (the
        writer's backward did not run: a loss that does not reach it, or a later backward over
        the same graph, retain_graph, after the row was handed on), the row is zeroed first; the
        models' backward never takes that path (no row is zeroed, `written` is a host-side set)."""
        if self.grads is None:
            self.grads = torch.empty_like(self.values)
        if not self.written.issuperset(reads.adds):
            for slot in reads.adds.difference(self.written):
                self.grads[slot].zero_()
        self.written.update(reads.rows)
        return self.grads

    def write(self, slot: int, source: Tensor, token: Optional[Tensor]) -> Tensor:
        """Copy `source` (B, T, d) into row `slot`; returns the new token (a zero-size tensor),
        chained to `token` (the previous write's, None for the first)."""
        return _Write.apply(source, token, self, slot)


class _Write(torch.autograd.Function):
    """Copy a source into its slot; the backward hands the slot's finished gradient row on."""

    @staticmethod
    def forward(ctx, source: Tensor, token: Optional[Tensor], buffer: DepthBuffer, slot: int) -> Tensor:
        ctx.set_materialize_grads(False)
        ctx.buffer, ctx.slot = buffer, slot
        buffer.values[slot].copy_(source)
        return source.new_empty(0)

    @staticmethod
    def backward(ctx, _token):
        _first_derivative_only()
        grads, slot = ctx.buffer.grads, ctx.slot
        if grads is None or slot not in ctx.buffer.written:  # no reader ran in this backward
            return None, None, None, None
        ctx.buffer.written.discard(slot)  # handed on: a later backward writes it afresh
        return grads[slot], None, None, None


def _first_derivative_only() -> None:
    """Raise where a backward through the depth buffer is asked to build a graph (create_graph):
    its gradient rows are written by the kernels, without one, so a second derivative would
    silently leave the routing's part out."""
    if torch.is_grad_enabled():
        raise RuntimeError("a second derivative through depth routing on the fused kernels is not supported (the "
                           "depth buffer's gradient rows have no graph): use routing_kernel = \"eager\" for "
                           "create_graph=True, or call torch.autograd.grad without it")


def stacked(sources: Sequence[Tensor]) -> tuple[DepthBuffer, Optional[Tensor], Reads]:
    """A depth buffer holding `sources` (N tensors (B, T, d) of one dtype and device) in slots
    0..N-1, its newest token and the `Reads` of all its rows (each written, not added): how a
    call on a list of sources (the public `mhar_kernels.route`, tests, benchmarks) reaches the
    buffer kernels. Costs one copy of each source."""
    buffer = DepthBuffer(len(sources), sources[0])
    token = None
    for slot, source in enumerate(sources):
        token = buffer.write(slot, source, token)
    return buffer, token, Reads(torch.arange(len(sources), dtype=torch.int32, device=sources[0].device), None,
                                tuple(range(len(sources))))
