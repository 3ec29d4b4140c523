"""The routing kernels' launch side: per-step source tables and a lean `autograd.Function` call.

A routing call's host work must not grow with the number of sources N in Python (N = 73 at 1b,
73 calls per step). Two pieces make it so:

`SourceTable`: every (B, T, d) source shared for routing (`op.share_gradient`, once per source
and micro-batch) is appended to one table, checked once (shape, dtype, device, contiguity,
alignment) and its data pointer, row stride and, once the first reader's backward has made it,
its gradient buffer's pointer written once into a device-resident int64 table (5, capacity):

    row 0: source pointers   row 1: row strides   row 2: gradient-buffer pointers   row 3: ones
    row 4: zeros (rows 3 and 4 are the kernels' per-source "add into the buffer" flags)

Slot 0 holds the call's (d,) null source (row stride 0, broadcast over tokens), sources take
slots 1, 2, ... in the order they were shared. A call whose sources are consecutive entries of
one table (per-call routing reads every earlier source; a grouped site's merge reads its
in-group ones) hands the kernels slices of these rows: no table is built from a Python list,
no per-source check runs (one C-level comparison of the call's gradient sinks with the table's
proves that the sources are the registered ones). A block recomputed under activation
checkpointing remakes its entries on the first forward's sinks (`remake`), so its calls find the
table too. Other calls (sources of several tables, mixed gradient-buffer states) take the general
path, which builds a table per launch as before; both give the same values.

Tables are per micro-batch: a table is referenced by its sources' gradient sinks (no tensor of
the step's activations is held), so it goes when the step's autograd graph goes; a table stops
taking new sources at `MAX_ENTRIES` (a new one starts), so a graph kept alive across steps
cannot grow one without bound. Once every source's gradient buffer was handed on (the
micro-batch's backward is done), the table is kept (up to `_POOL` per shape, dtype and device,
for `_SHAPES` shapes) and the next micro-batch of that shape registers into it: its rows and the views of them that
the launches take are made once per shape, not per step. Nothing of an earlier use reaches a
reused table: a call whose backward runs a second time (retain_graph) takes the general path,
and an earlier sink's hand-off is ignored. On CPU the rows are written through a ctypes view of
their memory (no tensor op per slot); on CUDA each write is a pinned, asynchronous copy on the
current stream, ordered after the launches of the micro-batch that used the rows before.

`apply(function, *args)`: `torch.autograd.Function.apply` without its Python pass over every
argument (functorch's dead-wrapper unwrapping, a generator over the N sources per call): where no
functorch transform is active, the C++ entry is called directly; otherwise the public
`Function.apply`.

`save_with_sources` / `saved_with_sources`: what a routing Function saves for backward. Under
activation checkpointing every tensor that goes through `ctx.save_for_backward` passes through
torch's pack and unpack hooks and its recompute check (about 8 us of Python per tensor, measured
on this project's 2-core CPU machines; at 1b the sources alone are 2,628 of a step's saved
tensors). Two kinds of tensor are kept as plain references instead, with the same check against
in-place changes as `save_for_backward`'s (their versions): the call's parameter rows (the (d,)
pseudo-query, key-norm weight and null source, the (1,) gate; (g, d) for a group), always: they
are views of parameters, alive for the whole step (one kept from inside a checkpointed block
holds d numbers until its backward); and its N sources, where every one is a shared entry that
outlives its block (`op.share_gradient(..., outlives=True)`: an input of a later block, which
activation checkpointing keeps anyway as that block's input, or read by the final site): no
memory the step does not already hold (every such entry is alive when the backward starts, in
both cases). What goes through `save_for_backward` is then the call's own activations only (its
output, the mix residual, the statistics; a grouped state's lse).
"""
from __future__ import annotations

import array
import ctypes
import functools
import weakref
from itertools import repeat
from operator import attrgetter
from typing import Optional, Sequence

import torch
from torch import Tensor

SINK_ATTRIBUTE = "_mhar_gradient_sink"  # the attribute of a shared view that holds its gradient sink
MAX_ENTRIES = 1024  # sources per table (a new table starts beyond)
_CAPACITY = 128  # initial slots; doubled as sources come

_C_APPLY = torch._C._FunctionBase.__dict__["apply"]
_bound: dict = {}


def apply(function: type, *args):
    """`function.apply(*args)` (a `torch.autograd.Function` subclass) with the host cost of one
    C++ call: functorch's unwrapping (a Python pass over the arguments) only runs where a
    functorch transform is active, as in `Function.apply` itself; under torch.compile the public
    `Function.apply` is called."""
    if torch._C._are_functorch_transforms_active() or torch.compiler.is_compiling():
        return function.apply(*args)  # (torch.compile traces Function.apply, not the C++ entry)
    fast = _bound.get(function)
    if fast is None:
        fast = _bound[function] = _C_APPLY.__get__(None, function)
    return fast(*args)


def once_differentiable(backward):
    """`torch.autograd.function.once_differentiable` for a Function's backward without its cost
    where it changes nothing: autograd runs a backward with grad mode off unless the caller asked
    for create_graph, so the backward is called directly there (torch's wrapper would only enter
    no_grad); with grad mode on, torch's wrapper runs (outputs that refuse a second derivative)."""
    wrapped = torch.autograd.function.once_differentiable(backward)

    @functools.wraps(backward)
    def lean(ctx, *grads):
        if torch.is_grad_enabled():
            return wrapped(ctx, *grads)
        return backward(ctx, *grads)
    return lean


_outlives = attrgetter("outlives")
_version = attrgetter("_version")


def keeps_sources(sinks: Sequence) -> bool:
    """True when a call's sources may be kept as plain references (module docstring): there is
    at least one, and each has a gradient sink (`sinks`, one per (B, T, d) source, None for a
    source not shared) whose entry outlives its block."""
    try:
        return bool(sinks) and all(map(_outlives, sinks))
    except AttributeError:  # a source not shared (its sink is None)
        return False


def _kept_version(rows: tuple, sources: tuple) -> int:
    """The sum of the version counters of the kept `rows` (None skipped) and `sources`."""
    return sum(t._version for t in rows if t is not None) + sum(map(_version, sources))


def save_with_sources(ctx, sinks: Sequence, tensors: tuple, sources: Sequence[Tensor], rows: tuple = ()) -> None:
    """`ctx.save_for_backward(*tensors, *sources)` for a routing call with parameter `rows` (None
    where the call has none), except that the rows are kept as plain references with their versions,
    and the sources too where `keeps_sources(sinks)` (module docstring). The choice depends only on
    the sinks, so a block recomputed under activation checkpointing saves as many tensors as its
    first forward did. Read back with `saved_with_sources`; `ctx.sources_kept` tells which."""
    ctx.sources_kept = keeps_sources(sinks)
    kept = tuple(sources) if ctx.sources_kept else ()
    ctx.kept = (rows, kept, _kept_version(rows, kept), len(tensors))
    if ctx.sources_kept:
        ctx.save_for_backward(*tensors)
    else:
        ctx.save_for_backward(*tensors, *sources)


def kept(ctx) -> tuple:
    """The tensors a routing call keeps as plain references (`save_with_sources`): its parameter
    rows (None skipped), then its sources where they are kept; () for a ctx that keeps none."""
    rows, sources, _, _ = getattr(ctx, "kept", ((), (), 0, 0))
    return tuple(t for t in rows if t is not None) + sources


def saved_with_sources(ctx) -> tuple:
    """(*tensors, *rows, *sources) as `save_with_sources` was given them (unpack once: activation
    checkpointing allows no more).

    Raises:
        RuntimeError: a kept row or source was modified in place after the forward (as autograd
            raises for a saved tensor)."""
    saved = ctx.saved_tensors
    rows, sources, version, count = ctx.kept
    if _kept_version(rows, sources) != version:
        raise RuntimeError("one of the routing sources or parameter rows needed for gradient computation has been "
                           "modified by an inplace operation after the routing call; clone it before modifying it")
    if ctx.sources_kept:
        return saved + rows + sources
    return saved[:count] + rows + saved[count:]


def _device_rows(values: Sequence[int], device: torch.device) -> Tensor:
    """int64 tensor of `values` on `device` (pinned + asynchronous copy on CUDA: no host wait)."""
    table = torch.frombuffer(array.array("q", values), dtype=torch.int64)
    if device.type == "cuda":
        return table.pin_memory().to(device, non_blocking=True)
    return table


class SourceTable:
    """The shared (B, T, d) sources of one micro-batch, in sharing order (module docstring).

    Attributes: `sinks` (the `op.GradientSink` of the source in slot i + 1), `pointers` (their
    data pointers, a list), `rows` (5, capacity) int64 on the sources' device, `written`
    (bytearray: 1 where the slot's gradient buffer exists and its pointer is in row 2),
    `aligned` (every registered pointer and gradient pointer on a 16-byte boundary, d % 8 == 0),
    `shape`, `dtype`, `device`."""

    __slots__ = ("sinks", "pointers", "rows", "written", "aligned", "shape", "dtype", "device", "null",
                 "closed", "handed", "_views", "_host", "__weakref__")

    def __init__(self, like: Tensor):
        self.shape, self.dtype, self.device = like.shape, like.dtype, like.device
        # slots are written as sources come (pointer, row stride, one, zero): nothing is cleared up front
        self.rows = torch.empty((5, _CAPACITY), dtype=torch.int64, device=like.device)
        self._host = self._host_view()
        self._views: dict = {}
        self.reset()

    def reset(self) -> None:
        """Empty the table for the next micro-batch (`register` reuses finished tables): the rows and
        the views of them stay (made once per shape), every slot is written again as sources come."""
        self.sinks: list = []
        self.pointers: list[int] = []
        self.written = bytearray(self.rows.shape[1])
        self.aligned = self.shape[-1] % 8 == 0
        self.null: Optional[tuple] = None  # (null parameter, its version, the cast in slot 0)
        self.closed = False  # takes no more sources (its backward has begun)
        self.handed = 0

    def _host_view(self):
        """On CPU the rows' memory as a ctypes int64 array (element writes without a tensor op per
        write); None on CUDA, where each write is a pinned, asynchronous host-to-device copy."""
        if self.device.type == "cuda":
            return None
        return (ctypes.c_int64 * self.rows.numel()).from_address(self.rows.data_ptr())

    def accepts(self, source: Tensor) -> bool:
        """True when `source` can take the next slot: same shape, dtype and device, contiguous."""
        return (not self.closed and len(self.sinks) < MAX_ENTRIES and source.shape == self.shape
                and source.dtype is self.dtype and source.device == self.device and source.is_contiguous())

    def append(self, sink, source: Tensor) -> None:
        """Register `source` (accepted by `accepts`) in the next slot; sets sink.table, sink.slot."""
        slot = len(self.sinks) + 1
        if slot >= self.rows.shape[1]:
            self._grow()
        pointer = source.data_ptr()
        self.sinks.append(sink)
        self.pointers.append(pointer)
        self.aligned = self.aligned and pointer % 16 == 0
        self._write_column(slot, pointer, self.shape[-1])
        sink.table, sink.slot = self, slot

    def _grow(self) -> None:
        rows = torch.empty((5, 2 * self.rows.shape[1]), dtype=torch.int64, device=self.device)
        used = len(self.sinks) + 1  # slot 0 and the sources so far
        rows[:, :used].copy_(self.rows[:, :used])
        self.rows = rows
        self._host = self._host_view()
        self.written.extend(bytearray(len(self.written)))
        self._views.clear()

    def _write_column(self, slot: int, pointer: int, stride: int) -> None:
        """Slot's column in one write: pointer, row stride, no gradient buffer yet (0), one, zero."""
        host = self._host
        if host is None:
            self.rows[:, slot].copy_(_device_rows([pointer, stride, 0, 1, 0], self.device))
            return
        capacity = self.rows.shape[1]
        host[slot] = pointer
        host[capacity + slot] = stride
        host[2 * capacity + slot] = 0
        host[3 * capacity + slot] = 1
        host[4 * capacity + slot] = 0

    def _write(self, row: int, slot: int, values: Sequence[int]) -> None:
        host = self._host
        if host is None:
            self.rows[row, slot:slot + len(values)].copy_(_device_rows(values, self.device))
            return
        at = row * self.rows.shape[1] + slot
        host[at:at + len(values)] = values

    def slots(self, sinks: list) -> Optional[int]:
        """The first slot of the call whose sources have these gradient sinks, when they are
        consecutive entries of this table (else None)."""
        slot = sinks[0].slot
        return slot if self.sinks[slot - 1:slot - 1 + len(sinks)] == sinks else None

    def views(self, first: int, stop: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """(pointers, row strides, gradient pointers, ones, zeros) of slots first..stop-1, views of
        `rows` (made once per range and table)."""
        key = (first, stop)
        found = self._views.get(key)
        if found is None:
            found = self._views[key] = self.rows[:, first:stop].unbind(0)
        return found

    def null_source(self, null: Tensor) -> Optional[Tensor]:
        """The (d,) null source cast to the sources' dtype (a copy the table owns), in slot 0; made
        once per table, parameter version and storage. None when slot 0 holds another null source
        or an older version of this one (the caller takes the general path)."""
        key = (null._version, null.data_ptr())
        if self.null is None:
            # an owned copy: the parameter's own storage may move (FSDP2 frees and regathers it)
            cast = null.to(self.dtype, copy=True)
            self._write_column(0, cast.data_ptr(), 0)  # row stride 0: broadcast over tokens
            self.aligned = self.aligned and cast.data_ptr() % 16 == 0
            self.null = (null, key, cast)
        held, held_key, cast = self.null
        return cast if held is null and held_key == key else None

    def buffers(self, first: int, stop: int, shape, device) -> Optional[bool]:
        """Make sure slots first..stop-1 have gradient buffers with pointers in row 2: True when
        each already had one (the kernel adds into them), False when none had and new ones were
        made (written, not added), None when some had (the caller takes the general path)."""
        if self.written.find(0, first, stop) == -1:
            return True
        if self.written.find(1, first, stop) != -1:
            return None
        sinks = self.sinks[first - 1:stop - 1]
        if len(sinks) != stop - first or any(s.grad is not None for s in sinks):  # released, or made elsewhere
            return None
        grads = [torch.empty(shape, dtype=self.dtype, device=device) for _ in sinks]
        pointers = [g.data_ptr() for g in grads]
        for sink, grad in zip(sinks, grads):
            sink.grad = grad
        self._write(2, first, pointers)
        self.written[first:stop] = b"\x01" * (stop - first)
        self.aligned = self.aligned and all(p % 16 == 0 for p in pointers)
        return False

    def backward_rows(self, lo: int, hi: int, has_null: bool, sources: Sequence[Tensor], shape, device,
                      registered: bool = False) -> Optional[tuple]:
        """For the backward launch of a call whose forward read slots lo..hi-1 (slot 0 its null
        source when has_null): (pointers, row strides, gradient pointers, ones or None (the
        buffers were just made: written, not added), aligned), the rows `route_backward` takes as
        `tables`; None where the saved `sources` are not the registered tensors (a block
        recomputed under activation checkpointing) or their buffers are in mixed states (the
        caller takes the general path). registered: the sources are known to be the registered
        tensors (kept by reference, `save_with_sources`), so their pointers are not compared."""
        first = lo + has_null
        now = None if registered else list(map(Tensor.data_ptr, sources))
        if now is not None and now != self.pointers[first - 1:hi - 1]:
            # the same sources recomputed under activation checkpointing, at other addresses (or, by
            # the allocator's chance, at the same ones): point their slots at the recomputed tensors,
            # so that such a call takes the table path whatever the allocator did.
            if not self.repoint(first, sources):
                return None
        written = self.buffers(first, hi, shape, device)
        if written is None:
            return None
        pointers, strides, grads, ones, _ = self.views(lo, hi)
        return pointers, strides, grads, ones if written else None, self.aligned

    def repoint(self, first: int, sources: Sequence[Tensor]) -> bool:
        """Point slots first.. at `sources`, the recomputed tensors of the entries registered there
        (activation checkpointing). False, changing nothing, where one cannot take its slot (shape,
        dtype, contiguity). Safe: the backward runs from the last block to the first, and a block's
        recomputed sources are read only by that block's own sites (on CUDA the write is ordered
        after the launches that read the slots before, `_write`)."""
        if any(s.shape != self.shape or s.dtype is not self.dtype or not s.is_contiguous() for s in sources):
            return False
        now = list(map(Tensor.data_ptr, sources))
        self.pointers[first - 1:first - 1 + len(now)] = now
        self._write(0, first, now)
        self.aligned = self.aligned and all(p % 16 == 0 for p in now)
        return True

    def holds(self, sink) -> bool:
        """The sink is registered in this table's current use (not one of an earlier use, nor
        let go once every buffer was handed on)."""
        slot = sink.slot
        return slot <= len(self.sinks) and self.sinks[slot - 1] is sink

    def handed_on(self, sink) -> None:
        """The sink's gradient buffer was handed to autograd (the sink emptied). The table then
        takes no new source; once every slot's was, it lets its sinks go (sinks and table refer to
        each other: without this the pair would wait for Python's cycle collector) and may be
        reused (`register`). A sink of an earlier use of the table (a graph's backward run again
        with retain_graph) changes nothing."""
        if not self.holds(sink):
            return
        slot = sink.slot
        self.written[slot] = 0
        self.closed = True
        self.handed += 1
        if self.handed >= len(self.sinks):
            self.sinks = []
            _finished(self)


_current: Optional[weakref.ref] = None
_POOL = 2  # finished tables kept per (shape, dtype, device) for reuse
_SHAPES = 8  # ... for at most this many shapes (the oldest shape's go first)
_free: dict = {}


def _finished(table: SourceTable) -> None:
    """Keep a table whose every gradient buffer was handed on (its micro-batch's backward is done)
    for the next micro-batch of its shape: its rows and their views are made once per shape."""
    key = (table.shape, table.dtype, table.device)
    if key not in _free and len(_free) >= _SHAPES:
        del _free[next(iter(_free))]
    free = _free.setdefault(key, [])
    if len(free) < _POOL and all(t is not table for t in free):
        free.append(table)


def _new_table(like: Tensor) -> SourceTable:
    """A finished table of like's shape, dtype and device, emptied (`SourceTable.reset`), or a new one.
    Safe on CUDA: the rows are rewritten by copies on the current stream, after the launches of
    the micro-batch that used them."""
    free = _free.get((like.shape, like.dtype, like.device))
    if free:
        table = free.pop()
        table.reset()
        return table
    return SourceTable(like)


def remake(sink, source: Tensor) -> bool:
    """`source` is the recomputed tensor of the entry registered with `sink` (activation
    checkpointing recomputes its block inside the backward): True when the recomputed readers can
    take the table path with that sink, its slot then pointing at `source`, which the sink holds
    (`remade`) until its gradient is handed on, so that the first forward's readers, whose
    backwards read the slot next, find it alive (the first tensor may be gone by now: nothing
    holds an entry once the blocks that read it are done). False (the caller shares `source`
    afresh) when the sink is in no table still taking part in this backward, or `source` cannot
    take the slot."""
    table = sink.table
    if table is None or not table.holds(sink) or not table.repoint(sink.slot, (source,)):
        return False
    sink.remade = source
    return True


def register(sink, source: Tensor) -> None:
    """Append the shared `source` (B, T, d) with gradient sink `sink` to the current table, or
    to a new one when the current one is gone or cannot take it (`SourceTable.accepts`).

    Nothing is registered while a backward pass runs: that is a block recomputed under activation
    checkpointing, whose forward only remakes the saved tensors (the backward reads the first
    forward's table), so a table made there would be allocated and written for nothing."""
    global _current
    if torch._C._current_graph_task_id() != -1:
        return
    table = _current() if _current is not None else None
    if table is None or not table.accepts(source):
        if not source.is_contiguous():
            return
        table = _new_table(source)
        _current = weakref.ref(table)
    table.append(sink, source)


def sinks(sources: Sequence[Tensor]) -> list:
    """The gradient sink of each source (None for a source not shared), in one C-level pass."""
    return list(map(getattr, sources, repeat(SINK_ATTRIBUTE), repeat(None)))


def lookup(sinks: list) -> Optional[tuple[SourceTable, int]]:
    """(table, first slot) when the sources with these gradient sinks (a list; None entries for
    unshared sources) are consecutive entries of one table, else None."""
    first = sinks[0]
    if first is None:
        return None
    table = first.table
    if table is None:
        return None
    slot = table.slots(sinks)
    return None if slot is None else (table, slot)
