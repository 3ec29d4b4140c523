"""The fused routing path's depth buffer at the edges a user reaches (routing_kernel = "triton",
Triton interpreter on CPU): forwards without gradients make no gradient buffer, no depth buffer
outlives its step, several graphs alive at once and backwards in any order or twice give the eager
model's gradients, KV-cache decoding equals a full forward, an fp64 model matches the eager one to
fp64 rounding, and the public grouped calls (phase 1 and the merge) over odd shapes match the
per-call fp64 reference.

The models are tiny (d = 32, 3 layers, 8 routing heads of 4 dims, 2 x 7 tokens), so each test runs
in seconds under the interpreter.
"""
from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

import pytest
import torch

import mhar_kernels
from mhar_kernels import depth_buffer, dispatch, reference
from mhar_titan.models.args import FAMILIES, ModelArgs
from mhar_titan.models.kv_cache import KVCache
from mhar_titan.models.model import Transformer
from mhar_titan.parallel import apply_ac

pytest.importorskip("triton")
pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(not mhar_kernels.can_run(torch.device("cpu"), 32, 8),
                       reason="the fused kernels do not run on this CPU (TRITON_INTERPRET=1 not set before import)"),
]

SHAPE = dict(dim=32, n_layers=3, n_heads=2, n_kv_heads=1, ffn_dim=64, vocab_size=64, max_seq_len=16)
VARIANTS = {
    "per call": ("mhar H=8", {}),
    "grouped": ("mhar H=8", dict(routing_group_size=2)),
    "grouped delta block +null": ("delta block H=8 +null", dict(routing_group_size=2)),
}
TOL = 2e-4  # fp32 gradients, ||x - ref|| / ||ref|| per parameter (the kernels' model tests' bound)


def build(family: str, kernel: str, **overrides) -> Transformer:
    """A tiny model of `family` with non-uniform routing parameters (the same for every kernel)."""
    torch.manual_seed(0)
    model = Transformer(ModelArgs.from_flavor("debug", **{**FAMILIES[family], **SHAPE, **overrides},
                                              routing_kernel=kernel))
    model.init_weights()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        routing = model.routing
        routing.query.copy_(0.5 * torch.randn(routing.query.shape, generator=gen))
        routing.key_norm.add_(0.1 * torch.randn(routing.key_norm.shape, generator=gen))
        for extra in (routing.alpha, routing.null_source):
            if extra is not None:
                extra.copy_(0.5 * torch.randn(extra.shape, generator=gen))
    return model


def pair(variant: str) -> tuple[Transformer, Transformer]:
    """(eager, fused) models of one variant with the same weights."""
    family, overrides = VARIANTS[variant]
    return build(family, "eager", **overrides), build(family, "triton", **overrides)


def batch(seed: int) -> torch.Tensor:
    return torch.randint(0, SHAPE["vocab_size"], (2, 7), generator=torch.Generator().manual_seed(seed))


def grads(model: Transformer) -> dict[str, torch.Tensor]:
    return {n.replace("_checkpoint_wrapped_module.", ""): p.grad.clone() for n, p in model.named_parameters()}


def assert_grads_close(got: dict, expected: dict, tol: float = TOL) -> None:
    assert got.keys() == expected.keys()
    for name, ref in expected.items():
        err = ((got[name].double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-12)).item()
        assert err <= tol, f"{name}: relative error {err:.2e} > {tol}"


@pytest.fixture
def buffers(monkeypatch):
    """Weak references to every depth buffer's values (key "values") and gradient buffer (key
    "grads") made while the test runs; the real methods still run."""
    made = {"values": [], "grads": []}
    init, gradients = depth_buffer.DepthBuffer.__init__, depth_buffer.DepthBuffer.gradients

    def recording_init(self, capacity, like):
        init(self, capacity, like)
        made["values"].append(weakref.ref(self.values))

    def recording_gradients(self, reads):
        new = self.grads is None
        out = gradients(self, reads)
        if new:
            made["grads"].append(weakref.ref(out))
        return out

    monkeypatch.setattr(depth_buffer.DepthBuffer, "__init__", recording_init)
    monkeypatch.setattr(depth_buffer.DepthBuffer, "gradients", recording_gradients)
    return made


def alive(refs: list) -> int:
    gc.collect()
    return sum(ref() is not None for ref in refs)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
@pytest.mark.parametrize("variant", ["per call", "grouped delta block +null"])
def test_forward_without_gradients_makes_no_gradient_buffer(variant, mode, buffers):
    """A forward under torch.no_grad / inference_mode on the fused path gives the eager logits,
    makes its depth buffer (the fused path ran) but no gradient buffer, and frees the buffer with
    the forward."""
    eager, fused = pair(variant)
    x = batch(1)
    with torch.no_grad() if mode == "no_grad" else torch.inference_mode():
        expected, got = eager(x), fused(x)
    assert len(buffers["values"]) == 1, "the fused model made no depth buffer: the fused path did not run"
    assert not got.requires_grad
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert buffers["grads"] == [], "a forward without gradients made a gradient buffer"
    assert alive(buffers["values"]) == 0, "the depth buffer outlived its forward"


@pytest.mark.slow  # three training steps of each variant through the Triton interpreter
@pytest.mark.parametrize("variant,ac", [("per call", "none"), ("grouped", "full"),
                                        ("grouped delta block +null", "full")])
def test_no_depth_buffer_outlives_its_training_step(variant, ac, buffers):
    """Three SGD steps (and a fourth forward whose loss is dropped without a backward): after each,
    no depth buffer or gradient buffer is alive (nothing in the Router, the schedule or a saved
    context keeps one across steps)."""
    _, fused = pair(variant)
    apply_ac(fused, SimpleNamespace(mode=ac, selective_ac_option="1", preserve_rng_state=False))
    opt = torch.optim.SGD(fused.parameters(), lr=1e-2)
    for step in range(3):
        x = batch(step)
        loss = torch.nn.functional.cross_entropy(fused(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del loss
        assert alive(buffers["values"]) == 0 and alive(buffers["grads"]) == 0, f"a buffer outlived step {step + 1}"
    loss = fused(batch(9)).square().mean()
    del loss
    assert len(buffers["values"]) == 4 and len(buffers["grads"]) == 3
    assert alive(buffers["values"]) == 0, "a forward's depth buffer outlived its dropped graph"


@pytest.mark.parametrize("variant,ac", [("per call", "none"), ("grouped delta block +null", "full")])
def test_two_graphs_alive_backward_in_reverse_order_and_twice(variant, ac):
    """Two forwards before any backward, their backwards in reverse order, and then the second
    graph's backward once more (retain_graph): each forward has its own depth buffer, so the
    accumulated gradients equal the eager model's."""
    eager, fused = pair(variant)
    apply_ac(fused, SimpleNamespace(mode=ac, selective_ac_option="1", preserve_rng_state=False))
    results = []
    for model in (eager, fused):
        first, second = model(batch(1)).square().mean(), model(batch(2)).square().mean()
        second.backward(retain_graph=True)
        first.backward()
        second.backward()
        results.append(grads(model))
    assert_grads_close(results[1], results[0])


@pytest.mark.parametrize("variant", ["per call", "grouped delta block +null"])
def test_kv_cache_decoding_on_the_fused_path_equals_the_full_forward(variant):
    """A 5-token prefill and four one-token steps through the KV cache on the fused path give the
    eager model's full-sequence logits (each decoding step routes over a depth buffer of T = 1)."""
    eager, fused = pair(variant)
    x = torch.randint(0, SHAPE["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = eager(x)
        cache = KVCache(len(fused.layers), [0, 0], 9, fused.args.max_seq_len)
        steps = [fused(x[:, :5], cache=cache)] + [fused(x[:, t:t + 1], cache=cache) for t in range(5, 9)]
    torch.testing.assert_close(torch.cat(steps, 1), expected, rtol=1e-5, atol=1e-5)


def test_fp64_model_on_the_fused_path_matches_the_eager_model():
    """A model moved to fp64 routes in fp64 on the fused kernels (grouped, delta, null source, AC
    full): loss and every gradient within fp64 rounding of the eager model's."""
    eager, fused = (m.double() for m in pair("grouped delta block +null"))
    apply_ac(fused, SimpleNamespace(mode="full", selective_ac_option="1", preserve_rng_state=False))
    x = batch(5)
    losses = []
    for model in (eager, fused):
        loss = model(x).square().mean()
        loss.backward()
        losses.append(loss.item())
    assert losses[1] == pytest.approx(losses[0], rel=1e-12)
    assert_grads_close(grads(fused), grads(eager), tol=1e-10)


GROUPED_CASES = {
    "H=1": dict(heads=1),
    "H=d": dict(heads=16),
    "d=10 H=5 (general variant)": dict(d=10, heads=5),
    "one start source": dict(n=1),
    "no in-group source": dict(m=0),
    "one site": dict(g=1),
    "T=1": dict(T=1),
    "non-contiguous": dict(transposed=True),
    "sources need no grad": dict(source_grad=False),
    "null source, delta": dict(null=True, delta=True),
}


@pytest.mark.parametrize("case", list(GROUPED_CASES))
def test_fused_grouped_calls_match_the_per_call_reference_in_fp64(case):
    """`dispatch.phase1` and `dispatch.merge` on the fused kernels (fp64 sources) over odd shapes:
    each site's output and every gradient equal the per-call reference over the site's sources
    (the start sources, plus the in-group ones at the last site) to fp64 rounding."""
    spec = dict(n=3, g=2, m=1, B=2, T=3, d=16, heads=2, transposed=False, source_grad=True, null=False, delta=False)
    spec.update(GROUPED_CASES[case])
    n, g, m, d, heads = spec["n"], spec["g"], spec["m"], spec["d"], spec["heads"]
    gen = torch.Generator().manual_seed(1)

    def source():
        shape = (spec["B"], d, spec["T"]) if spec["transposed"] else (spec["B"], spec["T"], d)
        s = torch.randn(shape, generator=gen, dtype=torch.float64)
        return (s.transpose(1, 2) if spec["transposed"] else s).requires_grad_(spec["source_grad"])

    start, late = [source() for _ in range(n)], [source() for _ in range(m)]
    queries = torch.randn(g, d, generator=gen, dtype=torch.float64).requires_grad_()
    norms = (1 + 0.1 * torch.randn(g, d, generator=gen, dtype=torch.float64)).requires_grad_()
    null = torch.randn(d, generator=gen, dtype=torch.float64).requires_grad_() if spec["null"] else None
    partial = torch.randn(spec["B"], spec["T"], d, generator=gen, dtype=torch.float64).requires_grad_() \
        if spec["delta"] else None
    alpha = torch.tensor([0.5], dtype=torch.float64, requires_grad=True) if spec["delta"] else None
    reads = tuple((True,) * (n + spec["null"]) for _ in range(g))
    with_null = ([null] if null is not None else []) + start
    out = dispatch.phase1(queries, norms, reads, heads, 1e-6, "triton", *with_null)
    fused, expected = [], []
    for i in range(g):
        last = i == g - 1
        fused.append(dispatch.merge(out[i], out[g + i], out[-1][i], queries[i], norms[i], heads, 1e-6,
                                    torch.float64, "triton", *(late if last else []),
                                    partial=partial if last else None, alpha=alpha if last else None))
        mix = reference.route_reference(with_null + (late if last else []), queries[i], norms[i], heads)
        expected.append(partial + alpha * mix if last and partial is not None else mix)
    upstream = [torch.randn(o.shape, generator=gen, dtype=torch.float64) for o in fused]
    inputs = [t for t in (*start, *late, queries, norms, null, partial, alpha) if t is not None and t.requires_grad]
    got = torch.autograd.grad(fused, inputs, upstream)
    ref = torch.autograd.grad(expected, inputs, upstream)
    for o, e in zip(fused, expected):
        torch.testing.assert_close(o, e, rtol=1e-12, atol=1e-12)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("group, retain", [(1, False), (3, True)])
def test_a_loss_on_an_intermediate_activation_gets_the_eager_gradients(group, retain):
    """A backward that reaches only some fused calls (a loss on layer 0's MLP input) leaves the
    rows of readers that never run zero, not uninitialised: the fused gradients equal the eager
    ones; with a full backward run first (retain_graph), the rows it handed on are zeroed again
    before the second backward reads them."""
    def gradients(kernel):
        torch.manual_seed(0)
        model = Transformer(ModelArgs.from_flavor(
            "debug", residual="attn_res", routing_heads=8, dim=32, n_layers=3, n_heads=2, n_kv_heads=1, ffn_dim=64,
            vocab_size=64, max_seq_len=16, routing_kernel=kernel, routing_group_size=group))
        model.init_weights()
        with torch.no_grad():
            model.routing.query.normal_(0, 0.5)
        seen = []
        model.layers[0].ffn_norm.register_forward_hook(lambda module, args, out: seen.append(out))
        out = model(torch.arange(14).reshape(2, 7))
        if retain:
            out.square().mean().backward(retain_graph=True)
            model.zero_grad()
        seen[0].square().sum().backward()
        return model.tok_embeddings.weight.grad, model.routing.query.grad

    (emb, query), (fused_emb, fused_query) = gradients("eager"), gradients("triton")
    for got, want in ((fused_emb, emb), (fused_query, query)):  # fp32: measured 6e-6 to 8e-6
        assert ((got - want).norm() / want.norm()).item() < 1e-4


def test_an_output_projection_that_is_not_a_plain_linear_runs_as_a_module():
    """The fused path computes a sublayer's output projection into its slot only for a plain,
    hook-free nn.Linear: a subclass in its place (an adapter doubling its output) and a forward
    hook on it act as on the eager path."""
    class Doubled(torch.nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    def run(kernel):
        torch.manual_seed(0)
        model = Transformer(ModelArgs.from_flavor(
            "debug", residual="attn_res", routing_heads=8, dim=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=64,
            vocab_size=64, max_seq_len=16, routing_kernel=kernel))
        model.init_weights()
        old = model.layers[0].feed_forward.w2
        model.layers[0].feed_forward.w2 = Doubled(old.in_features, old.out_features, bias=False)
        model.layers[0].feed_forward.w2.weight = old.weight
        seen = []
        model.layers[1].attention.wo.register_forward_hook(lambda module, args, out: seen.append(out))
        return model(torch.arange(14).reshape(2, 7)), seen

    (eager, eager_seen), (fused, fused_seen) = run("eager"), run("triton")
    assert len(fused_seen) == len(eager_seen) == 1
    torch.testing.assert_close(fused, eager, rtol=1e-4, atol=1e-5)


def test_the_fused_phase1_and_merge_list_apis_check_their_arguments():
    """route_phase1 and triton_merge.merge refuse what mhar_kernels.route refuses (heads not
    dividing d, a query of another width, sources of other shapes, no (B, T, d) source) with a
    ValueError instead of computing garbage."""
    from mhar_kernels import triton_merge

    sources = [torch.randn(1, 4, 16) for _ in range(2)]
    queries, norms = torch.zeros(2, 16), torch.ones(2, 16)
    reads = ((True, True), (True, False))
    with pytest.raises(ValueError, match="head|divis"):
        mhar_kernels.route_phase1(queries, norms, reads, 3, 1e-6, *sources)
    with pytest.raises(ValueError):
        mhar_kernels.route_phase1(torch.zeros(2, 8), torch.ones(2, 8), reads, 2, 1e-6, *sources)
    with pytest.raises(ValueError, match="source"):
        mhar_kernels.route_phase1(queries, norms, ((True,), (True,)), 2, 1e-6, torch.zeros(16))
    mix, norm, lse = torch.randn(1, 4, 16), torch.ones(1, 4, 2), torch.zeros(1, 4, 2)
    with pytest.raises(ValueError):
        triton_merge.merge(mix, norm, lse, queries[0], norms[0], 2, 1e-6, torch.randn(1, 5, 16))
