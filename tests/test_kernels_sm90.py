"""The routing kernels compiled for sm_90 without a GPU (issue 12, acceptance 2): Triton's
ahead-of-time compile for GPUTarget("cuda", 90, 64) and the ptxas that ships with Triton, at the
paper's shapes (d in {512, 1024, 1280}, H in {1, 8}), N = 73 sources, bf16.

The numbers are those of Triton's own build (ptxas run by Triton with its own options, the cubin a
launch loads, read back with cuobjdump), not of a second ptxas run. With them seven kernels hold
128 registers and spill a little (``SPILLS``); every other kernel spills nothing."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import PATIENCE_S, ROOT

pytestmark = pytest.mark.slow  # each test compiles 12 to 18 kernels through Triton's ptxas in a process of its own

SHAPES = "512x1,512x8,1024x1,1024x8,1280x1,1280x8"
COMPILE_REPORT = str(ROOT / "bench" / "compile_report.py")

# (kernel, d, H) -> (stack frame, spill stores, spill loads) in bytes per thread of Triton's own
# build (triton 3.9.0, ptxas with Triton's -lineinfo --regAllocOptLevel=2, aligned variant, the
# launchers' warps and register limits; the kernels reading their sources as rows of one depth
# buffer), measured with `python bench/compile_report.py --json` on 2026-12-05 (the phase-1
# kernels over the group `auto` picks at each width). The bound is what Triton builds today: more
# spilling, or a spill elsewhere, fails; less passes. (With the per-launch pointer tables of
# 2ddef65 the backward spilled 16 / 16 bytes at 512 x 8 and 1024 x 8, the merge backward 16 / 16
# and 20 / 20, phase 1's forward 16 / 16 at 1280 x 8 and nothing at 512 x 8 and 1024 x 8, where
# it held 134 and 135 registers.)
SPILLS = {("backward", 512, 8): (8, 4, 4), ("backward", 1024, 8): (16, 12, 12),
          ("merge_backward", 512, 8): (8, 4, 4), ("merge_backward", 1024, 8): (24, 24, 24),
          ("phase1_forward", 512, 8): (8, 4, 4), ("phase1_forward", 1024, 8): (8, 8, 8),
          ("phase1_forward", 1280, 8): (8, 4, 4)}


def assert_spills_within_bound(r: dict) -> None:
    """The row's spills within ``SPILLS`` (none for a kernel not listed), read from Triton's own
    build: its ptxas report and the cubin agree."""
    where = (r["kernel"], r["d"], r["H"])
    stack, stores, loads = SPILLS.get(where, (0, 0, 0))
    assert r["registers"] == r["cubin_registers"], (where, r)  # the report is the cubin Triton built
    assert r["cubin_stack_bytes"] <= stack and r["spill_store_bytes"] <= stores and r["spill_load_bytes"] <= loads, \
        (where, r["cubin_stack_bytes"], r["spill_store_bytes"], r["spill_load_bytes"])
    assert r["spill_bytes"] == r["spill_store_bytes"] + r["spill_load_bytes"], where


def _run(args: list[str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the compiler, not the interpreter
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=PATIENCE_S)
    if "no CUDA backend" in proc.stderr:
        pytest.skip("this Triton build has no CUDA backend: the sm_90 compile cannot run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _report(shapes: str, variants: str) -> list[dict]:
    proc = _run([COMPILE_REPORT, "--json", "--shapes", shapes, "--variants", variants])
    return json.loads(proc.stdout)["rows"]


def test_aligned_kernels_fit_registers_vectorise_and_pipeline():
    """Aligned per-call kernels at every paper shape: at most 168 registers in the backward, spills
    within ``SPILLS`` (the backward at H = 8, d = 512 and 1024: 4 and 12 bytes each way), 128-bit and
    pipelined."""
    rows = _report(SHAPES, "aligned")
    assert len(rows) == 12
    for r in rows:
        where = (r["kernel"], r["d"], r["H"])
        assert_spills_within_bound(r)
        assert r["scalar_16bit_loads"] == 0 and r["accesses_128bit"] > 0, where  # 128-bit source access
        assert r["pipelined"], where  # sources prefetched by 16-byte cp.async in a multi-stage loop
        if r["kernel"] == "backward":
            assert r["registers"] <= 168, where


def test_general_variant_makes_no_alignment_promise():
    """Without an alignment guarantee (neither the host's ALIGNED hint nor Triton's divisibility
    specialisation of the depth buffer and its gradient buffer) the kernels load sources element by
    element (a wrong 128-bit promise would fault): the check above can tell the two variants apart."""
    rows = _report("1280x8", "general")
    assert {r["kernel"] for r in rows} == {"forward", "backward"}
    assert all(r["scalar_16bit_loads"] > 0 and not r["pipelined"] for r in rows)
    assert all(r["registers"] <= 168 for r in rows)
    for r in rows:
        assert_spills_within_bound(r)  # none: the general variant spills nowhere


# Every constexpr combination the launchers use, as bf16 aligned (with the mix residual) and fp32
# general (without), at a small shape with a non-power-of-two head width: what the GPU will
# compile, caught without one.
_EVERY_VARIANT = """
import itertools
from bench.compile_report import compile_kernel
count = 0
for (dtype, aligned), a, b in itertools.product((("bf16", True), ("fp32", False)), (False, True), (False, True)):
    compile_kernel("forward", 96, 4, aligned=aligned, n_sources=5, tokens=48, dtype=dtype,
                   flags=dict(HAS_PARTIAL=a, HAS_STATE=b, HAS_NULL=a != b))
    compile_kernel("backward", 96, 4, aligned=aligned, n_sources=5, tokens=48, dtype=dtype,
                   flags=dict(HAS_ALPHA=a, HAS_NULL=b, HAS_ACCUM=not a))  # gradient rows written or added into
    count += 2
print("compiled", count)
"""


def test_every_kernel_variant_compiles_for_sm90():
    assert "compiled 16" in _run(["-c", _EVERY_VARIANT]).stdout


# The group `auto` picks at each paper width (docs/DESIGN.md, "Grouped routing").
AUTO_GROUP = {512: 5, 1024: 7, 1280: 11}


def test_grouped_phase1_kernels_fit_registers_and_copy_sources_by_16_bytes():
    """Grouped routing's phase 1 (triton_grouped) at every paper shape over the group `auto` picks
    at that width, aligned, launched as the kernels are (site chunks; the backward adding into
    gradient rows): spills within ``SPILLS`` (the forward at H = 8: 4 to 8 bytes each way), at most
    168 registers, source tiles copied by 16-byte `cp.async`
    only, in a pipelined loop. The report's other 8- and 4-byte copies are slots, read flags and
    statistics, not source tiles (docs/DESIGN.md, "Grouped routing", lists the numbers)."""
    rows = []
    for d, g in AUTO_GROUP.items():
        rows += json.loads(_run([COMPILE_REPORT, "--json", "--shapes", f"{d}x1,{d}x8", "--variants",
                                 "aligned", "--kernels", "phase1_forward,phase1_backward", "--group", str(g)]
                                ).stdout)["rows"]
    assert len(rows) == 12
    for r in rows:
        where = (r["kernel"], r["d"], r["H"])
        assert_spills_within_bound(r)
        assert r["registers"] <= 168, where
        assert r["source_copies_128bit"] > 0 and r["source_copies_8byte"] == r["source_copies_4byte"] == 0, where
        assert r["pipelined"], where
        # loads (async copies, ld.global.v4) and stores counted apart; they add up to the 128-bit total
        assert r["async_copies_128bit"] + r["loads_128bit"] + r["stores_128bit"] == r["accesses_128bit"], where
        assert r["stores_128bit"] > 0, where


def test_merge_kernels_fit_registers_and_copy_sources_by_16_bytes():
    """Grouped routing's fused merge (the per-call kernels with the phase-1 state in and its
    gradients out, `mhar_kernels.triton_merge`) at every paper shape, aligned: spills within
    ``SPILLS`` (the backward at H = 8, d = 512 and 1024: 4 and 24 bytes each way), at most 168
    registers, sources copied by 16-byte `cp.async` in a pipelined loop."""
    rows = json.loads(_run([COMPILE_REPORT, "--json", "--shapes", SHAPES, "--variants", "aligned",
                            "--kernels", "merge_forward,merge_backward"]).stdout)["rows"]
    assert len(rows) == 12
    for r in rows:
        where = (r["kernel"], r["d"], r["H"])
        assert_spills_within_bound(r)
        assert r["registers"] <= 168, where
        assert r["async_copies_128bit"] > 0 and r["pipelined"] and r["scalar_16bit_loads"] == 0, where
        assert r["source_copies_8byte"] == r["source_copies_4byte"] == 0, where


_PHASE1_VARIANTS = """
from bench.compile_report import compile_kernel
count = 0
for dtype, aligned in (("bf16", True), ("fp32", False)):
    for null in (False, True):
        compile_kernel("phase1_forward", 96, 4, aligned=aligned, n_sources=5, tokens=48, dtype=dtype, group=3,
                       flags=dict(HAS_NULL=null))
        count += 1
    for null, chunked in ((False, False), (True, False), (False, True)):
        compile_kernel("phase1_backward", 96, 4, aligned=aligned, n_sources=5, tokens=48, dtype=dtype,
                       flags=dict(HAS_NULL=null, HAS_ACCUM=null or chunked, CHUNKED=chunked), group=3)
        count += 1
    for a, b in ((False, False), (True, True)):  # the merge's forward and backward, delta mode or not
        compile_kernel("merge_forward", 96, 4, aligned=aligned, n_sources=5, tokens=48, dtype=dtype,
                       flags=dict(HAS_PARTIAL=a))
        compile_kernel("merge_backward", 96, 4, aligned=aligned, n_sources=5, tokens=48, dtype=dtype,
                       flags=dict(HAS_ALPHA=a, WRITE_DSTATE=b or not a))
        count += 2
print("compiled", count)
"""


def test_every_phase1_and_merge_variant_compiles_for_sm90():
    assert "compiled 18" in _run(["-c", _PHASE1_VARIANTS]).stdout
