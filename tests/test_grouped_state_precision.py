"""Grouped routing's phase-1 state in the storage dtype (issue 21, item 2): rounding the state
(mix, normaliser, lse) to bf16 between phase 1 and the merge keeps every output and gradient of a
bf16 group within half the kernels' bf16 bound of the fp64 oracle (bench/state_precision.py), and
so does the fused phase 1 and merge, which keep the state's mix in bf16."""
from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
import state_precision  # noqa: E402


def test_bf16_phase1_state_stays_within_half_the_bf16_bound():
    for d, heads in ((64, 4), (1280, 8)):
        errors = state_precision.worst_errors(d, heads, seed=0)
        assert errors["bf16 state"] <= state_precision.BF16_TOL / 2, (d, heads, errors)
        assert errors["fp32 state"] <= state_precision.BF16_TOL / 2, (d, heads, errors)
        assert errors["fused"] <= state_precision.BF16_TOL / 2, (d, heads, errors)
        assert errors["bf16 state"] != errors["fp32 state"]  # the rounding changes the results
