"""The training step is capture-safe: forward, backward, clipping and the optimizer step read
nothing back from the device and run the same ops at the same shapes every step.

Each family (baseline; MHAR per call, grouped, block granularity, delta mode; AC none and full)
trains three real steps of the debug flavor on CPU through ``Trainer.train``, with
``Trainer.train_step`` (forward, backward, clipping) and ``step_guard.guarded_step`` (optimizer
and EMA step) run under a detector. It records every host read of a tensor's value (aten
``_local_scalar_dense``, ``is_nonzero``, ``equal``: what ``.item()``, ``bool()``, ``int()`` and
``float()`` reach), every op whose output shape depends on the values (``nonzero``,
``masked_select``, ``unique``, boolean indexing, ``repeat_interleave`` without ``output_size``),
and every ``.tolist()``, ``.numpy()``, ``.cpu()`` or ``torch.tensor`` / ``as_tensor`` called from
our own code (a host table rebuilt per step; tables made once per shape, at the first step, are
allowed there: a CUDA graph is captured after a warm-up step). On CPU every tensor is a host tensor, so two reads
are known not to touch the device and are allowed: torch's AdamW reads its step counters, which
live on the CPU unless ``capturable`` (they never wait for the GPU); and with a non-fused
optimizer ``guarded_step`` reads the non-finite flag once before stepping (its documented one
read). A planted ``.item()`` in a block's forward shows the detector fails.
"""
import pathlib
import sys
import traceback

import pytest
import torch
from torch.overrides import TorchFunctionMode
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
HOST_CALLS = {"tolist", "numpy", "cpu", "tensor", "as_tensor", "from_numpy"}
OURS = ("mhar_titan", "mhar_kernels", "/kernels/")


MACHINERY = ("torch/overrides.py", "torch/utils/_python_dispatch.py", "torch/_compile.py",
             "torch/_dynamo/eval_frame.py", "test_capture_safe.py")


def _our_frame() -> str | None:
    """Where the call was made, when that is our own code; None when torch itself made it (its
    optimizer's host-side bookkeeping, say)."""
    for frame in reversed(traceback.extract_stack()):
        if frame.filename.endswith(MACHINERY):
            continue
        if any(part in frame.filename for part in OURS):
            return f"{frame.filename}:{frame.lineno} {frame.line}"
        return None
    return None


class _Ops(TorchDispatchMode):
    """aten level: host reads, value-shaped outputs, and the (op, shapes) trace of the step."""

    def __init__(self, host_tensors):
        super().__init__()
        self.host_tensors, self.faults, self.trace = host_tensors, [], []  # host_tensors() -> set of data_ptr

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.__name__.split(".")[0]
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if name in HOST_READS and not any(t.data_ptr() in self.host_tensors() for t in tensors):
            self.faults.append(f"host read aten.{func.__name__} at {_our_frame() or 'torch'}")
        elif name in VALUE_SHAPED or (name == "repeat_interleave" and kwargs.get("output_size") is None
                                      and tensors):
            self.faults.append(f"value-shaped aten.{func.__name__} at {_our_frame() or 'torch'}")
        elif name == "index" and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                     for i in (args[1] if len(args) > 1 else [])):
            self.faults.append(f"boolean indexing at {_our_frame() or 'torch'}")
        self.trace.append((str(func), tuple(tuple(t.shape) for t in tensors)))
        return func(*args, **kwargs)


class _Calls(TorchFunctionMode):
    """Python level: host copies and host-built tensors made by our own code."""

    def __init__(self):
        super().__init__()
        self.faults = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_CALLS:
            where = _our_frame()
            if where is not None:
                self.faults.append(f"{name}() at {where}")
        return func(*args, **(kwargs or {}))


MADE_ONCE = ("tensor()", "as_tensor()", "from_numpy()")


def step_faults(steps: list[dict]) -> list[list[str]]:
    """Per step, the faults that count: host-built tables only after the first step."""
    return [[f for f in step["faults"] if k > 0 or not f.startswith(MADE_ONCE)] for k, step in enumerate(steps)]


class StepDetector:
    """Wraps the trainer's step parts; ``steps`` collects, per training step, the faults met inside
    them and the aten trace."""

    def __init__(self, trainer, monkeypatch):
        self.trainer, self.steps, self._current = trainer, [], None
        original_step, original_guard = Trainer.train_step, step_guard.guarded_step

        def train_step(this, micro):
            self._current = {"faults": [], "trace": []}
            self.steps.append(self._current)
            return self._watch(lambda: original_step(this, micro), allowed_reads=0)

        def guarded_step(optimizer, ema, finite):
            # the non-fused path's one documented read of the flag
            allowed = 0 if step_guard.skips_on_device(optimizer) else 1
            return self._watch(lambda: original_guard(optimizer, ema, finite), allowed_reads=allowed)

        monkeypatch.setattr(Trainer, "train_step", train_step)
        monkeypatch.setattr(train_module, "guarded_step", guarded_step)

    def _host_tensors(self) -> set[int]:
        """Tensors known to live on the host on every device: non-capturable optimizer step counters."""
        found = set()
        for state in self.trainer.optimizer.state.values():
            step = state.get("step")
            if isinstance(step, torch.Tensor) and not any(
                    g.get("capturable", False) or g.get("fused", False) for g in self.trainer.optimizer.param_groups):
                found.add(step.data_ptr())
        return found

    def _watch(self, fn, allowed_reads: int):
        ops, calls = _Ops(self._host_tensors), _Calls()
        with calls, ops:
            result = fn()
        faults = ops.faults + calls.faults
        reads = [f for f in faults if f.startswith("host read")]
        if allowed_reads and len(reads) <= allowed_reads and all("step_guard" in f for f in reads):
            faults = [f for f in faults if f not in reads]
        self._current["faults"] += faults
        self._current["trace"] += ops.trace
        return result


FAMILIES = {
    "baseline": ["--model.residual=standard", "--model.routing_heads=1"],
    "mhar": [],
    "mhar-grouped": ["--model.routing_group_size=2"],
    "mhar-block": ["--model.routing_granularity=block", "--model.routing_block_layers=2"],
    "mhar-delta": ["--model.routing_mode=delta"],
}


def _train_watched(tmp_path, monkeypatch, name, overrides, steps=3):
    cfg = debug_cfg(tmp_path, name, f"--training.steps={steps}", "--training.local_batch_size=2",
                    "--training.seq_len=16", "--metrics.log_freq=2", *overrides)
    trainer = Trainer(cfg)
    detector = StepDetector(trainer, monkeypatch)
    try:
        trainer.train()
    finally:
        trainer.close()
    assert len(detector.steps) == steps
    return detector.steps


@pytest.mark.parametrize("ac", ["none", "full"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_step_reads_nothing_from_the_device(tmp_path, monkeypatch, family, ac):
    steps = _train_watched(tmp_path, monkeypatch, f"{family}-{ac}",
                           [*FAMILIES[family], f"--activation_checkpoint.mode={ac}"])
    for k, faults in enumerate(step_faults(steps), start=1):
        assert faults == [], f"step {k} of {family} (AC {ac}) is not capture-safe:\n" + "\n".join(faults)
    # the same ops at the same shapes every step (after the first, which creates optimizer state)
    assert steps[1]["trace"] == steps[2]["trace"]


@pytest.mark.parametrize("family", ["mhar", "mhar-grouped"])
def test_fused_adamw_and_ema_step_read_nothing(tmp_path, monkeypatch, family):
    """With fused AdamW the non-finite skip is decided on the device too: not even the flag is read."""
    steps = _train_watched(tmp_path, monkeypatch, f"{family}-fused",
                           [*FAMILIES[family], "--optimizer.implementation=fused", "--training.ema_decay=0.9"])
    for k, faults in enumerate(step_faults(steps), start=1):
        assert faults == [], f"step {k} of {family} (fused AdamW) is not capture-safe:\n" + "\n".join(faults)


def test_a_planted_item_fails(tmp_path, monkeypatch):
    """The detector is not blind: one ``.item()`` in a block's forward is reported, with its place."""
    from mhar_titan.models.model import TransformerBlock

    original = TransformerBlock.forward

    def forward(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if self.layer_id == 1:
            kwargs.get("h", args[0] if args and args[0] is not None else torch.zeros(())).sum().item()
        return out

    monkeypatch.setattr(TransformerBlock, "forward", forward)
    steps = _train_watched(tmp_path, monkeypatch, "planted", [], steps=1)
    assert any("_local_scalar_dense" in f for f in steps[0]["faults"]), steps[0]["faults"]
