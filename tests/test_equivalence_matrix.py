"""The whole-model equivalence matrix: every routing setting's every value, in pairs, on every routing
kernel, against the eager path in fp64 (tests/model_equivalence.py builds the combinations from
`ModelArgs`' schema and runs them).

For each combination a 3-layer d = 32 model with random routing parameters (not the identity init)
runs forward and backward once per kernel and dtype on the same weights and batch: the loss and every
parameter's gradient must equal the eager fp64 path's within 1e-9 relative in fp64 and 2e-4 in fp32;
KV-cache decoding must give the full forward's logits within 1e-9 (fp64). The fast tier runs the
eager path in fp32 and the fused kernels in fp64 (where their wiring differs from the eager path's);
the slow tier the fused kernels and the compiled routing body in fp32 and the fused kernels' decoding.
"""
import pytest
import torch

import model_equivalence as me
from mhar_titan.models.args import CONNECTION_KEYS

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny ops: threads only add hand-offs on a busy runner

AXES = me.settings_axes()
COMBINATIONS = me.pairwise(AXES)
IDS = [me.label(c) for c in COMBINATIONS]


@pytest.fixture
def compile_strictly():
    """The compiled routing body recompiles for each source count, dtype and head count of the
    matrix: let it, and fail instead of silently running eager past dynamo's recompile limit."""
    import torch._dynamo

    with torch._dynamo.config.patch(recompile_limit=256, fail_on_recompile_limit_hit=True):
        yield


def test_the_matrix_holds_every_value_on_every_kernel_and_the_pairs_that_hid_a_fault():
    """Every value of every routing setting read from the schema is in the matrix, on every kernel
    that accepts it (the permuted head layout runs on the eager path only, grouped routing not on the
    compiled body, and the other connections than depth routing run on the eager path alone); and the pairs behind the fused kernels' paper-layout fault (the paper layout with
    blocks of 1 and of 2 layers) are on the fused kernels."""
    assert {"residual", "routing_heads", "routing_granularity", "routing_block_layers", "routing_mode",
            "routing_null_source", "routing_layout", "routing_group_size", "routing_head_layout",
            "routing_logit_scale", "routing_temperature", "attn_mask_type", "ac"} <= AXES.keys()
    assert "routing_kernel" not in AXES and AXES["routing_group_size"][-1] == "auto"
    # the routing kernels are depth routing's: the other connections run their one path (eager)
    others = {("residual", repr(r)) for r in AXES["residual"] if r != "attn_res"}
    others |= {(k, repr(v)) for keys in CONNECTION_KEYS.values() for k in keys for v in AXES[k]
               if v != getattr(me.DEFAULTS, k)}
    refused = {"compile": {("routing_head_layout", "'permuted'"), ("routing_head_layout_seed", "5"),
                           ("routing_group_size", "3"), ("routing_group_size", "'auto'")} | others,
               "triton": {("routing_head_layout", "'permuted'"), ("routing_head_layout_seed", "5")} | others}
    for kernel in me.KERNELS:
        held = {value for c in COMBINATIONS if kernel in me.kernels_of(c) for value in c.items()}
        held = {(name, repr(value)) for name, value in held}
        every = {(name, repr(value)) for name, values in AXES.items() for value in values}
        assert every - held == refused.get(kernel, set()), kernel
    fused = [c for c in COMBINATIONS if "triton" in me.kernels_of(c)]
    for k in (1, 2):  # a block size is set only at block granularity (me.INERT): the pair implies it
        assert any(c["routing_layout"] == "paper" and c["routing_block_layers"] == k for c in fused), k
        assert all(c["routing_granularity"] == "block" for c in fused if c["routing_block_layers"] == k)


@pytest.mark.parametrize("combination", COMBINATIONS, ids=IDS)
def test_whole_model_gradients_equal_eager_fp64(combination):
    """Fast tier: eager fp32, fused kernels fp64 (and eager fp64 under AC) against eager fp64, and
    eager KV-cache decoding."""
    failures = me.check_combination(combination, runs=me.FAST_RUNS, decode=("eager",))
    assert not failures, "\n".join(failures)


@pytest.mark.slow
@pytest.mark.parametrize("combination", COMBINATIONS, ids=IDS)
def test_whole_model_gradients_equal_eager_fp64_compiled_and_fp32_fused(combination, compile_strictly):
    """Slow tier: fused kernels and the compiled routing body in fp32, and the fused
    kernels' KV-cache decoding."""
    failures = me.check_combination(combination, runs=me.SLOW_RUNS, decode=("triton",))
    assert not failures, "\n".join(failures)


PAPER_BLOCKS = dict(residual="attn_res", routing_layout="paper", routing_granularity="block", routing_block_layers=1,
                    routing_mode="delta", routing_null_source=True, routing_heads=8, ac="none")
"""The layout of the 8B mid-training config at blocks of one layer, where the fused kernels gave the
embedding a wrong gradient (0.62 off where its largest entry is 2.89, equal losses)."""


def test_the_paper_layout_embedding_gradient_on_the_fused_kernels_equals_eager_to_1e_12():
    """3 layers, blocks of 1, fp64: every gradient of the fused kernels equals the eager path's to
    1e-12 relative (the block sources' recipe, stream - embedding, reads the embedding's own tensor)."""
    args = me.model_args(PAPER_BLOCKS)
    reference = me.reference_model(args)
    tokens = me.batch()
    fused = me.copy_of(reference, me.model_args(PAPER_BLOCKS, "triton"), torch.float64)
    failures = me.compare("triton float64", me.loss_and_grads(fused, tokens), me.loss_and_grads(reference, tokens),
                          1e-12)
    assert not failures, "\n".join(failures)


@pytest.mark.slow
def test_the_paper_layout_embedding_gradient_at_36_layers_in_fp32():
    """36 layers (the 1b flavor's depth) in fp32 on the fused kernels: the embedding's gradient within
    2e-4 relative of the eager fp64 path's (it was 0.24 off)."""
    shape = {**me.SHAPE, "n_layers": 36}
    reference = me.reference_model(me.model_args(PAPER_BLOCKS, shape=shape))
    tokens = me.batch()
    fused = me.copy_of(reference, me.model_args(PAPER_BLOCKS, "triton", shape), torch.float32)
    _, grads = me.loss_and_grads(fused, tokens)
    _, expected = me.loss_and_grads(reference, tokens)
    assert me.relative_error(grads["tok_embeddings.weight"], expected["tok_embeddings.weight"]) <= me.FP32_RTOL
