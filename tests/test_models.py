"""Model zoo: args and flavors, init, routing invariants of the model, sources, meta build, listing."""
import contextlib
import io
import math

import pytest
import torch

from mhar_titan.analysis.routing import routing_entropy
from mhar_titan.models import FAMILIES, FLAVORS, ModelArgs, Transformer, count_parameters, pad_vocab
from mhar_titan.models.__main__ import main as list_flavors
from mhar_titan.models.model import apply_rope, rope_frequencies
from mhar_kernels.reference import route_reference
from helpers import site_sources

ROUTED = {
    **{name: FAMILIES[name] for name in ("attn_res H=1", "mhar H=kv", "mhar H=8")},
    "block": dict(residual="attn_res", routing_granularity="block", routing_block_layers=3),
    "delta": dict(residual="attn_res", routing_mode="delta", routing_null_source=True),
    "delta block": dict(residual="attn_res", routing_mode="delta", routing_granularity="block",
                        routing_block_layers=2, routing_null_source=True),
}


def tiny(**overrides):
    """debug shape with a small vocabulary, for tests that do not train."""
    return ModelArgs.from_flavor("debug", **{"vocab_size": 256, "max_seq_len": 32, **overrides})


def build(args, seed=0):
    torch.manual_seed(seed)
    model = Transformer(args)
    model.init_weights()
    return model


def tokens(args, B=2, T=12, seed=0):
    return torch.randint(0, args.vocab_size, (B, T), generator=torch.Generator().manual_seed(seed))


# -- args and flavors -------------------------------------------------------------------

def test_args_validation_names_the_problem():
    with pytest.raises(ValueError, match="unknown residual 'hyper'"):
        ModelArgs(residual="hyper")
    with pytest.raises(ValueError, match=r"d=128.*H=3"):
        ModelArgs(residual="attn_res", routing_heads=3)
    with pytest.raises(ValueError, match="dim=130 is not divisible by n_heads=4"):
        ModelArgs(dim=130)
    with pytest.raises(ValueError, match="routing_heads"):
        ModelArgs(routing_heads="all")
    with pytest.raises(ValueError, match="valid flavors: debug, 100m, 350m, 1b, llama3_8b"):
        ModelArgs.from_flavor("7b")
    with pytest.raises(ValueError, match="unknown ModelArgs field"):
        ModelArgs.from_flavor("debug", n_layer=3)
    assert ModelArgs.from_flavor("100m", residual="attn_res", routing_heads="kv").resolved_routing_heads == 4
    assert ModelArgs.from_flavor("1b").n_routing_sites == 0
    assert ModelArgs.from_flavor("1b", residual="attn_res").n_routing_sites == 73


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(routing_mode="delta"), r"routing_mode='delta' and routing_null_source=False need residual='attn_res'"),
        (dict(routing_null_source=True), r"routing_null_source=True need residual='attn_res'"),
        (dict(rope_theta="1e4"), r"ModelArgs.rope_theta must be a finite number > 0, got '1e4'"),
        (dict(norm_eps=float("nan")), r"ModelArgs.norm_eps must be a finite number > 0"),
        (dict(routing_eps=0), r"ModelArgs.routing_eps must be a finite number > 0, got 0"),
        (dict(rope_scaling_factor=True), r"ModelArgs.rope_scaling_factor must be a finite number"),
        (dict(rope_original_max_seq_len=8192.0), r"ModelArgs.rope_original_max_seq_len must be a positive integer"),
        (dict(routing_block_layers="2"), r"ModelArgs.routing_block_layers must be a positive integer"),
        (dict(qk_norm="false"), r"ModelArgs.qk_norm must be true or false, got 'false'"),
        (dict(tie_embeddings=1), r"ModelArgs.tie_embeddings must be true or false"),
    ],
)
def test_args_reject_wrong_types_and_routing_fields_without_routing(fields, message):
    """Wrong types fail at construction with the field's name, not deep inside the model."""
    with pytest.raises(ValueError, match=message):
        ModelArgs(**fields)


def test_vocab_padding():
    assert pad_vocab(50_257) == FLAVORS["debug"]["vocab_size"] == 50_304
    assert pad_vocab(100_277) == FLAVORS["100m"]["vocab_size"] == 100_352
    assert pad_vocab(128_256) == 128_256


@pytest.mark.parametrize("flavor, expected", [("100m", 25_600), ("350m", 100_352), ("1b", 186_880)])
def test_routing_overhead_is_2L_plus_1_times_2d(flavor, expected):
    base = count_parameters(ModelArgs.from_flavor(flavor))
    args = ModelArgs.from_flavor(flavor, residual="attn_res", routing_heads=8)
    routed = count_parameters(args)
    assert routed.total - base.total == routed.routing == (2 * args.n_layers + 1) * 2 * args.dim == expected
    with torch.device("meta"):
        model = Transformer(args)
    assert sum(p.numel() for p in model.routing.parameters()) == expected


@pytest.mark.parametrize("family", ["baseline", *ROUTED])
def test_parameter_count_from_args_matches_the_module(family):
    args = tiny(**ROUTED.get(family, {}), tie_embeddings=family != "delta")
    with torch.device("meta"):
        model = Transformer(args)
    counts = count_parameters(args)
    assert sum(p.numel() for p in model.parameters()) == counts.total
    assert sum(p.numel() for p in (model.routing.parameters() if model.routing else [])) == counts.routing


def test_large_flavors_build_on_meta_and_match_the_listing():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        list_flavors()
    listing = out.getvalue()
    for flavor, family, overrides in [
        ("1b", "mhar H=8", FAMILIES["mhar H=8"]),
        ("llama3_8b", "baseline", {}),
    ]:
        args = ModelArgs.from_flavor(flavor, **overrides)
        with torch.device("meta"):
            model = Transformer(args)
        tensors = list(model.parameters()) + list(model.buffers())
        assert all(t.is_meta for t in tensors)  # no parameter memory allocated
        total = sum(p.numel() for p in model.parameters())
        assert total == count_parameters(args).total
        row = next(line for line in listing.splitlines() if line.startswith(flavor) and family in line)
        assert f"{total:,}" in row.split()
        if flavor == "llama3_8b":
            assert model.output is not None and 8.02e9 < total < 8.04e9


# -- init ---------------------------------------------------------------------------------

def test_init_weights_after_to_empty_matches_a_direct_build():
    args = tiny(**ROUTED["delta block"])
    with torch.device("meta"):
        meta_model = Transformer(args)
    meta_model.to_empty(device="cpu")
    torch.manual_seed(5)
    meta_model.init_weights(buffer_device="cpu")
    direct = Transformer(args)  # construction draws from the RNG too, so seed right before init
    torch.manual_seed(5)
    direct.init_weights()
    for (name, p), (_, q) in zip(meta_model.named_parameters(), direct.named_parameters()):
        assert torch.equal(p, q), name
    assert torch.equal(meta_model.rope_cos, direct.rope_cos) and torch.equal(meta_model.rope_sin, direct.rope_sin)
    r = meta_model.routing
    assert torch.equal(r.query, torch.zeros_like(r.query))  # pseudo-queries exactly 0, final one included
    assert torch.equal(r.key_norm, torch.ones_like(r.key_norm))
    assert torch.equal(r.alpha, torch.zeros(args.n_routing_sites, 1))
    assert torch.equal(r.null_source, torch.zeros(args.dim))
    w = meta_model.layers[0].feed_forward.w1.weight
    assert abs(w.std().item() - 0.02) < 2e-3 and abs(w.mean().item()) < 2e-3
    x = tokens(args)
    assert torch.equal(meta_model(x), direct(x))


@pytest.mark.parametrize("tables", ["uninitialised", "left on meta"])
@pytest.mark.parametrize("cached", [False, True])
def test_a_model_given_storage_without_init_weights_computes_its_rope_tables(cached, tables):
    """Built on the meta device, given storage and loaded with weights (as transformers'
    from_pretrained does), with no init_weights: the RoPE tables (buffers that are not saved) are
    recomputed where the model now lives, so the logits and the decoded tokens equal the model's it
    was loaded from, with and without the KV cache."""
    from mhar_titan.eval.generation import generate_batch

    args = tiny(**ROUTED["delta block"])
    source = build(args, seed=3)
    with torch.device("meta"):
        loaded = Transformer(args)
    loaded.to_empty(device="cpu")
    if tables == "left on meta":  # transformers 4.x's from_pretrained gives non-persistent buffers no storage
        loaded.rope_cos, loaded.rope_sin = (torch.empty_like(t, device="meta") for t in (loaded.rope_cos, loaded.rope_sin))
    else:
        loaded.rope_cos.fill_(float("nan"))  # what uninitialised storage may hold
    loaded.load_state_dict(source.state_dict())
    x = tokens(args)
    with torch.no_grad():
        prompts = [x[0, :5].tolist(), x[1, :9].tolist()]
        got = generate_batch(loaded, prompts, 6, use_cache=cached)
        assert got == generate_batch(source, prompts, 6, use_cache=cached)
        assert torch.equal(loaded(x), source(x))
    assert torch.equal(loaded.rope_cos, source.rope_cos) and torch.equal(loaded.rope_sin, source.rope_sin)


@pytest.mark.parametrize("family", ["attn_res H=1", "mhar H=kv", "mhar H=8", "block"])
def test_every_site_and_head_starts_uniform(family):
    args = tiny(**ROUTED[family])
    model = build(args)
    trace = []
    with torch.no_grad():
        trace.extend(site_sources(model, tokens(args)))
    assert len(trace) == args.n_routing_sites
    for site, sources in enumerate(trace):
        n = len(sources)
        _, weights = route_reference(sources, model.routing.query[site], model.routing.key_norm[site],
                                     args.resolved_routing_heads, return_weights=True)
        assert weights.shape[-1] == args.resolved_routing_heads
        assert torch.equal(weights, torch.full_like(weights, 1.0 / n)), (family, site)
    # Uniform sublayer routing has entropy log N at a site with N sources: mean over S = 2L+1 sites.
    expected = sum(math.log(len(s)) for s in trace) / len(trace)
    assert routing_entropy(model, tokens(args)) == pytest.approx(expected, rel=1e-5)


# -- residual paths ------------------------------------------------------------------------

@pytest.mark.parametrize("granularity", ["sublayer", "block"])
def test_delta_with_zero_alpha_is_bit_identical_to_standard(granularity):
    base_args = tiny(tie_embeddings=False)
    base = build(base_args, seed=1)
    delta_args = tiny(tie_embeddings=False, residual="attn_res", routing_mode="delta", routing_null_source=True,
                      routing_granularity=granularity, routing_block_layers=2, routing_heads=4)
    delta = Transformer(delta_args)
    missing, unexpected = delta.load_state_dict(base.state_dict(), strict=False)
    assert not unexpected and all(name.startswith("routing.") for name in missing)
    with torch.no_grad():
        delta.routing.query.normal_()
        delta.routing.key_norm.uniform_(0.5, 1.5)
        delta.routing.null_source.normal_()
        delta.routing.alpha.zero_()
    x = tokens(base_args)
    with torch.no_grad():
        assert torch.equal(delta(x), base(x))
        delta.routing.alpha.fill_(0.1)  # the gate really is wired in
        assert not torch.allclose(delta(x), base(x))


def record_sublayer_outputs(model):
    """Forward hooks on every attention / MLP module: the independent record of a_i and m_i."""
    outputs = {"a": [], "m": []}
    for layer in model.layers:
        layer.attention.register_forward_hook(lambda mod, inp, out: outputs["a"].append(out))
        layer.feed_forward.register_forward_hook(lambda mod, inp, out: outputs["m"].append(out))
    return outputs


def assert_same_sources(got, expected):
    assert len(got) == len(expected)
    for site, (g, e) in enumerate(zip(got, expected)):
        assert len(g) == len(e), f"site {site}: {len(g)} sources, expected {len(e)}"
        for n, (x, y) in enumerate(zip(g, e)):
            assert torch.equal(x, y), f"site {site}, source {n}"


def random_queries(model):
    with torch.no_grad():
        model.routing.query.normal_()
    return model


def trace_sources(model, x):
    """The per-site source lists the model routes over, the embedding and the recorded (a_i), (m_i)."""
    out = record_sublayer_outputs(model)
    trace = []
    with torch.no_grad():
        trace.extend(site_sources(model, x))
        emb = model.tok_embeddings(x)
    return trace, emb, out["a"], out["m"]


def test_block_sources_on_three_layers_match_hand_built_lists():
    # Blocks of 2 layers: the embedding is block b_0, layers 0-1 form b_1, layer 2 starts b_2.
    args = tiny(n_layers=3, residual="attn_res", routing_granularity="block", routing_block_layers=2)
    trace, emb, (a0, a1, a2), (m0, m1, m2) = trace_sources(random_queries(build(args)), tokens(args))
    b1 = a0 + m0 + a1 + m1  # completed block: sum of its sublayer outputs, no embedding
    assert_same_sources(trace, [
        [emb],                     # layer 0 attention: one source, returned as is
        [emb, a0],                 # layer 0 MLP: block 0 = embedding closed, partial = a0
        [emb, a0 + m0],
        [emb, a0 + m0 + a1],
        [emb, b1],                 # layer 2 attention: partial holds all of block 1, not yet closed
        [emb, b1, a2],             # layer 2 starts a block: b1 closed once, partial restarts at a2
        [emb, b1, a2 + m2],        # final routing
    ])


def test_sublayer_and_delta_block_sources_match_hand_built_lists():
    args = tiny(n_layers=3, residual="attn_res", routing_heads=2)
    trace, emb, (a0, a1, a2), (m0, m1, m2) = trace_sources(random_queries(build(args)), tokens(args))
    assert_same_sources(trace, [
        [emb], [emb, a0], [emb, a0, m0], [emb, a0, m0, a1], [emb, a0, m0, a1, m1],
        [emb, a0, m0, a1, m1, a2], [emb, a0, m0, a1, m1, a2, m2],
    ])

    args = tiny(n_layers=3, **ROUTED["delta block"])
    model = random_queries(build(args))
    with torch.no_grad():
        model.routing.alpha.fill_(0.5)
    trace, emb, (a0, a1, a2), (m0, m1, m2) = trace_sources(model, tokens(args))
    null, d1, d2 = model.routing.null_source, a0 + m0 + a1 + m1, a2 + m2  # true block deltas
    assert_same_sources(trace, [[null, emb]] * 4 + [[null, emb, d1]] * 2 + [[null, emb, d1, d2]])


def test_no_block_holds_a_routing_parameter():
    for family, overrides in ROUTED.items():
        model = Transformer(tiny(**overrides))
        routing = {id(p) for p in model.routing.parameters()}
        names = {name for name, _ in model.routing.named_parameters()}
        assert names <= {"query", "key_norm", "alpha", "null_source"} and {"query", "key_norm"} <= names
        for layer in model.layers:
            for name, p in layer.named_parameters():
                assert id(p) not in routing, (family, name)
                assert p.shape[0] != model.args.n_routing_sites, (family, name)
        others = {id(p) for name, p in model.named_parameters() if not name.startswith(("routing.", "layers."))}
        assert others.isdisjoint(routing)


@pytest.mark.parametrize("family", ["baseline", "mhar H=8", "block", "delta block"])
def test_logits_are_causal(family):
    args = tiny(**ROUTED.get(family, {}))
    model = random_queries(build(args)) if family != "baseline" else build(args)
    x = tokens(args, T=10)
    y = x.clone()
    y[:, 6:] = (y[:, 6:] + 1) % args.vocab_size
    with torch.no_grad():
        lx, ly = model(x), model(y)
    torch.testing.assert_close(lx[:, :6], ly[:, :6], rtol=0, atol=0)
    assert not torch.allclose(lx[:, 6:], ly[:, 6:])


def test_forward_rejects_sequences_longer_than_max_seq_len():
    args = tiny()
    with pytest.raises(ValueError, match="max_seq_len=32"):
        build(args)(tokens(args, T=33))


def test_forward_rejects_empty_batches_and_token_ids_outside_the_vocabulary():
    """A tokenizer with a larger vocabulary than the model (ids >= vocab_size), an empty sequence or
    float "tokens" get a ValueError naming the problem, not an IndexError inside the embedding."""
    args = tiny(residual="attn_res", routing_heads=4)
    model = build(args)
    with pytest.raises(ValueError, match=r"token ids span \[3, 256\] but vocab_size=256: the tokenizer"):
        model(torch.tensor([[3, 256, 7]]))
    with pytest.raises(ValueError, match=r"token ids span \[-1, 5\]"):
        model(torch.tensor([[5, -1]]))
    with pytest.raises(ValueError, match=r"at least one token per sequence, got shape \(2, 0\)"):
        model(torch.zeros(2, 0, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\(B, T\) integer tensor, got \(1, 2\) torch.float32"):
        model(torch.zeros(1, 2))
    assert model(torch.tensor([[0, 255]])).shape == (1, 2, 256)  # the whole id range is accepted


# -- RoPE ------------------------------------------------------------------------------------

def test_rope_is_rotate_half():
    args = tiny()
    model = build(args)
    hd = args.head_dim
    x = torch.randn(1, 1, 5, hd)
    out = apply_rope(x, model.rope_cos[:5], model.rope_sin[:5])
    inv_freq = 1.0 / args.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    for pos in range(5):
        for i in range(hd // 2):  # pair (i, i + hd/2) rotated by pos * inv_freq[i]
            c, s = math.cos(pos * inv_freq[i]), math.sin(pos * inv_freq[i])
            u, v = x[0, 0, pos, i].item(), x[0, 0, pos, i + hd // 2].item()
            assert out[0, 0, pos, i].item() == pytest.approx(u * c - v * s, abs=1e-5)
            assert out[0, 0, pos, i + hd // 2].item() == pytest.approx(v * c + u * s, abs=1e-5)


def test_llama3_rope_scaling_regimes():
    args = ModelArgs.from_flavor("llama3_8b")
    plain = rope_frequencies(ModelArgs.from_flavor("llama3_8b", rope_scaling=None)).double()
    scaled = rope_frequencies(args).double()
    wavelen = 2 * math.pi / plain
    short = wavelen < 8192 / 4  # high frequencies: unchanged
    long = wavelen > 8192 / 1  # low frequencies: divided by the factor 8
    medium = ~short & ~long
    assert short.any() and long.any() and medium.any()
    torch.testing.assert_close(scaled[short], plain[short])
    torch.testing.assert_close(scaled[long], plain[long] / 8)
    assert ((scaled[medium] < plain[medium]) & (scaled[medium] > plain[medium] / 8)).all()


def _leaves(value, path="output"):
    """(path, leaf) of a nested tuple / NamedTuple / `router.BlockSources` (its entries tuple) /
    `router.RoutingLink` (its sources and its BlockRouting); a dict or list anywhere is reported as
    a leaf."""
    from mhar_titan.models.router import BlockSources, RoutingLink

    if isinstance(value, RoutingLink):
        return _leaves(value.sources, f"{path}.sources")
    if hasattr(value, "enter") and hasattr(value, "leave"):  # another connection's link: its tensors
        return [leaf for name in getattr(value, "__slots__", ()) if isinstance(getattr(value, name), (tuple, torch.Tensor))
                for leaf in _leaves(getattr(value, name), f"{path}.{name}")]
    if isinstance(value, BlockSources):
        return _leaves(value.entries, f"{path}.entries")
    if isinstance(value, tuple):
        return [leaf for i, v in enumerate(value) for leaf in _leaves(v, f"{path}[{i}]")]
    return [(path, value)]


@pytest.mark.parametrize("overrides", [
    dict(), dict(residual="attn_res", routing_heads=2),
    dict(residual="attn_res", routing_heads=2, routing_mode="delta", routing_null_source=True, routing_group_size=3),
    dict(residual="attn_res", routing_heads=2, routing_granularity="block", routing_block_layers=2,
         routing_group_size="auto"),
], ids=["baseline", "mhar", "delta g=3", "block auto"])
def test_block_forward_has_three_inputs_of_tensors_and_returns_tensors(overrides):
    """TransformerBlock.forward(carried, attention_context, link): three parameters besides self, no
    *args / **kwargs; what travels into and out of every block is tensors (or None) in tuples, never
    a dict or a list (issue 20, acceptance 2). Depth routing's link holds the sources, one tuple in a
    `router.BlockSources`, which FSDP2's argument walk does not open (see its docstring), and the
    block's `BlockRouting` (tensors)."""
    import inspect

    from mhar_titan.models.model import TransformerBlock
    from mhar_titan.models.router import BlockSources, RoutingLink

    parameters = list(inspect.signature(TransformerBlock.forward).parameters.values())[1:]
    assert [p.name for p in parameters] == ["carried", "attention_context", "link"]
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in parameters)
    args = ModelArgs(dim=32, n_layers=4, n_heads=2, n_kv_heads=1, ffn_dim=64, vocab_size=64, max_seq_len=16,
                     **overrides)
    model = Transformer(args)
    model.init_weights()
    seen = []
    for layer in model.layers:
        layer.register_forward_hook(lambda mod, inputs, output: seen.append((inputs, output)), with_kwargs=False)
    model(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
    assert len(seen) == args.n_layers
    carried = 0
    for inputs, output in seen:
        assert len(inputs) == 3
        link = inputs[2]
        if args.residual == "attn_res":
            assert type(link) is RoutingLink and type(link.sources) is BlockSources
            assert type(link.sources.entries) is tuple
        for path, leaf in _leaves(inputs, "inputs") + _leaves(output):
            assert leaf is None or isinstance(leaf, torch.Tensor), (path, type(leaf))
        carried += len(getattr(output, "states", ()))
    assert (carried > 0) == (args.routing_group_size == 3)  # grouped states leave blocks as tuples
