"""The complete byte count of a CPU training step (bench/byte_count.py; issue 21, acceptance 1):
every aten op outside a Triton launch (a dispatch mode) and every launch (the distinct addresses
its programs load and store, Triton interpreter), and `bench/routing.py`'s modelled routing bytes
(`mhar_kernels.traffic` + the routing parameters' gradient assembly) against it: routed step minus
baseline step plus the baseline's residual additions, at the debug flavor, bf16."""
from __future__ import annotations

import dataclasses
import pathlib
import sys

import pytest
import torch

from mhar_titan.models.args import ModelArgs

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
import byte_count  # noqa: E402
import routing as routing_bench  # noqa: E402

BATCH, SEQ = 2, 8


def test_counter_counts_ops_and_launches_by_hand():
    """An add of two (4, 8) bf16 tensors reads 128 and writes 64 bytes; a view and an allocation
    count nothing; copy_ reads its source only; an expanded (stride-0) input counts its distinct
    elements; a Triton launch counts the distinct bytes its programs load and store."""
    from mhar_kernels import triton_routing

    a, b = torch.ones(4, 8, dtype=torch.bfloat16), torch.ones(4, 8, dtype=torch.bfloat16)
    with byte_count.ByteCounter() as c:
        a + b
        a.view(32)
        torch.empty(1000)
        a.copy_(b)
        torch.ones(8, dtype=torch.bfloat16).expand(4, 8) * b
    assert [(e.name, e.read, e.written) for e in c.entries] == [("add", 128, 64), ("copy_", 64, 64),
                                                               ("ones", 0, 16), ("mul", 16 + 64, 64)]
    # one routing forward over two (1, 4, 64) bf16 sources: both read once, the output written once
    sources = [torch.randn(1, 4, 64).bfloat16() for _ in range(2)]
    q, g = torch.randn(64).bfloat16(), torch.ones(64).bfloat16()
    with byte_count.ByteCounter() as c:
        triton_routing.route_forward(sources, q, g, 2, 1e-6)
    launch = next(e for e in c.entries if e.where == "launch")
    row = 4 * 64 * 2
    assert launch.read >= 2 * row + 2 * 64 * 2 and launch.written >= row  # sources, q, g; the output
    assert launch.read < 2 * row + 2 * 64 * 2 + 256  # ... and only a pointer table beside them


@pytest.fixture(scope="module")
def baselines():
    args = ModelArgs.from_flavor("debug", residual="standard", vocab_size=512)
    return {ac: byte_count.count_step(args, BATCH, SEQ, ac)[0] for ac in ("none", "full")}


@pytest.mark.parametrize("ac, null", [("none", False), ("full", False), ("none", True)])
def test_modelled_per_call_routing_bytes_equal_the_complete_count(baselines, ac, null):
    """Per-call MHAR (H = 8, Triton kernels through the interpreter): modelled routing bytes within
    2% of the counted difference to the baseline (the pointer tables the kernels load and, with
    the null source, the autograd additions of its per-site gradients are counted, not modelled)."""
    args = ModelArgs.from_flavor("debug", residual="attn_res", routing_heads=8, vocab_size=512,
                                 routing_kernel="triton", routing_null_source=null)
    counted = byte_count.routing_count(args, BATCH, SEQ, ac, baseline=baselines[ac])
    modelled = routing_bench.step_traffic(args, BATCH * SEQ, torch.bfloat16, ac, programs=1).total
    assert abs(counted["routing"] / modelled - 1) <= 0.02, (counted, modelled)
    assert counted["launches"] < counted["routing"]  # the eager side is in the count, not only launches
    row = BATCH * SEQ * args.dim * 2
    assert counted["residual"] == 3 * row * (4 * args.n_layers + (args.n_layers if ac == "full" else 0))


def test_harness_counts_are_linear_and_see_the_eager_merge():
    """The routing-only harness (`bench/routing.py --bytes --measure`) at the toy shape (d = 64,
    N = 5 sources, H = 4, g = 2): counts at 4, 8, 12 tokens lie on a line, extrapolated to a
    2 x 64 micro-batch; per-call routing's measured bytes equal the model within 2%; grouped
    routing's count includes the eager merge's aten ops (the model counts the merge as if fused,
    so it lies below what runs)."""
    shapes, micro = {"toy": routing_bench.SHAPES["toy"]["toy"]}, {"toy": (2, 64)}
    result = routing_bench.measured_bytes(("toy",), tokens=(4, 8, 12), shapes=shapes, micro_batch=micro)["toy"]
    assert set(result) == {"mhar", "mhar-grouped"}
    per_call, grouped = result["mhar"], result["mhar-grouped"]
    counts = per_call["counts"]
    assert counts[8] - counts[4] == pytest.approx(counts[12] - counts[8], rel=0.01)
    assert per_call["measured"] == pytest.approx(per_call["modelled"], rel=0.02)
    assert per_call["floor"] < per_call["measured"]  # (at d = 64 the fp32 logits per source weigh a lot)
    eager = byte_count.count_harness(64, 5, "mhar-grouped", 8, group=2)
    assert eager["bytes"] - eager["launches"] > 0.5 * eager["bytes"]  # the merge runs as eager aten ops
    assert grouped["measured"] > grouped["modelled"]
