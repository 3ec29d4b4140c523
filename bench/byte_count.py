"""Count the bytes a CPU training step really moves: every Triton launch and every aten op.

`ByteCounter` is a context (a `TorchDispatchMode` plus a hook on the Triton interpreter's launch
loop; needs TRITON_INTERPRET=1 for the launches) that records one entry per
- Triton launch: the distinct bytes its programs load and the distinct bytes they store (every
  masked-in address of every `tl.load` / `tl.store`, counted once per launch at its element
  size: a launch's repeated reads of one address are cache hits). Slot vectors, read tables and
  flags a kernel loads are counted like any other load. The aten ops the interpreter runs to
  stage the arguments are not counted (on a GPU the kernel reads the tensors in place).
- aten op outside a launch: the bytes of its tensor inputs (read) and outputs (written). Views
  (`OpOverload.is_view`, and ops that return an input's storage without writing it, such as
  `_unsafe_view`), `set_` (a tensor pointed at a storage) and allocations (`empty*`, which write
  nothing) count nothing; an input
  with stride-0 dimensions (an expanded tensor) counts its distinct elements; arguments an op
  only overwrites (`copy_`, `fill_`, `zero_`, `out=`) are written, not read, and the tensor a
  `zeros_like` / `new_zeros`-style factory takes its shape from is not read; an in-place op's self is read and
  written.

`count_step(args, batch, seq, ac)` builds a seeded bf16 model from `ModelArgs` (outside the count)
and counts one training step: forward, cross-entropy loss and backward, and apart from them the
AdamW update.

    python bench/byte_count.py --flavor debug --family mhar --ac none      # one step's entries by kind

Only CPU (the launches are counted inside Triton's interpreter); GB figures at the paper's
micro-batches come from `bench/routing.py --bytes --measure` (`bench/routing_bytes.py`), which extrapolates counts like these.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import sys
import weakref
from dataclasses import dataclass, field
from types import SimpleNamespace

os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

aten = torch.ops.aten
ALLOCATIONS = {aten.empty.memory_format, aten.empty_strided.default, aten.new_empty.default,
               aten.new_empty_strided.default, aten.empty_like.default}
OVERWRITES = {aten.copy_.default, aten.fill_.Scalar, aten.fill_.Tensor, aten.zero_.default}
METADATA = {aten.set_}  # point a tensor at a storage: moves no bytes
# factories that take only the shape, dtype and device of their tensor argument: it is not read
LIKE = {aten.zeros_like, aten.ones_like, aten.full_like, aten.rand_like, aten.randn_like, aten.new_zeros,
        aten.new_ones, aten.new_full}


def distinct_bytes(t: torch.Tensor) -> int:
    """Bytes of the distinct elements of t (dimensions of stride 0 count once)."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= size
    return n * t.element_size() if t.numel() else 0


@dataclass
class Entry:
    """One counted operation: where ("launch" or "aten"), its name (kernel or aten op), bytes."""

    where: str
    name: str
    read: int
    written: int

    @property
    def bytes(self) -> int:
        return self.read + self.written


@dataclass
class _Accesses:
    """The addresses one launch's programs load and store, per element size."""

    loads: dict = field(default_factory=dict)
    stores: dict = field(default_factory=dict)

    def add(self, table: dict, pointers: np.ndarray, mask: np.ndarray, itemsize: int) -> None:
        table.setdefault(itemsize, []).append(np.asarray(pointers)[np.broadcast_to(mask, np.shape(pointers))])

    @staticmethod
    def total(table: dict) -> int:
        return sum(size * np.unique(np.concatenate(parts)).size for size, parts in table.items())


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def _aliases(func, args, out) -> bool:
    """Whether an op that writes none of its arguments returns a tensor on an input's storage
    (`_unsafe_view` and the like: a view under another name)."""
    if any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments):
        return False
    storages = {t.untyped_storage().data_ptr() for t in _tensors(list(args)) if t.numel()}
    return any(t.numel() and t.untyped_storage().data_ptr() in storages for t in _tensors(out))


def read_tensors(func, args, kwargs, out) -> list[torch.Tensor] | None:
    """The tensors an aten op reads (module docstring): None for an op that moves nothing (a view,
    an allocation, `set_`, an alias under another name); its tensor arguments less those it only
    overwrites (`copy_`'s destination, `out=`, a `zeros_like`-style factory's template)."""
    if func.is_view or func in ALLOCATIONS or func.overloadpacket in METADATA or _aliases(func, args, out):
        return None
    overwritten = set()
    if func in OVERWRITES:
        overwritten.add(id(args[0]))
    for name in ("out",):
        for t in _tensors(kwargs.get(name)):
            overwritten.add(id(t))
    if func.overloadpacket in LIKE:
        overwritten.add(id(args[0]))
    return [t for t in _tensors(list(args) + list(kwargs.values())) if id(t) not in overwritten]


class ReadCounter(TorchDispatchMode):
    """`with ReadCounter() as c:` records, for every aten op that reads (`read_tensors`), each
    storage it reads and the distinct bytes it reads of it (weak references: a storage freed later
    reads back as None, so a tensor that later reuses its memory is never taken for it);
    `c.bytes_of(tensors)` sums the bytes the ops read of `tensors`' storages (a depth buffer's
    rows: one op reading n of its rows reads n rows)."""

    def __init__(self):
        super().__init__()
        self.reads: list[tuple[str, list]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        read = read_tensors(func, args, kwargs, out)
        if read:
            storages: dict = {}
            for t in read:
                if t.numel():
                    st = t.untyped_storage()
                    storages[id(st)] = (st, storages.get(id(st), (st, 0))[1] + distinct_bytes(t))
            self.reads.append((str(func.overloadpacket.__name__),
                               [(weakref.ref(st), n) for st, n in storages.values()]))
        return out

    def bytes_of(self, tensors) -> int:
        wanted = {id(t.untyped_storage()): t.untyped_storage() for t in tensors}
        return sum(n for _, refs in self.reads for ref, n in refs
                   if ref() is not None and wanted.get(id(ref())) is ref())


class ByteCounter(TorchDispatchMode):
    """`with ByteCounter() as c:` records c.entries (module docstring); c.total(where=None) sums them."""

    def __init__(self):
        super().__init__()
        self.entries: list[Entry] = []
        self._accesses: _Accesses | None = None
        self._patches = contextlib.ExitStack()

    # aten ops
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self._accesses is not None:
            return out
        read = read_tensors(func, args, kwargs, out)
        if read is None:
            return out
        written = sum(distinct_bytes(t) for t in _tensors(out))
        self.entries.append(Entry("aten", str(func.overloadpacket.__name__), sum(map(distinct_bytes, read)), written))
        return out

    # Triton launches (interpreter)
    def __enter__(self):
        from triton.runtime import interpreter

        counter = self
        launch, load, store = (interpreter.GridExecutor.__call__, interpreter.InterpreterBuilder.create_masked_load,
                               interpreter.InterpreterBuilder.create_masked_store)

        def counted_launch(executor, *args, **kwargs):
            counter._accesses = _Accesses()
            try:
                return launch(executor, *args, **kwargs)
            finally:
                acc, counter._accesses = counter._accesses, None
                counter.entries.append(Entry("launch", executor.fn.__name__, acc.total(acc.loads),
                                             acc.total(acc.stores)))

        def counted_load(builder, ptrs, mask, other, cache_policy, is_volatile):
            if counter._accesses is not None:
                itemsize = interpreter._get_np_dtype(ptrs.get_element_ty()).itemsize
                counter._accesses.add(counter._accesses.loads, ptrs.data, mask.data, itemsize)
            return load(builder, ptrs, mask, other, cache_policy, is_volatile)

        def counted_store(builder, ptrs, value, mask, cache_policy):
            if counter._accesses is not None:
                itemsize = interpreter._get_np_dtype(ptrs.get_element_ty()).itemsize
                counter._accesses.add(counter._accesses.stores, ptrs.data, mask.data, itemsize)
            return store(builder, ptrs, value, mask, cache_policy)

        for owner, name, fn in ((interpreter.GridExecutor, "__call__", counted_launch),
                                (interpreter.InterpreterBuilder, "create_masked_load", counted_load),
                                (interpreter.InterpreterBuilder, "create_masked_store", counted_store)):
            saved = getattr(owner, name)
            setattr(owner, name, fn)
            self._patches.callback(setattr, owner, name, saved)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._patches.close()

    def total(self, where: str | None = None) -> int:
        return sum(e.bytes for e in self.entries if where is None or e.where == where)

    def by_name(self) -> dict[str, int]:
        names: dict[str, int] = {}
        for e in self.entries:
            key = f"{e.where}:{e.name}"
            names[key] = names.get(key, 0) + e.bytes
        return names


def build(args, ac: str = "none", seed: int = 0, query_std: float = 0.3) -> torch.nn.Module:
    """A seeded bf16 Transformer of `args` with activation checkpointing `ac` (none, full) and,
    for routed families, pseudo-queries drawn with std `query_std` (non-uniform routing)."""
    from mhar_titan.models.model import Transformer
    from mhar_titan.parallel import apply_ac

    torch.manual_seed(seed)
    model = Transformer(args)
    model.init_weights()
    model.to(torch.bfloat16)
    routing = getattr(model, "routing", None)
    if routing is not None and hasattr(routing, "query"):  # depth routing's pseudo-queries
        with torch.no_grad():
            routing.query.normal_(0.0, query_std)
    apply_ac(model, SimpleNamespace(mode=ac, selective_ac_option="1", preserve_rng_state=False))
    return model


def count_step(args, batch: int, seq: int, ac: str = "none", seed: int = 0) -> tuple[ByteCounter, ByteCounter]:
    """Count one training step of `build(args, ac)` on `batch` x `seq` random tokens: returns
    (forward + loss + backward, AdamW update), two counters. The update moves a fixed number of
    bytes per parameter whatever the tokens (routing adds (d,) parameters per site), so it is
    kept apart from the token-proportional part that routing's accounting covers."""
    model = build(args, ac, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    tokens = torch.randint(0, args.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(seed + 1))
    with ByteCounter() as step:
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
    with ByteCounter() as update:
        opt.step()
    return step, update


def depth_history_reads(args, batch: int, seq: int, history, seed: int = 0) -> dict:
    """Rows of the depth connection's history read in one bf16 training step of `build(args)` on
    `batch` x `seq` random tokens, counted op by op (`ReadCounter`): {'forward', 'backward'}: the
    bytes the forward and the loss's backward read of the history tensors, in rows of B T d values
    per token. `history(flow)`: the tensors holding the history of the connection's flow after the
    forward (DenseFormer's and MUDDFormer's depth buffer, `flow.buffer.values`); per token and step,
    `Connection.depth_reads` models them."""
    model = build(args, "none", seed)
    flows = []
    start = model.connection.flow

    def flow(*a, **k):
        flows.append(start(*a, **k))
        return flows[-1]

    model.connection.flow = flow
    tokens = torch.randint(0, args.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(seed + 1))
    with ReadCounter() as forward:
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    with ReadCounter() as backward:
        loss.backward()
    kept = list(history(flows[0]))  # alive until the counts are read: no storage of theirs was reused
    row = batch * seq * args.dim * kept[0].element_size()
    return dict(forward=forward.bytes_of(kept) / row, backward=backward.bytes_of(kept) / row)


def residual_additions(args, tokens: int, dtype: torch.dtype, ac: str = "none") -> int:
    """Bytes of the baseline's residual additions, which routed models do not run (routing
    replaces the residual stream): per layer two forward additions x + f(x) and, in backward, the
    two additions of the stream's gradient with the branch's (three (B*T, d) rows each); with AC
    full the attention's addition once more (recomputed; the MLP's is the block's output, which
    non-reentrant checkpointing stops before)."""
    row = tokens * args.dim * torch.empty((), dtype=dtype).element_size()
    return 3 * row * (4 * args.n_layers + (args.n_layers if ac == "full" else 0))


def routing_count(args, batch: int, seq: int, ac: str = "none", baseline: ByteCounter | None = None) -> dict:
    """The counted routing bytes of one step of the routed model `args` (bf16): its forward +
    backward count minus the baseline's (the same flavor with residual="standard"; pass its
    counter as `baseline` to reuse one) plus the baseline's `residual_additions`. Returns
    {'routing', 'routed', 'baseline', 'residual', 'launches', 'copies'} in bytes ('launches': the
    routed step's Triton launches; 'copies': its copy_ ops beyond the baseline's, the sources'
    depth-buffer slot writes among them)."""
    import dataclasses

    if baseline is None:
        baseline, _ = count_step(dataclasses.replace(args, residual="standard"), batch, seq, ac)
    routed, _ = count_step(args, batch, seq, ac)
    residual = residual_additions(args, batch * seq, torch.bfloat16, ac)
    copies = routed.by_name().get("aten:copy_", 0) - baseline.by_name().get("aten:copy_", 0)
    return dict(routing=routed.total() - baseline.total() + residual, routed=routed.total(),
                baseline=baseline.total(), residual=residual, launches=routed.total("launch"), copies=copies)


def _cheap_end(outs_dtype: torch.dtype, b: int, t: int, d: int) -> int:
    """Counted bytes of the harness's stand-in for what follows a routing site (`out.float().sum()`
    and its backward) on one (b, t, d) output."""
    x = torch.zeros(b, t, d, dtype=outs_dtype, requires_grad=True)
    with ByteCounter() as c:
        torch.autograd.grad(x.float().sum(), [x])
    return c.total()


def count_harness(d: int, n: int, family: str, tokens: int, group: int = 1, heads: int = 8,
                  dtype: torch.dtype = torch.bfloat16) -> dict:
    """Counted bytes of one step of the routing-only harness over n (1, tokens, d) sources: every
    site of the step routes over the sources before it (the real per-call plan of sublayer
    routing; `routing_harness.one_step`), or, for family "mhar-grouped", in groups of `group` consecutive
    sites (`routing_harness.one_grouped_step`), Triton kernels, forward and backward. What stands in for
    the sublayers (each site's output summed in fp32, `_cheap_end`) is counted alone and
    subtracted. Returns {'bytes' (the routing's), 'launches' (inside Triton launches), 'end'}."""
    import routing_harness

    sources, query, norm_weight = routing_harness.make_inputs(1, tokens, d, n, dtype, torch.device("cpu"))
    if family == "mhar":
        run = routing_harness.one_step("triton", sources, query, norm_weight, heads)
    else:
        run = routing_harness.one_grouped_step("triton", sources, query, norm_weight, heads, group)
    with ByteCounter() as c:
        run()
    end = n * _cheap_end(dtype, 1, tokens, d)
    return dict(bytes=c.total() - end, launches=c.total("launch"), end=end)


def main(argv=None) -> None:
    from mhar_titan.models.args import FAMILIES, ModelArgs

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--flavor", default="debug")
    p.add_argument("--family", default="mhar H=8", help=f"one of {', '.join(FAMILIES)}")
    p.add_argument("--group", default="1", help="routing_group_size (an int or auto)")
    p.add_argument("--kernel", default="triton")
    p.add_argument("--ac", default="none")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=8)
    a = p.parse_args(argv)
    overrides = dict(FAMILIES[a.family], vocab_size=512)
    if overrides.get("residual") == "attn_res":
        overrides.update(routing_kernel=a.kernel, routing_group_size=a.group if a.group == "auto" else int(a.group))
    counter, update = count_step(ModelArgs.from_flavor(a.flavor, **overrides), a.batch, a.seq, a.ac)
    for name, nbytes in sorted(counter.by_name().items(), key=lambda kv: -kv[1]):
        print(f"{nbytes:>12,}  {name}")
    print(f"{counter.total():>12,}  forward + backward ({counter.total('launch'):,} in launches); "
          f"AdamW update {update.total():,}")


if __name__ == "__main__":
    from mhar_titan.cli_args import run_command

    run_command(main)
