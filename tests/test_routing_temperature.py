"""The depth-logit scale and the learned routing temperature (model.routing_logit_scale,
model.routing_temperature; router.DepthRouting.effective_queries).

* every routing path (eager, compile, the fused kernels per call, grouped phase 1 and the fused
  merge, replace and delta, sublayer and block granularity, permuted heads, N up to 73, H in
  {1, 2, 8}): the logits and every gradient (the log-temperature's included) within 2e-4 of a
  float64 forward written here from the formula, softmax over depth of t_h <q_h, RMSNorm(k)_h>,
  from the raw pseudo-queries and temperatures (not through the accessor);
* scale 1 with a fixed temperature is the unscaled model bit for bit;
* the analysis reads what the forward routes with: the heatmap recorder's weights of every site
  equal the weights of the query the routing call was given (a scale planted inside the forward
  only fails the check), the probe reads the effective logits;
* no package code reads the raw pseudo-query or log-temperature outside the accessor;
* learned temperatures: never weight-decayed, never Muon's, logged; bad settings exit 2.

Triton runs through its interpreter on CPU (conftest), at tiny B*T and d.
"""
from __future__ import annotations

import ast
import copy
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from helpers import ROOT
from mhar_kernels import dispatch, reference
from mhar_titan.models import ModelArgs, Transformer
from mhar_titan.models.router import new_sources

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 128


def build(seed: int = 0, dtype=torch.float32, **fields) -> Transformer:
    """A tiny routing model with every routing parameter off its init (queries, key norms,
    log-temperatures, gates, null sources), so that routing is far from uniform and every
    gradient is non-zero."""
    base = dict(dim=16, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=32, vocab_size=VOCAB, max_seq_len=16,
                residual="attn_res")
    torch.manual_seed(seed)
    model = Transformer(ModelArgs(**{**base, **fields}))
    model.init_weights()
    r = model.routing
    with torch.no_grad():
        r.query.normal_(0.0, 1.0)
        r.key_norm.uniform_(0.5, 1.5)
        if r.log_temperature is not None:
            r.log_temperature.add_(torch.randn_like(r.log_temperature) * 0.3)
        if r.alpha is not None:
            r.alpha.uniform_(0.3, 0.8)
        if r.null_source is not None:
            r.null_source.normal_(0.0, 0.5)
    return model.to(dtype)


def tokens(batch: int = 1, length: int = 3, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------- the float64 formula
def formula_mix(sources, query, temperature, norm_weight, heads, eps, permutation=None):
    """softmax over depth of t_h <q_h, RMSNorm_g(s_n)_h>, the mix of the un-normalised sources,
    in float64; a (d,) null source broadcasts; head h reads coordinates permutation[h K:(h+1) K]."""
    shape = next(s.shape for s in sources if s.dim() > 1)
    x = torch.stack([s.double().expand(shape) for s in sources])  # (N, ..., d)
    key = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.double()
    q = query.double()
    if permutation is not None:
        x, key, q = x[..., permutation], key[..., permutation], q[permutation]
    split = x.shape[:-1] + (heads, x.shape[-1] // heads)
    logits = temperature.double() * (key.reshape(split) * q.reshape(heads, -1)).sum(-1)  # (N, ..., H)
    weights = torch.softmax(logits, dim=0)
    mix = (weights.unsqueeze(-1) * x.reshape(split)).sum(0).flatten(-2)
    return mix if permutation is None else mix[..., torch.argsort(permutation)]


def formula_logits(model: Transformer, ids: torch.Tensor) -> torch.Tensor:
    """The model's logits with every routing site computed by `formula_mix` from the RAW
    parameters (query, key norm, exp(log_temperature) or the configured scale): the block
    structure of model.TransformerBlock, the sources by the plan (router.new_sources)."""
    args, plan, r = model.args, model.plan, model.routing
    heads = args.resolved_routing_heads
    scale = args.resolved_logit_scale
    temps = r.log_temperature.exp() if r.log_temperature is not None else \
        torch.full((plan.n_sites, heads), scale, dtype=torch.float64)
    perm = reference.head_permutation(args.dim, args.routing_head_layout_seed) \
        if args.routing_head_layout == "permuted" else None
    context = model.attention_context(ids)
    h = model.tok_embeddings(ids)
    nulls = iter(r.null_sources())
    sources = [next(nulls) if e.kind == "null" else h for e in plan.initial]
    stream = h if plan.stream else None

    def route(site):
        i = site.index
        mix = formula_mix([sources[j] for j in site.reads], r.query[i], temps[i], r.key_norm[i], heads,
                          args.routing_eps, perm).to(h.dtype)
        return stream + r.alpha[i] * mix if site.gated else mix

    for i, layer in enumerate(model.layers):
        attention_site, mlp_site = plan.layer_sites(i)
        a = layer.attention(layer.attention_norm(route(attention_site)), context)
        stream = None if stream is None else stream + a
        sources += new_sources(attention_site, sources, a, stream)
        m = layer.feed_forward(layer.ffn_norm(route(mlp_site)))
        stream = None if stream is None else stream + m
        sources += new_sources(mlp_site, sources, m, stream)
    final = route(plan.final) if plan.final is not None else stream
    return F.linear(model.norm(final), model.tok_embeddings.weight)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-12)).item()


def logits_and_grads(model, ids, logits_fn, weight):
    model.zero_grad(set_to_none=True)
    logits = logits_fn(model, ids)
    (logits.double() * weight).sum().backward()
    return logits.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


PATHS = {  # name: ModelArgs fields (besides the tiny shape)
    "eager H=1 learned": dict(routing_heads=1, routing_temperature="learned", routing_logit_scale=0.5),
    "eager H=2 match_heads:8 block delta null": dict(
        routing_heads=2, routing_logit_scale="match_heads:8", routing_granularity="block", routing_block_layers=1,
        routing_mode="delta", routing_null_source=True),
    "eager H=8 learned permuted": dict(routing_heads=8, routing_temperature="learned",
                                       routing_head_layout="permuted", routing_head_layout_seed=3),
    "eager grouped g=3 H=2 learned": dict(routing_heads=2, routing_temperature="learned", routing_group_size=3),
    "compile H=2 learned": dict(routing_heads=2, routing_temperature="learned", routing_kernel="compile"),
    "triton H=8 learned": dict(routing_heads=8, routing_temperature="learned", routing_kernel="triton"),
    "triton H=2 fixed 2.5 delta null": dict(routing_heads=2, routing_logit_scale=2.5, routing_kernel="triton",
                                            routing_mode="delta", routing_null_source=True),
    "triton grouped g=3 H=2 learned block": dict(
        routing_heads=2, routing_temperature="learned", routing_kernel="triton", routing_group_size=3,
        routing_granularity="block", routing_block_layers=1, n_layers=3),
    "triton grouped g=2 H=1 learned delta null": dict(
        routing_heads=1, routing_temperature="learned", routing_logit_scale="match_heads:8", routing_kernel="triton",
        routing_group_size=2, routing_mode="delta", routing_null_source=True),
    "triton N=73 H=8 learned": dict(routing_heads=8, routing_temperature="learned", routing_logit_scale=0.7,
                                    routing_kernel="triton", n_layers=36, max_seq_len=4),
}


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.slow) if "N=73" in name or "compile" in name
                                  else name for name in PATHS])
# the slow tier: 73 sources through the Triton interpreter; torch.compile, which with a cold compile
# cache (a fresh CI runner) took 33 s (measured 2026-12-07, 2 cores)
def test_every_path_matches_the_float64_formula(name):
    """Logits and every parameter's gradient (pseudo-queries, key norms, log-temperatures, gates,
    nulls and the backbone) of each routing path in float32 within 2e-4 of the float64 formula."""
    fields = PATHS[name]
    ids = tokens(length=2 if fields.get("n_layers") == 36 else 3)
    model = build(**fields)
    reference_model = copy.deepcopy(model).double()  # formula_logits routes by the formula, not by a kernel
    weight = torch.randn(*ids.shape, VOCAB, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    logits, grads = logits_and_grads(model, ids, lambda m, x: m(x), weight)
    ref_logits, ref_grads = logits_and_grads(reference_model, ids, formula_logits, weight)
    assert set(grads) == set(ref_grads)
    if model.routing.log_temperature is not None:
        assert "routing.log_temperature" in grads and grads["routing.log_temperature"].abs().sum() > 0
    if fields.get("n_layers") == 36:
        assert max(model.plan.source_counts) == 73
    errors = {"logits": rel_err(logits, ref_logits), **{n: rel_err(grads[n], ref_grads[n]) for n in grads}}
    assert max(errors.values()) < 2e-4, {k: v for k, v in errors.items() if v >= 2e-4}


def test_the_kernel_paths_ran():
    """The "triton" and grouped cases above run the fused kernels here (the interpreter), not a
    silent eager fallback: the dispatcher picks them for these shapes."""
    assert dispatch.backend("triton", torch.device("cpu"), 16, 8) == "triton"
    assert dispatch.backend("triton", torch.device("cpu"), 16, 1) == "triton"


# ---------------------------------------------------------------------------- scale 1 is today's model
@pytest.mark.parametrize("kernel", ["eager", "triton"])
def test_scale_one_fixed_is_the_unscaled_model_bitwise(kernel):
    """At routing_logit_scale = 1 with a fixed temperature the forward reads the raw parameter
    itself (no multiplication in the graph) and the logits and gradients equal those of a model
    built without the keys, bit for bit."""
    ids = tokens(batch=2, length=4)
    plain = build(routing_heads=2, routing_kernel=kernel)
    explicit = build(routing_heads=2, routing_kernel=kernel, routing_logit_scale=1.0, routing_temperature="fixed")
    explicit.load_state_dict(plain.state_dict())
    assert explicit.routing.effective_queries() is explicit.routing.query
    weight = torch.randn(*ids.shape, VOCAB, dtype=torch.float64)
    a, grads_a = logits_and_grads(plain, ids, lambda m, x: m(x), weight)
    b, grads_b = logits_and_grads(explicit, ids, lambda m, x: m(x), weight)
    assert torch.equal(a, b)
    assert all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)
    # a scale of 1 written as match_heads:1 is the same factor, and still no multiplication
    assert build(routing_heads=2, routing_logit_scale="match_heads:1").routing.effective_queries().grad_fn is None


def test_scale_and_temperature_values():
    """match_heads:H is 1/sqrt(H); a learned temperature starts at the scale (log-temperature
    log(scale)) and folds into the query per head; a fixed scale multiplies every row."""
    model = Transformer(ModelArgs(dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=32, vocab_size=VOCAB,
                                  residual="attn_res", routing_heads=4, routing_logit_scale="match_heads:8",
                                  routing_temperature="learned"))
    model.init_weights()
    r = model.routing
    assert model.args.resolved_logit_scale == 1 / math.sqrt(8)
    assert torch.allclose(r.temperatures(), torch.full((3, 4), 1 / math.sqrt(8)))
    with torch.no_grad():
        r.query.normal_()
        r.log_temperature.copy_(torch.log(torch.tensor([[1.0, 2.0, 3.0, 4.0]] * 3)))
    expected = r.query.detach().view(3, 4, 4) * torch.tensor([1.0, 2.0, 3.0, 4.0]).view(1, 4, 1)
    assert torch.allclose(r.effective_queries().detach(), expected.view(3, 16), rtol=1e-6)
    assert torch.equal(r.effective_query(1).detach(), r.effective_queries()[1].detach())


# ---------------------------------------------------------------------------- analysis reads the forward's query
def forward_and_heatmap_weights(model, ids, plant: float | None = None):
    """(per site: the weights of the query each per-call routing call was GIVEN (recorded inside
    `dispatch.route`, where `plant` multiplies it: a scale applied only inside the forward), the
    weights the heatmap recorder took from the Router)."""
    from mhar_titan.analysis.routing import RoutingRecorder

    given = []
    original = dispatch.route

    def spy(sources, query, norm_weight, heads, eps=1e-6, kernel="eager", **kw):
        if plant is not None:
            query = query * plant
        _, weights = reference.route_reference([s.detach() for s in sources], query.detach(), norm_weight.detach(),
                                                heads, eps, return_weights=True, permutation=kw.get("permutation"))
        given.append(weights)
        return original(sources, query, norm_weight, heads, eps, kernel, **kw)

    recorder = RoutingRecorder(model, keep_weights=True)
    dispatch.route = spy
    try:
        with torch.no_grad(), model.observe_routing(recorder):
            model.hidden_states(ids)
    finally:
        dispatch.route = original
    return given, recorder.weights


def assert_heatmap_is_the_forward(model, ids, plant=None):
    given, heatmap = forward_and_heatmap_weights(model, ids, plant)
    assert len(given) == len(heatmap) == model.plan.n_sites
    for site, (a, b) in enumerate(zip(given, heatmap)):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), f"site {site}: the heatmap's weights are not the forward's"


@pytest.fixture(scope="module")
def permuted_learned():
    model = build(routing_heads=4, routing_temperature="learned", routing_head_layout="permuted",
                  routing_head_layout_seed=7, routing_logit_scale="match_heads:8")
    return model.eval(), tokens(batch=2, length=4)


def test_heatmap_weights_are_the_forwards_with_a_temperature_and_permuted_heads(permuted_learned):
    model, ids = permuted_learned
    assert_heatmap_is_the_forward(model, ids)
    # the temperatures matter here: the raw query's weights differ from the forward's
    given, _ = forward_and_heatmap_weights(model, ids)
    raw = reference.route_reference(
        [s.detach() for s in __import__("helpers").site_sources(model, ids)[-1]], model.routing.query[-1].detach(),
        model.routing.key_norm[-1].detach(), 4, model.args.routing_eps, return_weights=True,
        permutation=model.connection.settings.permutation)[1]
    assert not torch.allclose(raw, given[-1], atol=1e-3)


def test_a_scale_planted_inside_the_forward_fails_the_check(permuted_learned):
    """The check above is not vacuous: a scale applied in the forward only (not through the
    accessor) makes the heatmap disagree with the forward."""
    model, ids = permuted_learned
    with pytest.raises(AssertionError, match="not the forward's"):
        assert_heatmap_is_the_forward(model, ids, plant=1.7)


def test_probe_reads_the_effective_logits():
    """The query probe's per-site KL is that of the effective query t * q (single head)."""
    from helpers import site_sources
    from mhar_titan.analysis.probe import query_probe, slice_kl

    model = build(routing_heads=1, routing_temperature="learned", routing_logit_scale=0.25).eval()
    ids = tokens(batch=2, length=4)
    result = query_probe(model, [ids], slices=4, draws=2, seed=0)
    per_site = dict((site, kl) for site, kl, _ in result.per_site)
    r = model.routing
    with torch.no_grad():
        for site, sources in enumerate(site_sources(model, ids)):
            if len(sources) < 2:
                continue
            effective = r.query[site] * r.log_temperature[site].exp()
            expected = slice_kl(sources, effective, r.key_norm[site], 4, model.args.routing_eps).mean().item()
            raw = slice_kl(sources, r.query[site], r.key_norm[site], 4, model.args.routing_eps).mean().item()
            assert per_site[site] == pytest.approx(expected, rel=1e-5)
            assert abs(raw - expected) > 1e-4 * max(abs(expected), 1e-3)  # the temperature matters here


# ---------------------------------------------------------------------------- one accessor
PACKAGES = ("mhar_titan", "kernels/mhar_kernels")
RAW = ("query", "log_temperature")


def raw_reads(path: Path) -> list[str]:
    """`x.query` / `x.log_temperature` reads in one source file outside the accessor's class
    (router.DepthRouting), except the fields of the rows tuples (SiteRows, BlockRouting: their
    `query` rows are the effective ones) read as `rows.query`, `self.rows.query` or
    `routing.query` in router.py."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    allowed_nodes: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "DepthRouting":
            allowed_nodes |= {id(n) for n in ast.walk(node)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in RAW and id(node) not in allowed_nodes:
            receiver = node.value
            rows_tuple = (isinstance(receiver, ast.Name) and receiver.id in ("rows", "routing")
                          or isinstance(receiver, ast.Attribute) and receiver.attr == "rows")
            if path.name == "router.py" and rows_tuple and node.attr == "query":
                continue
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: .{node.attr}")
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr" and len(node.args) > 1 \
                and isinstance(node.args[1], ast.Constant) and node.args[1].value in RAW \
                and id(node) not in allowed_nodes:
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: getattr(..., {node.args[1].value!r})")
    return found


def test_no_package_code_reads_the_raw_query_outside_the_accessor():
    found = [hit for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py")) for hit in raw_reads(path)]
    assert not found, "read the effective query through DepthRouting.effective_queries / temperatures:\n" + \
        "\n".join(found)


def test_the_walk_finds_a_raw_read(tmp_path):
    """The walk above catches the trap of the issue (an analysis reading `p.query[site]`)."""
    planted = ROOT / "mhar_titan" / "analysis" / "_planted_raw_read_for_test.py"
    planted.write_text("def weights(p, site):\n    return p.query[site]\n")
    try:
        assert raw_reads(planted) == [f"{planted.relative_to(ROOT)}:2: .query"]
    finally:
        planted.unlink()


# ---------------------------------------------------------------------------- optimizer and metrics
def test_learned_temperature_is_routing_never_decayed_never_muon():
    from mhar_titan.config.sections import Optimizer
    from mhar_titan.metrics import routing_temperature_metrics
    from mhar_titan.optim import build_optimizer, param_group_of
    from mhar_titan.optim.build import optimizer_split

    model = build(routing_heads=2, routing_temperature="learned", routing_logit_scale="match_heads:4")
    assert param_group_of(model)["routing.log_temperature"] == "routing"
    t = model.routing.log_temperature
    for cfg in (Optimizer(weight_decay=0.1), Optimizer(name="Muon", weight_decay=0.1, muon_groups=["other"])):
        optimizer = build_optimizer(model, cfg)
        groups = [g for opt in getattr(optimizer, "optimizers", [optimizer]) for g in opt.param_groups]
        holding = [g for g in groups if any(p is t for p in g["params"])]
        assert len(holding) == 1 and holding[0]["weight_decay"] == 0.0
        assert "routing.log_temperature" not in dict(optimizer_split(model, cfg)["Muon"])
    metrics = routing_temperature_metrics(model)
    temps = t.detach().double().exp()
    assert metrics == pytest.approx({"routing_temperature_mean": temps.mean().item(),
                                     "routing_temperature_min": temps.min().item(),
                                     "routing_temperature_max": temps.max().item()})
    assert routing_temperature_metrics(build(routing_heads=2, routing_logit_scale=0.5)) == {}


def test_parameter_count_includes_the_temperatures():
    from mhar_titan.models.args import count_parameters

    model = build(routing_heads=4, routing_temperature="learned")
    assert count_parameters(model.args).total == sum(p.numel() for p in model.parameters())


def test_conversion_to_delta_keeps_the_logits_with_a_learned_temperature():
    """A standard model converted to delta-MHAR with a learned temperature (gates 0) computes the
    original's logits bit for bit; its log-temperatures start at log(scale)."""
    from mhar_titan.convert.delta import convert_to_delta

    torch.manual_seed(0)
    standard = Transformer(ModelArgs(dim=16, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=32, vocab_size=VOCAB))
    standard.init_weights()
    ids = tokens(batch=2, length=5)
    with torch.no_grad():
        expected = standard(ids)
    converted = convert_to_delta(standard, "clean", routing_heads=2, routing_block_layers=1,
                                 routing_temperature="learned", routing_logit_scale="match_heads:8")
    assert torch.allclose(converted.routing.log_temperature, torch.tensor(-0.5 * math.log(8)))
    with torch.no_grad():
        assert torch.equal(converted(ids), expected)


# ---------------------------------------------------------------------------- bad settings
BAD = ["0", "-1", "nan", "inf", "1e400", "true", "match_heads:0", "match_heads:x", "match_heads:-3", "match_heads:",
       "match_heads:2.5", "'1.0'",
       # finite as a Python float, but overflowing or vanishing once folded into a float32/bf16 query
       "1e39", "1e-46", "1e-300", "2e6", "match_heads:1099511627777"]


def test_the_scale_a_setting_means_decides_not_its_spelling():
    """'match_heads:1', 1 and 1.0 are the unscaled model: a baseline takes them, and a checkpoint's
    fingerprint records the scale, so a run resumes under either spelling."""
    from mhar_titan.checkpoint.fingerprint import checkpoint_fingerprint
    from mhar_titan.models.args import LOGIT_SCALE_RANGE, ModelArgs, logit_scale

    assert logit_scale("match_heads:1") == logit_scale(1) == 1.0
    assert [logit_scale(x) for x in LOGIT_SCALE_RANGE] == list(LOGIT_SCALE_RANGE)  # the bounds themselves pass
    ModelArgs.from_flavor("debug", residual="standard", routing_logit_scale="match_heads:1")  # no error
    prints = [checkpoint_fingerprint(ModelArgs.from_flavor("debug", residual="attn_res", routing_logit_scale=v), "gpt2")
              for v in (1.0, 1, "match_heads:1")]
    assert prints[0] == prints[1] == prints[2]
    eight = [checkpoint_fingerprint(ModelArgs.from_flavor("debug", residual="attn_res", routing_logit_scale=v), "gpt2")
             for v in ("match_heads:8", 1 / 8 ** 0.5)]
    assert eight[0] == eight[1] and eight[0] != prints[0]


@pytest.mark.parametrize("value", BAD)
def test_bad_scale_is_one_config_error_naming_the_key(value):
    from mhar_titan.config import load_config
    from mhar_titan.errors import ConfigError

    with pytest.raises(ConfigError, match="routing_logit_scale") as caught:
        load_config(str(ROOT / "train_configs" / "debug_attnres.toml"), [f"--model.routing_logit_scale={value}"])
    assert "\n" not in str(caught.value)


def test_bad_settings_exit_2_with_one_line_before_the_model_is_built(tmp_path, warm_python):
    for flag in ("--model.routing_logit_scale=match_heads:0", "--model.routing_temperature=warm",
                 "--model.routing_logit_scale=-2"):
        run = warm_python.run(["train.py", "--config", "train_configs/debug_attnres.toml", flag,
                               f"--job.dump_folder={tmp_path}"], timeout=300)
        assert run.returncode == 2, run.stderr
        lines = [line for line in run.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and flag.split("=")[0][2:] in lines[0], run.stderr
        assert not any(tmp_path.iterdir())  # nothing was built or written


# ---------------------------------------------------------------------------- train, resume, export
WORDS = "the of and to in that it is was he for on are as with his they at be this from have or by one had".split()
TRAIN_STEPS = 6


def write_corpus(root: Path) -> None:
    import random

    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(0)
    root.mkdir(parents=True)
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 120))) + "." for _ in range(80)]
    pq.write_table(pa.table({"text": docs}), root / "train-0.parquet")


def train(out: Path, corpus: Path, name: str, *flags: str) -> int:
    """`python train.py --config train_configs/debug_attnres.toml FLAGS`, shrunk (in process)."""
    from mhar_titan.train import main

    return main(["--config", str(ROOT / "train_configs" / "debug_attnres.toml"),
                 "--job.dump_folder", str(out), "--job.name", name,
                 "--data.files", f'["{corpus}/train-*.parquet"]', "--data.validation_files", "[]",
                 "--validation.enable", "false", "--training.local_batch_size", "2", "--training.seq_len", "16",
                 "--training.steps", str(TRAIN_STEPS), "--lr_scheduler.warmup_steps", "1",
                 "--metrics.log_freq", "1", "--debug.deterministic", "true",
                 "--checkpoint.interval", "3", "--checkpoint.keep_latest_k", "0", *flags])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Runs of the debug AttnRes config with match_heads:8 and with a learned temperature, and the
    learned run resumed from its step-3 checkpoint (a copy of the run without step 6)."""
    import shutil

    from mhar_titan.data.prepare_tokenizer import prepare_encoding
    from mhar_titan.data.tokenizer import default_cache_dir

    prepare_encoding("gpt2", default_cache_dir())
    out = tmp_path_factory.mktemp("temperature_runs")
    corpus = out / "corpus"
    write_corpus(corpus)
    assert train(out, corpus, "match", "--model.routing_logit_scale=match_heads:8") == 0
    assert train(out, corpus, "learned", "--model.routing_temperature=learned") == 0
    shutil.copytree(out / "learned", out / "resumed")
    shutil.rmtree(out / "resumed" / "checkpoints" / f"step-{TRAIN_STEPS}")
    (out / "resumed" / "metrics.jsonl").unlink()  # the rows of steps 4-6 below are the resumed run's own
    assert train(out, corpus, "resumed", "--model.routing_temperature=learned") == 0
    return out


def losses(run: Path) -> dict[int, dict]:
    from helpers import read_metrics

    return {row["step"]: row for row in read_metrics(run) if "loss" in row}


@pytest.mark.parametrize("name", ["match", "learned"])
def test_debug_config_trains_to_a_falling_loss(trained, name):
    rows = losses(trained / name)
    assert sorted(rows) == list(range(1, TRAIN_STEPS + 1))
    first, last = rows[1]["loss"], rows[TRAIN_STEPS]["loss"]
    assert last < first - 0.5, (first, last)
    if name == "learned":  # the temperature is logged, starts at 1 and moves
        assert rows[1]["routing_temperature_mean"] == pytest.approx(1.0, abs=1e-2)
        assert rows[TRAIN_STEPS]["routing_temperature_max"] != rows[TRAIN_STEPS]["routing_temperature_min"]
    else:
        assert "routing_temperature_mean" not in rows[1]


def test_learned_temperature_resumes_bitwise(trained):
    """Steps 4-6 of the run resumed from step 3 equal the uninterrupted run's, bit for bit
    (loss, gradient norm, the temperatures), and so do the final weights."""
    from mhar_titan.convert.dcp_io import load_model_dcp

    straight, resumed = losses(trained / "learned"), losses(trained / "resumed")
    assert sorted(resumed) == list(range(4, TRAIN_STEPS + 1))
    for step in range(4, TRAIN_STEPS + 1):
        for key in ("loss", "grad_norm", "routing_temperature_mean", "routing_temperature_min",
                    "routing_temperature_max"):
            assert resumed[step][key] == straight[step][key], (step, key)
    a = load_model_dcp(trained / "learned" / "checkpoints" / f"step-{TRAIN_STEPS}").state_dict()
    b = load_model_dcp(trained / "resumed" / "checkpoints" / f"step-{TRAIN_STEPS}").state_dict()
    assert "routing.log_temperature" in a
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_learned_temperature_checkpoint_exports_and_generates_in_transformers(trained, tmp_path):
    """The learned run's checkpoint, exported (python -m mhar_titan.convert export), loads in stock
    transformers (remote code) with its temperatures and generates our greedy tokens."""
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from mhar_titan.convert.__main__ import main as convert
    from mhar_titan.convert.dcp_io import load_model_dcp
    from mhar_titan.eval.generation import generate

    folder = tmp_path / "exported"
    assert convert(["export", str(trained / "learned"), str(folder)]) == 0
    ours = load_model_dcp(trained / "learned" / "checkpoints" / f"step-{TRAIN_STEPS}").eval()
    hf = AutoModelForCausalLM.from_pretrained(str(folder), trust_remote_code=True).eval()
    assert hf.model.args.routing_temperature == "learned"
    assert torch.equal(hf.model.routing.log_temperature, ours.routing.log_temperature)
    assert not torch.allclose(ours.routing.log_temperature, torch.zeros(()))  # trained off its init
    prompt = [464, 286, 290, 284, 287]
    expected = generate(ours, prompt, 8).tolist()
    with torch.no_grad():
        got = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt):].tolist()
    assert got == expected


def test_heatmap_spread_panel_reports_the_temperature(permuted_learned, tmp_path):
    """The spread panel draws exp(entropy) of the forward's weights and names the temperature."""
    from mhar_titan.analysis.heatmap import plot_routing_heatmaps, temperature_label
    from mhar_titan.analysis.routing import routing_summary

    model, ids = permuted_learned
    label = temperature_label(model)
    t = model.routing.temperatures()
    assert label == f"t {float(t.min()):.3g}-{float(t.max()):.3g}"
    assert temperature_label(build(routing_heads=2, routing_logit_scale="match_heads:8")) == "t = 0.354"
    assert temperature_label(build(routing_heads=2)) == ""
    summary = routing_summary(model, [ids])
    heat = plot_routing_heatmaps(summary, tmp_path / "h.png", temperature=label)
    side = heat.axes["effective sources"]
    assert side.get_title() == f"spread\n{label}"
    drawn = side.get_lines()[0].get_xdata()
    _, weights = forward_and_heatmap_weights(model, ids)
    from mhar_titan.analysis.routing import token_entropy
    expected = [math.exp(token_entropy(w).double().mean().item()) for w in weights]
    assert list(drawn) == pytest.approx(expected, rel=1e-6)
    heat.close()


def test_fixed_scale_launches_move_todays_bytes():
    """A counted debug-flavor training step (bench/byte_count.py: every Triton launch's distinct
    bytes under the interpreter, every aten op's) with routing_logit_scale = match_heads:8 moves
    exactly the bytes of scale 1 in its routing launches; the rest differs by the fold alone,
    4 S d elements (the (S, d) multiply's read and write, forward and backward)."""
    sys.path.insert(0, str(ROOT / "bench"))
    from byte_count import count_step

    def count(**fields):
        args = ModelArgs.from_flavor("debug", residual="attn_res", routing_heads=8, routing_kernel="triton",
                                     n_layers=2, **fields)
        step, _ = count_step(args, 1, 4)
        return step, args

    today, args = count()
    scaled, _ = count(routing_logit_scale="match_heads:8")
    assert scaled.total("launch") == today.total("launch") > 0
    assert [e for e in scaled.entries if e.where == "launch"] == [e for e in today.entries if e.where == "launch"]
    assert scaled.total() - today.total() == 4 * args.n_routing_sites * args.dim * 2  # bf16


@pytest.mark.parametrize("kernel", ["eager", "triton"])
def test_kv_cache_decoding_with_a_learned_temperature(kernel):
    """Decoding with the KV cache routes each new token with the effective queries: the cached
    logits equal a full forward's, and greedy tokens equal those without a cache."""
    from mhar_titan.eval.generation import generate
    from mhar_titan.models.kv_cache import KVCache

    model = build(routing_heads=2, routing_temperature="learned", routing_logit_scale="match_heads:8",
                  routing_kernel=kernel).eval()
    ids = tokens(batch=1, length=6, seed=4)
    with torch.no_grad():
        full = model(ids)
        cache = KVCache(model.args.n_layers, [0], 8, model.args.max_seq_len)
        stepped = torch.cat([model(ids[:, :3], cache=cache), model(ids[:, 3:4], cache=cache),
                             model(ids[:, 4:], cache=cache)], dim=1)
        torch.testing.assert_close(stepped, full, rtol=1e-5, atol=1e-5)
        assert generate(model, ids[0], 6).tolist() == generate(model, ids[0], 6, use_cache=False).tolist()


def test_authors_format_refuses_a_scaled_model():
    """The authors' code has no logit scale: exporting a scaled model in their format is refused
    (before any weight is read), naming the setting and the format that holds it."""
    from mhar_titan.convert.folders import resolve_format
    from mhar_titan.convert.hf_config import ConversionError

    for fields in (dict(routing_logit_scale="match_heads:8"), dict(routing_temperature="learned")):
        args = build(routing_heads=2, **fields).args
        with pytest.raises(ConversionError, match="--format mhar"):
            resolve_format(args, "authors")
        assert resolve_format(args, "auto") == "mhar"
    assert resolve_format(build(routing_heads=2).args, "authors") == "authors"


def test_checkpoints_from_before_the_keys_keep_their_fingerprint():
    """At the defaults the two keys are left out of the checkpoint fingerprint, so a checkpoint
    saved before they existed resumes; a scaled or learned run records them (a resume across a
    change of scale or temperature is refused as another model)."""
    from mhar_titan.checkpoint.fingerprint import checkpoint_fingerprint

    keys = ("routing_logit_scale", "routing_temperature")
    plain = checkpoint_fingerprint(build(routing_heads=2).args, "gpt2")["model_args"]
    assert not set(keys) & set(plain)
    scaled = checkpoint_fingerprint(build(routing_heads=2, routing_logit_scale="match_heads:8",
                                          routing_temperature="learned").args, "gpt2")["model_args"]
    # the scale recorded is the one the setting means (1/sqrt(8)), whatever its spelling
    assert (scaled["routing_logit_scale"], scaled["routing_temperature"]) == (1 / math.sqrt(8), "learned")


def test_the_learned_temperature_per_site_is_read_from_the_checkpoint_and_drawn(trained, tmp_path):
    """analysis compare of the fixed-scale and the learned run draws temperature_sites: the learned
    run's exp(log_temperature) at its newest checkpoint, site by site (mean over heads, band from the
    least to the largest head), read without building the model; the fixed run is a grey level."""
    from mhar_titan.analysis.__main__ import main as analysis_main
    from mhar_titan.analysis.compare import read_run
    from mhar_titan.analysis.plots import pyplot
    from mhar_titan.analysis.temperature import plot_site_temperatures, read_site_temperatures, site_temperatures
    from mhar_titan.convert.dcp_io import load_model_dcp

    import numpy as np

    step, values = read_site_temperatures(trained / "learned")
    model = load_model_dcp(trained / "learned" / "checkpoints" / f"step-{TRAIN_STEPS}")
    expected = model.routing.log_temperature.detach().double().exp().numpy()
    assert step == TRAIN_STEPS and values.shape == (model.args.n_routing_sites, 1)
    assert np.array_equal(values, expected) and values.std() > 0  # the sites moved apart
    assert read_site_temperatures(trained / "match") is None  # a fixed scale learns nothing
    runs = [read_run(trained / "match"), read_run(trained / "learned")]
    sites, = site_temperatures(runs)
    assert sites.name == "learned" and sites.steps == (TRAIN_STEPS,) and np.array_equal(sites.values[0], expected)
    fig = plot_site_temperatures([sites], runs, tmp_path / "sites.png")
    curve, level = fig.axes[0].lines
    assert list(curve.get_ydata()) == pytest.approx(expected.mean(axis=1).tolist())
    assert list(level.get_ydata()) == pytest.approx([8 ** -0.5] * 2)
    assert fig.axes[0].get_xticklabels()[-1].get_text() == "final"
    pyplot().close(fig)
    out = tmp_path / "cmp"
    assert analysis_main(["compare", str(trained / "match"), str(trained / "learned"), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["comparison.md", "loss_vs_tokens.png", "routing_temperature.png",
                                                      "temperature_sites.png"]
    assert "](temperature_sites.png)" in (out / "comparison.md").read_text()
