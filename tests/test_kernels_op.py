"""The routing custom op: saved state, torch.compile, repeatability, checkpointing, errors
(issue 6, acceptance 4-5 and the op contract of docs/ARCHITECTURE.md)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.checkpoint import checkpoint

import mhar_kernels
from mhar_kernels import depth_buffer, op, triton_routing
from mhar_kernels.depth_buffer import DepthBuffer
from mhar_kernels.dispatch import route
from mhar_kernels.reference import route_reference, route_stacked
from kernels_oracle import DEVICE, leaves, make_inputs, merge_states, oracle_route, rel_err, route_with_state


def _route(inputs: dict, heads: int):
    return mhar_kernels.route(
        inputs["sources"], inputs["query"], inputs["norm_weight"], heads,
        partial=inputs.get("partial"), alpha=inputs.get("alpha"), null_source=inputs.get("null_source"),
    )


def _saved_during(fn) -> list[torch.Tensor]:
    """Every tensor autograd saves for backward while fn() runs (what activation checkpointing
    would drop and recompute)."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        fn()
    return saved


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("delta", [False, True])
def test_a_call_saves_no_source_only_its_activations_and_rows(delta, dtype):
    """Acceptance 4 on the depth buffer: sources written into one buffer and a call over its rows
    (the models' path), or a list copied into a buffer of its own (`mhar_kernels.route`), save no
    (B, T, d) source and nothing of the buffer; the call saves exactly its own activations and
    parameter rows: the mix (its output in replacement mode, beside it in delta mode), in bf16 the
    mix residual, the statistics as one (N + 1, B*T, H) tensor (the null source counts as a
    source), the (d,) pseudo-query and norm weight, in delta mode the (1,) gate and (d,) null."""
    n, d, heads, batch, seq = 6, 64, 4, 2, 7
    inputs = make_inputs(n, d, heads, dtype, delta=delta)
    sources = inputs["sources"]
    extra = dict(partial=inputs.get("partial"), alpha=inputs.get("alpha"), null_source=inputs.get("null_source"))
    buffer = DepthBuffer(n, sources[0].detach())

    def buffered():
        token = None
        for slot, source in enumerate(sources):
            token = buffer.write(slot, source, token)
        rows = depth_buffer.reads(range(n), [False] * n, DEVICE)
        return op.route_buffer(buffer, rows, token, inputs["query"], inputs["norm_weight"], heads, **extra)

    bt, n_all = batch * seq, n + int(delta)
    expected = [(batch, seq, d)] * (1 + int(dtype == torch.bfloat16)) + [(n_all + 1, bt, heads), (d,), (d,)]
    expected += [(1,), (d,)] if delta else []
    for path in (buffered, lambda: _route(inputs, heads)):
        saved = _saved_during(path)
        assert sorted(tuple(t.shape) for t in saved) == sorted(expected), [tuple(t.shape) for t in saved]
        outside = {_storage(s) for s in sources} | {_storage(buffer.values)}
        assert not any(_storage(t) in outside for t in saved)


def test_the_count_sees_a_call_that_saves_its_sources():
    """The same measurement on the stack-and-autograd path (the body `kernel="compile"` compiles)
    finds an (N, B, T, d) tensor: the count above can tell a call that saves its sources."""
    n, d, heads = 6, 64, 4
    inputs = make_inputs(n, d, heads, torch.float32)
    srcs = inputs["sources"]
    saved = _saved_during(lambda: route_stacked(torch.stack(srcs), inputs["query"], inputs["norm_weight"], heads,
                                                1e-6))
    assert any(t.numel() >= n * srcs[0].numel() for t in saved)


def test_a_parameter_row_changed_in_place_fails_the_backward():
    """A call saves its pseudo-query row for backward: the row modified in place between the
    forward and the backward makes the backward raise, naming the cause (as for any saved tensor)."""
    inputs = make_inputs(2, 16, 4, torch.float32)
    row = inputs["query"] * 1
    out = mhar_kernels.route(inputs["sources"], row, inputs["norm_weight"], 4)
    with torch.no_grad():
        row.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_bitwise_repeatable():
    """Two calls give bit-identical outputs and gradients (dq, dg, dalpha, dnull are reduced from
    per-program partial sums in a fixed order, no atomics)."""
    inputs = make_inputs(7, 96, 12, torch.float32, delta=True)
    results = []
    for _ in range(2):
        out = _route(inputs, 12)
        results.append([out, *torch.autograd.grad(out, leaves(inputs), torch.ones_like(out))])
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_non_contiguous_sources_and_grad():
    """Sources that are views (a slice of a wider tensor, a transposed layout) and an expanded
    upstream gradient give the same result as contiguous copies."""
    gen = torch.Generator().manual_seed(0)
    wide = torch.randn(2, 7, 128, generator=gen).to(DEVICE).requires_grad_()
    tmaj = torch.randn(7, 2, 64, generator=gen).to(DEVICE).requires_grad_()
    plain = torch.randn(2, 7, 64, generator=gen).to(DEVICE).requires_grad_()
    q, g = torch.randn(64, generator=gen).to(DEVICE), (torch.rand(64, generator=gen) + 0.5).to(DEVICE)
    srcs = [wide[..., 32:96], tmaj.transpose(0, 1), plain]
    out = mhar_kernels.route(srcs, q, g, 4)
    grads = torch.autograd.grad(out.sum(), [wide, tmaj, plain])
    ref_srcs = [s.detach().contiguous().requires_grad_() for s in srcs]
    ref = route_reference(ref_srcs, q, g, 4)
    ref_grads = torch.autograd.grad(ref.sum(), ref_srcs)
    assert rel_err(out, ref) < 1e-6
    assert rel_err(grads[0][..., 32:96], ref_grads[0]) < 1e-6 and grads[0][..., :32].abs().max() == 0
    assert rel_err(grads[1].transpose(0, 1), ref_grads[1]) < 1e-6
    assert rel_err(grads[2], ref_grads[2]) < 1e-6


def test_activation_checkpointing_recompute():
    """A chain of routing calls (sources grow by one Linear output per call) inside
    torch.utils.checkpoint gives the same loss and gradients as without checkpointing."""
    torch.manual_seed(0)
    d, heads = 32, 4
    lins = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(3)).to(DEVICE)
    qs = torch.nn.Parameter((torch.randn(3, d) * 0.3).to(DEVICE))
    gs = torch.nn.Parameter((1 + 0.1 * torch.randn(3, d)).to(DEVICE))
    emb = torch.randn(2, 5, d).to(DEVICE).requires_grad_()

    def step(i, *sources):
        return lins[i](mhar_kernels.route(list(sources), qs[i], gs[i], heads))

    def chain(use_ckpt):
        sources = [emb]
        for i in range(3):
            out = checkpoint(step, i, *sources, use_reentrant=False) if use_ckpt else step(i, *sources)
            sources.append(out)
        return mhar_kernels.route(sources, qs[0], gs[0], heads).square().mean()

    params = [emb, qs, gs, *lins.parameters()]
    plain = chain(False)
    g_plain = torch.autograd.grad(plain, params)
    ckpt = chain(True)
    g_ckpt = torch.autograd.grad(ckpt, params)
    assert torch.equal(plain, ckpt)
    assert all(torch.equal(a, b) for a, b in zip(g_plain, g_ckpt))


def _block(d, heads):
    """A per-block function as the model has: route, RMSNorm, Linear, in delta mode with a null source."""
    lin = torch.nn.Linear(d, d).to(DEVICE)
    norm = torch.nn.RMSNorm(d).to(DEVICE)

    def block(sources, query, norm_weight, partial, alpha, null):
        h = mhar_kernels.route(sources, query, norm_weight, heads, partial=partial, alpha=alpha, null_source=null)
        return partial + lin(norm(h))

    return block


def test_compiled_block_has_no_graph_breaks_and_matches_eager():
    """Acceptance 5: torch._dynamo.explain finds zero graph breaks in a block that calls the op;
    the compiled block's output and gradients equal eager."""
    torch.manual_seed(0)
    inputs = make_inputs(3, 32, 4, torch.float32, delta=True)
    block = _block(32, 4)
    args = (inputs["sources"], inputs["query"], inputs["norm_weight"], inputs["partial"], inputs["alpha"],
            inputs["null_source"])
    explanation = torch._dynamo.explain(block)(*args)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    eager = block(*args)
    g_eager = torch.autograd.grad(eager.sum(), leaves(inputs))
    compiled = torch.compile(block, fullgraph=True)(*args)
    g_compiled = torch.autograd.grad(compiled.sum(), leaves(inputs))
    torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-6)
    for a, b in zip(g_compiled, g_eager):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_opcheck_fake_and_autograd_registration():
    """torch.library.opcheck: schema, fake (meta) implementation and autograd registration agree
    with the real implementation."""
    inputs = make_inputs(3, 16, 2, torch.float32, delta=True)
    args = (inputs["sources"], inputs["query"], inputs["norm_weight"], 2, 1e-6,
            inputs["partial"], inputs["alpha"], inputs["null_source"])
    torch.library.opcheck(torch.ops.mhar.depth_route.default, args,
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


def test_online_softmax_state_merges_exactly():
    """route_with_state over sources A then B (state carried) equals one route over A + B, and
    merge_states of two independent states gives the same (forward; the grouped-routing interface)."""
    inputs = make_inputs(7, 96, 12, torch.float32, delta=True)
    srcs, q, g, null = inputs["sources"], inputs["query"], inputs["norm_weight"], inputs["null_source"]
    whole = route_with_state(srcs, q, g, 12, null_source=null)
    first = route_with_state(srcs[:3], q, g, 12, null_source=null)
    carried = route_with_state(srcs[3:], q, g, 12, state=first)
    merged = merge_states(first, route_with_state(srcs[3:], q, g, 12))
    truth = oracle_route(srcs, q, g, 12, null_source=null)
    for mix, lse in (whole, carried, merged):
        assert mix.dtype == torch.float32 and lse.shape == (2 * 7, 12)
        assert rel_err(mix, truth) < 1e-6
        assert rel_err(lse, whole[1]) < 1e-6


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(heads=5), "d=16 is not divisible by routing heads H=5"),
        (dict(heads="kv"), "routing heads must be a positive int, got 'kv'"),
        (dict(heads=0), "routing heads must be a positive int, got 0"),
        (dict(heads=True), "routing heads must be a positive int, got True"),
        (dict(sources=[]), "at least one"),
        (dict(sources=[torch.ones(2, 3, 16, dtype=torch.int32)]), "sources must be floating point"),
        (dict(mismatch=True), "every source must match"),
        (dict(query=torch.zeros(32)), r"query must have shape \(16,\)"),
        (dict(norm_weight=torch.ones(16, device="meta")), "norm_weight must be a floating-point tensor on the "
                                                          "sources' device cpu"),
        (dict(alpha_only=True), "both `partial` and `alpha`"),
        (dict(alpha_shape=True), "alpha must have shape"),
        (dict(partial_dtype=True), "partial must match the sources"),
        (dict(null=torch.zeros(8)), "null_source must have shape"),
        (dict(sources=[torch.randn(2, 3, 0)], query=torch.zeros(0), norm_weight=torch.ones(0)), r"no features \(d = 0\)"),
    ],
)
def test_bad_arguments_raise_clear_errors(change, message):
    """The fused op and the models' eager routing share one validator: same error, same words."""
    srcs = [torch.randn(2, 3, 16) for _ in range(2)]
    kwargs = dict(sources=srcs, query=torch.zeros(16), norm_weight=torch.ones(16), heads=4)
    extra = {}
    if "mismatch" in change:
        kwargs["sources"] = [srcs[0], torch.randn(2, 4, 16)]
    elif "alpha_only" in change:
        extra = dict(alpha=torch.zeros(1))
    elif "alpha_shape" in change:
        extra = dict(partial=srcs[0], alpha=torch.zeros(()))
    elif "partial_dtype" in change:
        extra = dict(partial=srcs[0].double(), alpha=torch.zeros(1))
    elif "null" in change:
        extra = dict(null_source=change["null"])
    else:
        kwargs.update(change)
    sources = kwargs.pop("sources")
    with pytest.raises(ValueError, match=message) as fused:
        mhar_kernels.route(sources, **kwargs, **extra)
    null = extra.pop("null_source", None)
    with pytest.raises(ValueError) as eager:
        route(([null] if null is not None else []) + sources, **kwargs, **extra, kernel="eager")
    assert str(eager.value) == str(fused.value)


def test_parameters_in_other_dtypes_than_each_other_get_their_own_precision():
    """fp32 sources with a bf16 pseudo-query and an fp32 key-norm weight and null source: the
    fused op's gradients are cast to each parameter's own dtype, so the fp32 ones equal the eager
    path's within fp32 rounding (a shared cast through the query's bf16 would lose ~1e-3)."""
    inputs = make_inputs(4, 32, 4, torch.float32, delta=True)
    inputs["query"] = inputs["query"].detach().to(torch.bfloat16).requires_grad_()
    (out, grads), (ref, ref_grads) = _fused_and_eager(inputs, 4)
    assert rel_err(out, ref) < 1e-5
    for name, got, expected in zip(["source"] * 4 + ["query", "norm_weight", "partial", "alpha", "null_source"],
                                   grads, ref_grads):
        assert got.dtype == expected.dtype, name
        tol = 1e-2 if got.dtype == torch.bfloat16 else 1e-5
        assert rel_err(got.float(), expected.float()) < tol, (name, rel_err(got.float(), expected.float()))


def test_numpy_integer_heads():
    inputs = make_inputs(3, 16, 4, torch.float32, delta=True)
    assert torch.equal(_route(inputs, np.int64(4)), _route(inputs, 4))


def _fused_and_eager(inputs: dict, heads: int):
    """(output, gradients of all leaves) of the fused op and of the models' eager routing (delta inputs)."""
    srcs = [inputs["null_source"], *inputs["sources"]]
    eager = route(srcs, inputs["query"], inputs["norm_weight"], heads, partial=inputs["partial"], alpha=inputs["alpha"])
    return [(out, torch.autograd.grad(out.sum(), leaves(inputs))) for out in (_route(inputs, heads), eager)]


def test_empty_token_batch_gives_empty_output_and_zero_gradients():
    """B*T = 0 (an empty micro-batch): empty output and source gradients, zero parameter gradients,
    as the eager path gives (the kernels are not launched)."""
    inputs = make_inputs(3, 16, 4, torch.float32, delta=True, seq=0)
    (out, grads), (ref, ref_grads) = _fused_and_eager(inputs, 4)
    assert out.shape == ref.shape == (2, 0, 16)
    for got, expected in zip(grads, ref_grads):
        assert got.shape == expected.shape and torch.equal(got, torch.zeros_like(expected))
    mix, lse = route_with_state(inputs["sources"], inputs["query"], inputs["norm_weight"], 4)
    assert mix.shape == (2, 0, 16) and lse.shape == (0, 4)


def test_tile_larger_than_the_register_budget_runs_the_eager_reference():
    """MHAR_SPEC section 4: a token tile [next_pow2(H), next_pow2(d/H)] above 8192 elements is not
    for the kernels: the models' routing (kernel="triton") runs the eager reference itself (output
    and gradients bit for bit), while the kernel package refuses with a clear error."""
    assert triton_routing.fits_tile(8, 160) and triton_routing.fits_tile(1, 8192)
    assert not triton_routing.fits_tile(1, 8200)
    inputs = make_inputs(3, 8200, 1, torch.float32, delta=True, batch=1, seq=3)
    assert not mhar_kernels.can_run(DEVICE, 8200, 1)
    with pytest.raises(RuntimeError, match="d=8200, H=1 exceeds the kernels' register budget"):
        _route(inputs, 1)
    with pytest.raises(RuntimeError, match="register budget"):
        route_with_state(inputs["sources"], inputs["query"], inputs["norm_weight"], 1)
    _assert_model_triton_equals_eager(inputs, 1)


def test_models_routing_falls_back_to_eager_where_triton_cannot_run(monkeypatch):
    """CPU without the interpreter: the kernels cannot run, so route(kernel="triton") is the
    eager reference bit for bit, and the kernel package says why it refuses."""
    monkeypatch.setattr(triton_routing, "INTERPRET", False)
    inputs = make_inputs(3, 16, 4, torch.float32, delta=True, device="cpu")
    assert not mhar_kernels.can_run(torch.device("cpu"), 16, 4)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        _route(inputs, 4)
    _assert_model_triton_equals_eager(inputs, 4)


def _assert_model_triton_equals_eager(inputs: dict, heads: int) -> None:
    srcs = [inputs["null_source"], *inputs["sources"]]
    results = []
    for kernel in ("triton", "eager"):
        out = route(srcs, inputs["query"], inputs["norm_weight"], heads, kernel=kernel,
                    partial=inputs["partial"], alpha=inputs["alpha"])
        results.append([out, *torch.autograd.grad(out.sum(), leaves(inputs))])
    assert all(torch.equal(a, b) for a, b in zip(*results))
