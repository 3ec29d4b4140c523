"""The training step is capture-safe: forward, backward, clipping and the optimizer step read
nothing back from the device, write nothing from the host, and run the same ops at the same
shapes, and the same Triton launches, every step.

Each family (baseline; MHAR per call, grouped, block granularity, delta mode; AC none and full)
trains three real steps of the debug flavor on CPU through ``Trainer.train``, with
``Trainer.train_step`` (forward, backward, clipping) and ``step_guard.guarded_step`` (optimizer
and EMA step) run under a detector (``StepDetector``; tests/test_capture_safe_fused.py runs the
fused routing kernels under it). It records:

- every host read of a tensor's value (aten ``_local_scalar_dense``, ``is_nonzero``, ``equal``:
  what ``.item()``, ``bool()``, ``int()`` and ``float()`` reach) and every op whose output shape
  depends on the values (``nonzero``, ``masked_select``, ``unique``, boolean indexing,
  ``repeat_interleave`` without ``output_size``);
- every call of our own code that reads a tensor to the host or makes one from host data or
  copies it to the device: ``.tolist()``, ``.numpy()``, ``.cpu()``, ``.cuda()``,
  ``torch.tensor`` / ``as_tensor`` / ``asarray`` / ``from_numpy`` / ``frombuffer``,
  ``pin_memory()``, a ``non_blocking`` ``copy_`` or ``to`` (on CPU the code is judged by what it
  asks for), and at the aten level a copy from a CPU tensor into a device one (tables made once
  per shape, at the first step, are allowed there: a CUDA graph is captured after a warm-up step);
- every ``data_ptr()`` (of a tensor or a storage) read by our own code, and every ctypes view
  made over raw memory (``from_address``, ``from_buffer``: how a pointer table is written from the
  host without a tensor op): a graph replays the pointers of its capture, so a step must not need
  fresh ones (Triton's own launcher reads its arguments' pointers: allowed);
- every Triton launch (``StepDetector.launches``): the kernel, its grid and its arguments, a
  tensor as its dtype and shape, anything else (ints, floats, constexprs) as it is, in launch
  order; a replayed graph repeats its capture's launches, so steps 2 and 3 must launch the same.

"Our own code" is a frame in mhar_titan, mhar_kernels or kernels/ (``_our_frame``), torch's and
Triton's own calls are theirs. The Python calls are seen by wrapping the torch functions and
methods for the test's duration (``HOST_CALLS``), not by a TorchFunctionMode: autograd runs a
custom Function's backward with torch-function modes off, so a mode sees the forward only. On CPU every tensor is a host tensor, so two reads are known not
to touch the device and are allowed: torch's AdamW reads its step counters, which live on the
CPU unless ``capturable`` (they never wait for the GPU); and with a non-fused optimizer
``guarded_step`` reads the non-finite flag once before stepping (its documented one read).
Planted faults show the detector fails: an ``.item()`` in a block's forward; a routing call that
writes a pointer table from the host (data_ptr(), frombuffer, a non_blocking copy, a ctypes
write) and launches a Triton kernel with a per-call argument; a pointer read and host copy in a
routing backward.
"""
import array
import ctypes
import functools
import inspect
import itertools
import linecache
import pathlib
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from train_common import SAMPLE, debug_cfg  # noqa: E402

import mhar_titan.train as train_module  # noqa: E402
from mhar_titan.components import step_guard  # noqa: E402
from mhar_titan.train import Trainer  # noqa: E402

pytestmark = [
    pytest.mark.skipif(not (SAMPLE / "validation-00000-of-00001.parquet").exists(),
                       reason="run `python -m mhar_titan.data.prepare_shakespeare --out data/shakespeare`"),
    pytest.mark.usefixtures("one_thread"),
]

HOST_READS = {"_local_scalar_dense", "is_nonzero", "equal"}
VALUE_SHAPED = {"nonzero", "masked_select", "unique_dim", "_unique", "_unique2", "unique_consecutive",
                "unique_dim_consecutive"}
HOST_CALLS = {torch.Tensor: ("tolist", "numpy", "cpu", "cuda", "pin_memory", "data_ptr"),
              torch: ("tensor", "as_tensor", "asarray", "from_numpy", "frombuffer"),
              torch.UntypedStorage: ("data_ptr",)}
"""The Python calls of our code that read, build or copy host data (wrapped by `StepDetector`)."""
COPIES = ("copy_", "to")  # Tensor methods that take non_blocking (a host-to-device copy's flag): a fault with it
CTYPES_VIEWS = ("ctypes.cdata", "ctypes.cdata/buffer")  # audit events of from_address / from_buffer
OURS = ("mhar_titan", "mhar_kernels", "/kernels/")


MACHINERY = ("torch/overrides.py", "torch/utils/_python_dispatch.py", "torch/_compile.py",
             "torch/_dynamo/eval_frame.py", "test_capture_safe.py")


def _our_frame() -> str | None:
    """Where the call was made, when that is our own code; None when torch or Triton itself made
    it (its optimizer's host-side bookkeeping, say, or a launcher reading its arguments' pointers).
    Walks the frames without formatting them (it runs for every data_ptr() read)."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.endswith(MACHINERY):
        frame = frame.f_back
    if frame is None or not any(part in frame.f_code.co_filename for part in OURS):
        return None
    filename, line = frame.f_code.co_filename, frame.f_lineno
    return f"{filename}:{line} {linecache.getline(filename, line).strip()}"


_pointer = torch._C.TensorBase.data_ptr  # the detector's own pointer reads (not the wrapped method)


class _Ops(TorchDispatchMode):
    """aten level: host reads, value-shaped outputs, copies from the host into a device tensor,
    and the (op, shapes) trace of the step."""

    def __init__(self, host_tensors):
        super().__init__()
        self.host_tensors, self.faults, self.trace = host_tensors, [], []  # host_tensors() -> set of data_ptr

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.__name__.split(".")[0]
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if name in HOST_READS and not any(_pointer(t) in self.host_tensors() for t in tensors):
            self.faults.append(f"host read aten.{func.__name__} at {_our_frame() or 'torch'}")
        elif name in VALUE_SHAPED or (name == "repeat_interleave" and kwargs.get("output_size") is None
                                      and tensors):
            self.faults.append(f"value-shaped aten.{func.__name__} at {_our_frame() or 'torch'}")
        elif name == "index" and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                     for i in (args[1] if len(args) > 1 else [])):
            self.faults.append(f"boolean indexing at {_our_frame() or 'torch'}")
        elif self._host_to_device(name, args, kwargs):
            self.faults.append(f"host-to-device aten.{func.__name__} at {_our_frame() or 'torch'}")
        if func.namespace != "profiler":  # record_function marks (FSDP's, say): no work, not captured
            self.trace.append((str(func), tuple(tuple(t.shape) for t in tensors)))
        return func(*args, **kwargs)

    @staticmethod
    def _host_to_device(name, args, kwargs) -> bool:
        """A copy from a CPU tensor into a tensor on another device (never on a CPU-only run)."""
        if name == "copy_" and len(args) > 1 and isinstance(args[1], torch.Tensor):
            return args[1].device.type == "cpu" and args[0].device.type != "cpu"
        if name == "_to_copy" and args and isinstance(args[0], torch.Tensor):
            target = kwargs.get("device")
            return args[0].device.type == "cpu" and target is not None and torch.device(target).type != "cpu"
        return False


MADE_ONCE = ("tensor()", "as_tensor()", "asarray()", "from_numpy()", "frombuffer()", "pin_memory()",
             "non_blocking ", "host-to-device ", "data_ptr()")
"""Faults allowed at the first step (the warm-up before a capture): a table made once per shape,
copied to the device once, its pointers read once."""


def step_faults(steps: list[dict]) -> list[list[str]]:
    """Per step, the faults that count: host-built tables only after the first step."""
    return [[f for f in step["faults"] if k > 0 or not f.startswith(MADE_ONCE)] for k, step in enumerate(steps)]


_ctypes_listener = None  # a StepDetector's while it is installed


def _audit(event: str, args: tuple) -> None:
    if event in CTYPES_VIEWS and _ctypes_listener is not None:
        _ctypes_listener(event, args)


@functools.cache
def _audit_hook() -> None:
    """Installs `_audit` once per process (an audit hook cannot be removed: it does nothing while
    no detector listens)."""
    sys.addaudithook(_audit)


def _launch_value(value):
    """How a launch argument is compared between steps: a tensor by its dtype and shape, anything
    else (an int, a float, a constexpr, a Triton dtype) as it is."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, tuple(value.shape))
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def trace_difference(first: list, second: list) -> str | None:
    """None when two steps' aten traces (`_Ops.trace`) are identical, else one line naming the first
    op that differs (op and input shapes in each step) and the two lengths."""
    for k, (a, b) in enumerate(itertools.zip_longest(first, second)):
        if a != b:
            return f"op {k} is {a} in one step, {b} in the other ({len(first)} vs {len(second)} ops)"
    return None


def launch_difference(first: list, second: list) -> str | None:
    """None when two steps' Triton launches (`StepDetector.launches`' records) are identical, else
    one line naming the first launch that differs, its kernel and the arguments that differ."""
    for k, (a, b) in enumerate(itertools.zip_longest(first, second)):
        if a == b:
            continue
        if a is None or b is None:
            return f"launch {k}: {a and a[0]} in one step, {b and b[0]} in the other ({len(first)} vs {len(second)})"
        if a[0] != b[0]:
            return f"launch {k}: kernel {a[0]} in one step, {b[0]} in the other"
        changed = [f"{name}: {x!r} then {y!r}" for (name, x), (_, y) in zip(a[1], b[1]) if x != y]
        return f"launch {k} of {a[0]} differs: " + "; ".join(changed)
    return None


class StepDetector:
    """Wraps the trainer's step parts; ``steps`` collects, per training step, the faults met inside
    them ("faults"), the aten trace ("trace") and the Triton launches ("launches": per launch
    (kernel name, ((argument name, value), ...)), values as `_launch_value` gives them, the grid
    first)."""

    def __init__(self, trainer, monkeypatch):
        self.trainer, self.steps, self._current, self._extra = trainer, [], None, None
        original_step, original_guard = Trainer.train_step, step_guard.guarded_step

        def train_step(this, micro):
            self._current = {"faults": [], "trace": [], "launches": []}
            self.steps.append(self._current)
            return self._watch(lambda: original_step(this, micro), allowed_reads=0)

        def guarded_step(optimizer, ema, finite):
            # the non-fused path's one documented read of the flag
            allowed = 0 if step_guard.skips_on_device(optimizer) else 1
            return self._watch(lambda: original_guard(optimizer, ema, finite), allowed_reads=allowed)

        monkeypatch.setattr(Trainer, "train_step", train_step)
        monkeypatch.setattr(train_module, "guarded_step", guarded_step)
        for owner, names in HOST_CALLS.items():
            for name in names:
                monkeypatch.setattr(owner, name, self._noted(getattr(owner, name), name))
        for name in COPIES:
            monkeypatch.setattr(torch.Tensor, name, self._noted(getattr(torch.Tensor, name), name, copy=True))
        _audit_hook()
        monkeypatch.setattr(sys.modules[__name__], "_ctypes_listener", self._ctypes_view)
        try:
            from triton.runtime.interpreter import InterpretedFunction
            from triton.runtime.jit import JITFunction
        except ImportError:  # no Triton: nothing launches
            return
        for kind in (JITFunction, InterpretedFunction):
            monkeypatch.setattr(kind, "run", self._recorded(kind.run))

    def _noted(self, function, name: str, copy: bool = False):
        """`function` noting each call of our own code inside a watched step part (a copy: only
        with non_blocking=True, as a keyword or copy_'s third argument)."""
        @functools.wraps(function)
        def noted(*args, **kwargs):
            if self._extra is not None:
                blocking = copy and not (kwargs.get("non_blocking") is True
                                         or (name == "copy_" and len(args) > 2 and args[2] is True))
                where = None if blocking else _our_frame()
                if where is not None:
                    self._extra.append(f"{'non_blocking ' if copy else ''}{name}() at {where}")
            return function(*args, **kwargs)
        return noted

    def _ctypes_view(self, event: str, args: tuple) -> None:
        where = _our_frame() if self._extra is not None else None
        if where is not None:
            self._extra.append(f"ctypes view of memory ({event}: host writes into it) at {where}")

    def _recorded(self, run):
        """A Triton kernel class's `run` that appends each launch inside a watched step part to
        the step's "launches"."""
        def recorded(kernel, *args, grid, warmup, **kwargs):
            if self._extra is not None and not warmup:
                shown = grid(dict(zip(kernel.arg_names, args), **kwargs)) if callable(grid) else grid
                values = [("grid", tuple(shown) if isinstance(shown, (tuple, list)) else (shown,))]
                values += [(name, _launch_value(v)) for name, v in zip(kernel.arg_names, args)]
                values += [(name, _launch_value(v)) for name, v in sorted(kwargs.items())]
                self._current["launches"].append((kernel.__name__, tuple(values)))
            return run(kernel, *args, grid=grid, warmup=warmup, **kwargs)
        return recorded

    def _host_tensors(self) -> set[int]:
        """Tensors known to live on the host on every device: non-capturable optimizer step counters."""
        found = set()
        for state in self.trainer.optimizer.state.values():
            step = state.get("step")
            if isinstance(step, torch.Tensor) and not any(
                    g.get("capturable", False) or g.get("fused", False) for g in self.trainer.optimizer.param_groups):
                found.add(_pointer(step))
        return found

    def _watch(self, fn, allowed_reads: int):
        ops, self._extra = _Ops(self._host_tensors), []
        try:
            with ops:
                result = fn()
        finally:
            calls, self._extra = self._extra, None
        faults = ops.faults + calls
        reads = [f for f in faults if f.startswith("host read")]
        if allowed_reads and len(reads) <= allowed_reads and all("step_guard" in f for f in reads):
            faults = [f for f in faults if f not in reads]
        self._current["faults"] += faults
        self._current["trace"] += ops.trace
        return result


def summary(faults: list[str]) -> str:
    """The faults one per line, each with its count, in the order first met."""
    counts: dict = {}
    for fault in faults:
        counts[fault] = counts.get(fault, 0) + 1
    return "\n".join(f"{n}x {fault}" for fault, n in counts.items())


FAMILIES = {
    "baseline": ["--model.residual=standard", "--model.routing_heads=1"],
    "mhar": [],
    "mhar-grouped": ["--model.routing_group_size=2"],
    "mhar-block": ["--model.routing_granularity=block", "--model.routing_block_layers=2"],
    "mhar-delta": ["--model.routing_mode=delta"],
    "dense": ["--model.residual=dense"],
    "mudd": ["--model.residual=mudd"],
    "mudd-plain": ["--model.residual=mudd", "--model.mudd_prepost_norm=false"],
    "hyper": ["--model.residual=hyper"],
    "hyper-static": ["--model.residual=hyper", "--model.hyper_dynamic=false"],
    "mhc": ["--model.residual=mhc"],
    "mhc-mean": ["--model.residual=mhc", "--model.mhc_exit=mean"],
}


def _train_watched(tmp_path, monkeypatch, name, overrides, steps=3, batch=2, seq_len=16):
    cfg = debug_cfg(tmp_path, name, f"--training.steps={steps}", f"--training.local_batch_size={batch}",
                    f"--training.seq_len={seq_len}", "--metrics.log_freq=2", *overrides)
    trainer = Trainer(cfg)
    detector = StepDetector(trainer, monkeypatch)
    try:
        trainer.train()
    finally:
        trainer.close()
    assert len(detector.steps) == steps
    return detector.steps


def assert_capture_safe(steps: list[dict], what: str) -> None:
    """Every step's faults (`step_faults`) are none, and steps 2 and 3 run the same aten ops at the
    same shapes and the same Triton launches (the first step creates the optimizer state). One
    message names everything found, step by step, with its place."""
    found = [f"step {k}:\n{summary(faults)}" for k, faults in enumerate(step_faults(steps), start=1) if faults]
    difference = trace_difference(steps[1]["trace"], steps[2]["trace"])
    if difference is not None:
        found.append(f"steps 2 and 3 run different aten ops: {difference}")
    difference = launch_difference(steps[1]["launches"], steps[2]["launches"])
    if difference is not None:
        found.append(f"steps 2 and 3 launch different Triton kernels: {difference}")
    assert not found, f"{what} is not capture-safe:\n" + "\n".join(found)


@pytest.mark.parametrize("ac", ["none", "full"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_step_reads_nothing_from_the_device(tmp_path, monkeypatch, family, ac):
    steps = _train_watched(tmp_path, monkeypatch, f"{family}-{ac}",
                           [*FAMILIES[family], f"--activation_checkpoint.mode={ac}"])
    assert_capture_safe(steps, f"{family} (AC {ac})")


@pytest.mark.parametrize("family", ["mhar", "mhar-grouped"])
def test_fused_adamw_and_ema_step_read_nothing(tmp_path, monkeypatch, family):
    """With fused AdamW the non-finite skip is decided on the device too: not even the flag is read."""
    steps = _train_watched(tmp_path, monkeypatch, f"{family}-fused",
                           [*FAMILIES[family], "--optimizer.implementation=fused", "--training.ema_decay=0.9"])
    for k, faults in enumerate(step_faults(steps), start=1):
        assert faults == [], f"step {k} of {family} (fused AdamW) is not capture-safe:\n" + summary(faults)


def test_a_planted_item_fails(tmp_path, monkeypatch):
    """The detector is not blind: one ``.item()`` in a block's forward is reported, with its place."""
    from mhar_titan.models.model import TransformerBlock

    original = TransformerBlock.forward

    def forward(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if self.layer_id == 1:
            carried = args[0] if args else kwargs["carried"]
            h = carried.h if hasattr(carried, "h") else carried  # depth routing's BlockInput, or the stream
            (h if h is not None else torch.zeros(())).sum().item()
        return out

    monkeypatch.setattr(TransformerBlock, "forward", forward)
    steps = _train_watched(tmp_path, monkeypatch, "planted", [], steps=1)
    assert any("_local_scalar_dense" in f for f in steps[0]["faults"]), steps[0]["faults"]


def test_a_planted_pointer_table_fails(tmp_path, monkeypatch):
    """The detector sees a routing call that writes a pointer table from the host, as the fused
    kernels' source tables were written: every routing call of the eager MHAR model first reads
    its sources' data_ptr()s, makes an int64 table of them with torch.frombuffer and copies it
    with non_blocking=True, writes a second one through a ctypes view of a tensor's memory, and
    launches a Triton kernel reading the table with the call's running count as an argument (a
    per-step value baked into the launch). Each is reported in steps 2 and 3 at the routing site
    that called, and the launches of steps 2 and 3 differ in that argument."""
    triton = pytest.importorskip("triton")
    import triton.language as tl
    from mhar_kernels import dispatch

    @triton.jit
    def copy_table(table, out, n, call, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(out + i, tl.load(table + i, mask=i < n, other=0) + call * 0, mask=i < n)

    original, calls, last = dispatch.route, itertools.count(), []

    def route(sources, *args, **kwargs):
        full = [s for s in sources if s.dim() == 3]
        pointers = [s.data_ptr() for s in full]
        table = torch.frombuffer(array.array("q", pointers), dtype=torch.int64).to(full[0].device, non_blocking=True)
        written = torch.empty(len(pointers), dtype=torch.int64, device=full[0].device)
        (ctypes.c_int64 * len(pointers)).from_address(written.data_ptr())[:] = pointers
        out = torch.empty_like(written)
        copy_table[(1,)](written, out, len(pointers), next(calls), BLOCK=triton.next_power_of_2(len(pointers)))
        last[:] = out, pointers
        return original(sources, *args, **kwargs)

    monkeypatch.setattr(dispatch, "route", route)
    steps = _train_watched(tmp_path, monkeypatch, "planted-table", FAMILIES["mhar"])
    site = "router.py"  # the routing call's place in our code (the plant itself is not ours)
    for k, faults in enumerate(step_faults(steps)[1:], start=2):
        for kind in ("data_ptr() at", "frombuffer() at", "non_blocking to() at", "ctypes view of memory"):
            assert any(f.startswith(kind) and site in f for f in faults), \
                f"step {k}: no {kind!r} fault at {site}:\n{summary(faults)}"
    with pytest.raises(AssertionError) as failed:
        assert_capture_safe(steps, "the planted model")
    assert "steps 2 and 3 launch different Triton kernels: launch 0 of copy_table differs: call: " in str(failed.value)
    table, pointers = last
    assert table.tolist() == pointers  # the planted kernel ran and copied the table it was given


def test_a_planted_pointer_read_in_backward_fails(tmp_path, monkeypatch):
    """The backward is watched too (autograd runs a custom Function's backward with torch-function
    modes off, which is why the calls are wrapped instead): the eager routing backward's key
    recompute, made to read its source's data_ptr() and copy a table of it with non_blocking=True,
    is reported at its line in `_DepthRoute.backward`."""
    from mhar_kernels import reference

    original = reference._normalised_key

    def normalised_key(source, rstd, cdt):
        table = torch.frombuffer(array.array("q", [source.data_ptr()]), dtype=torch.int64)
        torch.empty_like(table).copy_(table, non_blocking=True)
        return original(source, rstd, cdt)

    monkeypatch.setattr(reference, "_normalised_key", normalised_key)
    steps = _train_watched(tmp_path, monkeypatch, "planted-backward", FAMILIES["mhar"], steps=1)
    lines, first = inspect.getsourcelines(reference._DepthRoute.backward)
    backward = tuple(f"reference.py:{first + k} " for k in range(len(lines)))
    for kind in ("data_ptr() at", "frombuffer() at", "non_blocking copy_() at"):
        assert any(f.startswith(kind) and any(line in f for line in backward) for f in steps[0]["faults"]), \
            f"no {kind!r} fault in _DepthRoute.backward:\n{summary(steps[0]['faults'])}"
