"""The depth-connection interface changed how the standard residual and depth routing are wired,
not what they compute: every family and routing mode of tests/fixtures/record_pre_connections.py,
on every routing kernel it accepts, gives the logits and gradients recorded before the change
(main 492ea06) bit for bit on the machine that recorded them, and elsewhere (where matrix
products round differently) their projections on random directions within 1e-5 relative."""
import json
import math
import sys

import pytest
import torch

from helpers import ROOT

sys.path.insert(0, str(ROOT / "tests" / "fixtures"))
import record_pre_connections as recorded  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

REFERENCE = json.loads((ROOT / "tests" / "fixtures" / "pre_connections.json").read_text())
SAME_MACHINE = REFERENCE["machine"] == recorded.machine()


def test_every_recorded_case_is_a_case_of_the_recorder():
    assert {name.split(" / ")[0] for name in REFERENCE["cases"]} == set(recorded.CASES)


@pytest.mark.parametrize("case", [pytest.param(name, marks=[pytest.mark.slow] if c["kernel"] == "compile" else [])
                                  for name, c in sorted(REFERENCE["cases"].items())])  # compile: an inductor build each
def test_outputs_equal_those_recorded_before_the_connection_interface(case):
    entry = REFERENCE["cases"][case]
    with torch._dynamo.config.patch(recompile_limit=256, fail_on_recompile_limit_hit=True):
        measured = recorded.measure(entry["fields"], entry["kernel"])
    assert measured.keys() == entry["tensors"].keys()
    for name, (digest, projections) in entry["tensors"].items():
        if SAME_MACHINE:
            assert measured[name][0] == digest, f"{case}: {name} differs from the recorded bits"
        scale = max(abs(p) for p in projections) or 1.0
        for got, want in zip(measured[name][1], projections):
            assert math.isclose(got, want, rel_tol=0, abs_tol=1e-5 * scale), (case, name, got, want)


FINGERPRINT_BEFORE_CONNECTIONS = {
    "dim", "ffn_dim", "n_heads", "n_kv_heads", "n_layers", "norm_eps", "qk_norm", "residual", "rope_high_freq_factor",
    "rope_low_freq_factor", "rope_original_max_seq_len", "rope_scaling", "rope_scaling_factor", "rope_theta",
    "routing_block_layers", "routing_eps", "routing_granularity", "routing_heads", "routing_mode",
    "routing_null_source", "tie_embeddings", "vocab_size"}
"""The model fields a default model's checkpoint fingerprint held at main 492ea06 (checkpoint_fingerprint)."""


@pytest.mark.parametrize("family", ["baseline", "attn_res H=1", "mhar H=8", "delta block H=8 +null"])
def test_checkpoints_from_before_the_connections_keep_their_fingerprint(family):
    """A model of a family that existed before the depth connections has the fingerprint its
    checkpoints were saved with: the connections' new keys are left out at the values that give
    the older models (checkpoint.LEGACY_MODEL_DEFAULTS), so those checkpoints resume (a resume of
    steps 3-4 from a step-2 checkpoint saved at 492ea06 gave the same losses bit for bit, debug
    baseline, MHAR and the paper layout, measured on CPU 2026-12-07)."""
    from mhar_titan.checkpoint.fingerprint import checkpoint_fingerprint
    from mhar_titan.models.args import FAMILIES, ModelArgs

    fingerprint = checkpoint_fingerprint(ModelArgs(**FAMILIES[family]), "gpt2")["model_args"]
    assert set(fingerprint) <= FINGERPRINT_BEFORE_CONNECTIONS | {"routing_heads"}
