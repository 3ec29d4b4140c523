"""What the fused routing kernels did with a depth buffer, in order (a helper for the depth-buffer
tests and the FSDP2 workers, no tests here; the real functions still run).

`recording()` logs every launch over depth-buffer rows (per call and merge: `route_forward` /
`route_backward`; grouped phase 1: `phase1_forward` / `phase1_backward`) with its slot vector and,
backward, its per-row add flags; every slot write (`DepthBuffer.write`, also a block's recompute
under activation checkpointing, with whether it wrote the values the row already held); and every
hand-on of a finished gradient row to the source's producer (`_Write.backward`).
`check_order(log)` then asserts the depth buffer's contract (docs/DESIGN.md "The depth buffer")
on what really ran.
"""
from __future__ import annotations

import contextlib
import inspect
from typing import NamedTuple, Optional

import torch

from mhar_kernels import depth_buffer, triton_grouped, triton_routing


class Event(NamedTuple):
    """kind: "read" (a forward launch), "grad" (a backward launch), "write" (a slot write),
    "hand" (a slot's gradient row handed on). values: the buffer's values tensor (identifies the
    buffer). call: the launch's slot vector (identifies the call: the models reuse one per call
    site), None for writes and hands. rows: the slots read, or the one slot written / handed on.
    flags: backward launches, per row 1 where it adds into the gradient row, 0 where it writes it;
    writes inside the backward (a recompute), whether the row already held exactly these values;
    else None. backward: whether it ran inside the backward."""

    kind: str
    values: torch.Tensor
    call: Optional[torch.Tensor]
    rows: tuple
    flags: object
    backward: bool


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


@contextlib.contextmanager
def recording():
    """Yield a list that receives an `Event` for everything the fused kernels did with a depth
    buffer inside the block (the patched functions are restored after it)."""
    log: list[Event] = []
    patched = []

    def patch(owner, name, value):
        patched.append((owner, name, owner.__dict__[name]))
        setattr(owner, name, value)

    def launches(module, name, backward):
        real = getattr(module, name)
        signature = inspect.signature(real)

        def wrapper(*args, **kwargs):
            given = signature.bind(*args, **kwargs).arguments  # every launcher names them so
            values, slots = given.get("values"), given.get("slots")
            if slots is not None and slots.numel():
                rows = tuple(slots.tolist())
                if backward:
                    adds = given.get("accumulate")
                    flags = tuple(adds.tolist()) if adds is not None else (0,) * len(rows)
                    log.append(Event("grad", values, slots, rows, flags, True))
                else:
                    log.append(Event("read", values, slots, rows, None, _in_backward()))
            return real(*args, **kwargs)

        patch(module, name, wrapper)

    launches(triton_routing, "route_forward", False)
    launches(triton_routing, "route_backward", True)
    launches(triton_grouped, "phase1_forward", False)
    launches(triton_grouped, "phase1_backward", True)
    write = depth_buffer.DepthBuffer.write

    def recording_write(buffer, slot, source, token):
        backward = _in_backward()
        same = torch.equal(buffer.values[slot], source.detach()) if backward else None
        log.append(Event("write", buffer.values, None, (slot,), same, backward))
        return write(buffer, slot, source, token)

    patch(depth_buffer.DepthBuffer, "write", recording_write)
    hand = depth_buffer._Write.backward

    def recording_hand(ctx, token_grad):
        log.append(Event("hand", ctx.buffer.values, None, (ctx.slot,), None, True))
        return hand(ctx, token_grad)

    patch(depth_buffer._Write, "backward", staticmethod(recording_hand))
    try:
        yield log
    finally:
        for owner, name, value in reversed(patched):
            setattr(owner, name, value)



def check_order(log: list[Event]) -> dict:
    """Assert, for every depth buffer in `log` and every slot some call read in its forward:
    each reader's backward ran once, in reverse forward order (docs/DESIGN.md "The depth
    buffer", Ordering), so the last reader in the forward writes the gradient row (flag 0) and
    every other adds into it (flag 1), as the flags say; the slot's gradient row was handed on
    exactly once, after every reader's backward (the token chain); and a write inside the
    backward (a recompute) put back exactly the values the row held. Returns
    counts: buffers, slots, reads (forward launches outside recompute), shared (slots with more
    than one reader), rewrites (slot writes inside the backward)."""
    buffers: list[torch.Tensor] = []
    for event in log:
        if not any(event.values is b for b in buffers):
            buffers.append(event.values)
    counts = dict(buffers=0, slots=0, reads=0, shared=0, rewrites=0)
    for values in buffers:
        mine = [(i, e) for i, e in enumerate(log) if e.values is values]
        reads = [e for _, e in mine if e.kind == "read" and not e.backward]
        if not reads:
            continue
        counts["buffers"] += 1
        counts["reads"] += len(reads)
        rewrites = [e for _, e in mine if e.kind == "write" and e.backward]
        assert all(e.flags for e in rewrites), "a recompute wrote other values into a slot"
        counts["rewrites"] += len(rewrites)
        for slot in sorted({row for e in reads for row in e.rows}):
            readers = [e.call for e in reads if slot in e.rows]
            backward = [(i, e.call, e.flags[e.rows.index(slot)])
                        for i, e in mine if e.kind == "grad" and slot in e.rows]
            assert len(backward) == len(readers), f"slot {slot}: {len(readers)} readers, {len(backward)} backwards"
            assert all(c is r for (_, c, _), r in zip(backward, reversed(readers))), \
                f"slot {slot}: its readers' backwards did not run in reverse forward order"
            flags = [flag for _, _, flag in backward]
            assert flags == [0] + [1] * (len(backward) - 1), f"slot {slot}: add flags in backward order {flags}"
            hands = [i for i, e in mine if e.kind == "hand" and e.rows == (slot,)]
            assert len(hands) == 1, f"slot {slot}: handed on {len(hands)} times"
            assert hands[0] > backward[-1][0], f"slot {slot}: its gradient row was handed on before a reader added"
            counts["slots"] += 1
            counts["shared"] += len(readers) > 1
    return counts
