"""The fused routing path is capture-safe (`routing_kernel = "triton"`, under the Triton
interpreter on CPU): test_capture_safe.py's detector over three real training steps of every
routed family (per call, grouped, block granularity, delta mode; AC none and full; document
masking, ``attn_mask_type = "block_causal"``, for per call and grouped). Steps 2 and 3 (step 1 is
the warm-up a graph capture also has) must read no ``data_ptr()`` in our code, make no tensor
from host data, copy nothing from the host (no pinned or non_blocking copy, no ctypes write), read
nothing back, and launch the same Triton kernels with the same non-tensor arguments and grids;
step 1 may make a table once (``test_capture_safe.step_faults``).

The shapes are the debug flavor's at two layers (block granularity: one layer per block, two
blocks) and one micro-batch of 1 x 16 tokens, logging only at the first and last step (its
routing entropy runs the fused kernels outside the step): the interpreter runs every op of a
kernel in Python.
"""
import pytest
import test_capture_safe as detector
from test_capture_safe import FAMILIES, _train_watched, assert_capture_safe

pytestmark = detector.pytestmark  # the Shakespeare sample, one intra-op thread

pytest.importorskip("triton")

SMALL = ["--model.routing_kernel=triton", "--model.n_layers=2", "--metrics.log_freq=1000"]
SHAPES = {"mhar-block": ["--model.routing_block_layers=1"]}  # two blocks of the two layers
BLOCK_CAUSAL = ["--model.attn_mask_type=block_causal"]
CASES = [(family, ac, []) for family in ("mhar", "mhar-grouped", "mhar-block", "mhar-delta") for ac in ("none", "full")]
CASES += [("mhar", "none", BLOCK_CAUSAL), ("mhar-grouped", "full", BLOCK_CAUSAL)]


@pytest.mark.parametrize("family,ac,mask", CASES,
                         ids=[f"{f}-{ac}{'-block_causal' if m else ''}" for f, ac, m in CASES])
def test_fused_step_is_capture_safe(tmp_path, monkeypatch, family, ac, mask):
    what = f"{family} (routing_kernel triton, AC {ac}{', block_causal' if mask else ''})"
    overrides = [*FAMILIES[family], *SMALL, *SHAPES.get(family, []), *mask, f"--activation_checkpoint.mode={ac}"]
    steps = _train_watched(tmp_path, monkeypatch, f"{family}-{ac}-fused", overrides, batch=1)
    launched = [len(step["launches"]) for step in steps]
    assert min(launched) > 0, f"{what}: a step launched no Triton kernel ({launched}): the fused path did not run"
    assert_capture_safe(steps, what)
