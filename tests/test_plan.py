"""The routing plan: the model routes over exactly the plan's sources; metrics, dry run, state-dict
keys and checkpoints are unchanged by it (fixtures recorded before it, tests/fixtures/record_pre_plan.py)."""
import dataclasses
import json
import pathlib
import shutil
import weakref
from types import SimpleNamespace

import pytest
import torch

import mhar_titan.models.model as model_module
import mhar_titan.models.router as router_module
from mhar_kernels import dispatch
from mhar_titan.checkpoint import LEGACY_MODEL_DEFAULTS, CheckpointConfig, CheckpointManager
from mhar_titan.config import ActivationCheckpoint
from mhar_titan.dryrun import _activation_elements_per_token
from mhar_titan.metrics import flops_per_token, routing_source_counts
from mhar_titan.models.args import FAMILIES, FLAVORS, ModelArgs
from mhar_titan.models.model import Transformer
from mhar_titan.models.plan import OUTPUT, STREAM, RoutingPlan, Site, Source, _source
from helpers import site_sources

FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures"
SHAPE = dict(dim=16, n_heads=2, n_kv_heads=1, ffn_dim=32, vocab_size=32, max_seq_len=8)
GRANULARITIES = {"sublayer": {}, **{f"block k={k}": dict(routing_granularity="block", routing_block_layers=k)
                                    for k in (1, 2, 3)}}


pytestmark = pytest.mark.usefixtures("one_thread")


def routed_calls(model, x, monkeypatch):
    """Run hidden_states on `x`, recording what each `route` call really received, each
    sublayer's output (forward hooks) and the embedding; returns (calls, trace, emb, outputs)."""
    calls, outputs, emb = [], {}, []
    real_route = dispatch.route

    def spy(sources, *args, **kwargs):
        calls.append(list(sources))
        return real_route(sources, *args, **kwargs)

    monkeypatch.setattr(dispatch, "route", spy)
    model.tok_embeddings.register_forward_hook(lambda mod, inp, out: emb.append(out))
    for i, layer in enumerate(model.layers):
        for j, sublayer in ((2 * i, layer.attention), (2 * i + 1, layer.feed_forward)):
            sublayer.register_forward_hook(lambda mod, inp, out, j=j: outputs.__setitem__(j, out))
    trace = []
    with torch.no_grad():
        trace.extend(site_sources(model, x))
    return calls, trace, emb[0], outputs


@pytest.mark.parametrize("null", [False, True], ids=["no null", "null"])
@pytest.mark.parametrize("mode", ["replace", "delta"])
@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("family", ["attn_res H=1", "mhar H=8"])
def test_model_routes_over_the_plans_sources(family, granularity, mode, null, monkeypatch):
    """For 1..5 layers: every route call receives the plan's entries (identity), the trace is the
    same lists, and each entry holds the value the plan states (embedding + sublayer outputs)."""
    for n_layers in range(1, 6):
        args = ModelArgs(**SHAPE, n_layers=n_layers, **FAMILIES[family], **GRANULARITIES[granularity],
                         routing_mode=mode, routing_null_source=null)
        plan = RoutingPlan.from_args(args)
        torch.manual_seed(n_layers)
        model = Transformer(args)
        model.init_weights()
        with torch.no_grad():
            model.routing.query.normal_()
            if mode == "delta":
                model.routing.alpha.fill_(0.5)
        x = torch.randint(0, args.vocab_size, (2, 5), generator=torch.Generator().manual_seed(n_layers))
        with monkeypatch.context() as patch:
            calls, trace, emb, outputs = routed_calls(model, x, patch)
        where = f"{family}, {granularity}, {mode}, null={null}, L={n_layers}"
        assert plan.n_sites == len(calls) == len(trace) == 2 * n_layers + 1, where
        assert plan.source_counts == tuple(len(c) for c in calls), where
        entries = {}
        for site, call, traced in zip(plan.sites, calls, trace):
            assert len(call) == len(traced) == len(site.reads), (where, site.index)
            for index, routed, listed in zip(site.reads, call, traced):
                assert routed is listed, (where, site.index, index)
                assert entries.setdefault(index, routed) is routed, (where, site.index, index)
        assert len({id(t) for t in entries.values()}) == len(entries), where
        for index, tensor in entries.items():
            source = plan.sources[index]
            terms = ([emb] if source.embedding else []) + [outputs[j] for j in source.sublayers]
            if source.kind == "null":
                assert tensor is model.routing.null_source and not terms, where
            elif len(terms) == 1:
                assert tensor is terms[0], (where, source)
            else:
                torch.testing.assert_close(tensor, sum(terms[1:], terms[0]), msg=f"{where}, {source}")


def paper_like_plan(args) -> RoutingPlan:
    """A second layout as data: MHAR_SPEC 1.4's block-delta sources as the paper's code builds them,
    at each block end (stream h) minus the previous block entry (emb, D1, emb + D2, D1 + D3, ...)."""
    sources, sites, k = [Source(0, "embedding", embedding=True)], [], args.routing_block_layers
    for index in range(2 * args.n_layers):
        layer = index // 2
        ends_block = index % 2 == 1 and (layer + 1) % k == 0
        created = (_source(len(sources), "block", index, ((1, STREAM), (-1, len(sources) - 1)), sources),) \
            if ends_block else ()
        sites.append(Site(index, layer, ("attention", "mlp")[index % 2], tuple(range(len(sources))), created, True))
        sources += created
    sites.append(Site(2 * args.n_layers, None, "final", tuple(range(len(sources))), (), True))
    return RoutingPlan("paper-like", "block", "delta", False, True, tuple(sources), tuple(sites))


def test_a_second_layout_is_data(monkeypatch):
    """Entries built from the residual stream and a subtracted entry run through the same forward."""
    args = ModelArgs(**SHAPE, n_layers=4, residual="attn_res", routing_heads=2, routing_mode="delta",
                     routing_granularity="block", routing_block_layers=1)
    plan = paper_like_plan(args)
    # values derived from the recipes: D_n is the sum of block n's two sublayer outputs
    assert [(s.embedding, s.sublayers) for s in plan.sources] == [
        (True, ()), (False, (0, 1)), (True, (2, 3)), (False, (0, 1, 4, 5)), (True, (2, 3, 6, 7))]
    monkeypatch.setattr(model_module.RoutingPlan, "from_args", lambda args: plan)
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    with torch.no_grad():
        model.routing.alpha.fill_(0.5)
        model.routing.query.normal_()
    x = torch.randint(0, args.vocab_size, (2, 5), generator=torch.Generator().manual_seed(0))
    calls, trace, emb, outputs = routed_calls(model, x, monkeypatch)
    assert [len(c) for c in calls] == [1, 1, 2, 2, 3, 3, 4, 4, 5]
    for index, tensor in enumerate(calls[-1]):
        source = plan.sources[index]
        expected = sum((outputs[j] for j in source.sublayers), emb if source.embedding else 0)
        torch.testing.assert_close(tensor, expected, msg=str(source))


def test_forward_frees_entries_no_later_site_uses(monkeypatch):
    """Block-delta partial sums that no site routes over are not kept to the end of the forward:
    at the final routing only the completed blocks are alive (the last layer's partial sum too is
    freed once the flow has released it)."""
    args = ModelArgs(**SHAPE, n_layers=4, residual="attn_res", routing_mode="delta", routing_granularity="block",
                     routing_block_layers=2)
    plan, model = RoutingPlan.from_args(args), Transformer(args)
    model.init_weights()
    created, alive_at_final = [], []
    real_new_sources, real_route = router_module.new_sources, dispatch.route

    def recording_new_sources(*args):
        out = real_new_sources(*args)
        created.extend(weakref.ref(t) for t in out)
        return out

    def spy(sources, *args, **kwargs):
        if len(created) == len(plan.sources) - len(plan.initial):  # the final routing
            alive_at_final.extend(ref() is not None for ref in created)
        return real_route(sources, *args, **kwargs)

    monkeypatch.setattr(router_module, "new_sources", recording_new_sources)
    monkeypatch.setattr(dispatch, "route", spy)
    with torch.no_grad():
        model.hidden_states(torch.zeros(1, 4, dtype=torch.long))
    # entries 1..4: block 1's partial sums (4 = D1), 5..8: block 2's (8 = D2); layer 3 made 7, 8
    assert plan.last_use == (8, 1, 2, 3, 8, 5, 6, 7, 8)
    assert alive_at_final == [False, False, False, True, False, False, False, True]


def test_baseline_plan_is_empty_and_keeps_the_stream():
    plan = RoutingPlan.from_args(ModelArgs(**SHAPE, n_layers=3))
    assert (plan.sites, plan.sources, plan.source_counts, plan.source_rows) == ((), (), (), 0)
    assert plan.stream and plan.final is None and plan.layer_sites(1) == (None, None)


def test_block_plans_by_hand():
    """Blocks of 2 layers over 3 layers (MHAR_SPEC 1.2 convention, as test_models spells out)."""
    block = RoutingPlan.from_args(ModelArgs(**SHAPE, n_layers=3, residual="attn_res",
                                            routing_granularity="block", routing_block_layers=2))
    # entries: 0 emb, 1 a0, 2 a0+m0, 3 +a1, 4 +m1 (= b1), 5 a2, 6 a2+m2 (= b2)
    assert [s.reads for s in block.sites] == [(0,), (0, 1), (0, 2), (0, 3), (0, 4), (0, 4, 5), (0, 4, 6)]
    assert [s.opens_block for s in block.sites] == [True, False, False, False, True, False, False]
    assert [(b.first_layer, b.stop_layer, b.source) for b in block.blocks] == [(0, 2, 4), (2, 3, 6)]
    assert block.sources[4].sublayers == (0, 1, 2, 3) and not block.sources[4].embedding
    assert block.sources[3].recipe == ((1, 2), (1, OUTPUT))
    delta = RoutingPlan.from_args(ModelArgs(**SHAPE, n_layers=3, residual="attn_res", routing_mode="delta",
                                            routing_granularity="block", routing_block_layers=2,
                                            routing_null_source=True))
    # entries: 0 null, 1 emb, 2..5 partials of block 1 (5 = D1), 6, 7 partials of block 2 (7 = D2)
    assert [s.reads for s in delta.sites] == [(0, 1)] * 4 + [(0, 1, 5)] * 2 + [(0, 1, 5, 7)]
    assert all(s.gated for s in delta.sites) and delta.stream
    assert delta.source_counts == (2, 2, 2, 2, 3, 3, 4) and delta.source_rows == 1 + 1 + 1 + 1 + 2 + 2 + 3


def test_plan_rejects_impossible_layouts():
    emb = Source(0, "embedding", embedding=True)
    a0 = Source(1, "output", site=0, recipe=((1, OUTPUT),), sublayers=(0,))
    good = dict(layout="clean", granularity="sublayer", mode="replace", null_source=False, stream=False)
    with pytest.raises(ValueError, match=r"site 0 reads \(0, 1\) but only entries 0..0 exist"):
        RoutingPlan(**good, sources=(emb, a0), sites=(Site(0, 0, "attention", (0, 1), (a0,)),))
    stream = dataclasses.replace(a0, recipe=((1, STREAM),))
    with pytest.raises(ValueError, match="reads the residual stream, which replace mode does not keep"):
        RoutingPlan(**good, sources=(emb, stream), sites=(Site(0, 0, "attention", (0,), (stream,)),))
    with pytest.raises(ValueError, match="unknown routing layout .fancy."):
        RoutingPlan.from_args(ModelArgs(residual="attn_res"), layout="fancy")


# -- numbers and keys recorded before the plan existed ----------------------------------------

PRE_PLAN = json.loads((FIXTURES / "pre_plan_numbers.json").read_text())
ZOO = [(flavor, family) for flavor in FLAVORS for family in FAMILIES]
# Before the plan, metrics counted block-delta sites like block-replace ones (one partial sum
# too many per site, which that mode never routes over); the plan counts what the model routes.
CORRECTED = {"delta block H=8 +null"}
# Before the dry run read the plan, it charged site s s key rows in every layout; block granularity
# routes over block sums, fewer rows: those estimates drop where eager routing saves keys.
CORRECTED_KEYS = {family for family, fields in FAMILIES.items() if fields.get("routing_granularity") == "block"}


@pytest.mark.parametrize("flavor, family", ZOO)
def test_metrics_and_dry_run_numbers_are_unchanged(flavor, family):
    recorded = PRE_PLAN[f"{flavor}/{family}"]
    args = ModelArgs.from_flavor(flavor, **FAMILIES[family])
    counts = routing_source_counts(args)
    assert counts == list(RoutingPlan.from_args(args).source_counts)
    if family in CORRECTED:
        assert sum(counts) < sum(recorded["source_counts"])
    else:
        assert counts == recorded["source_counts"]
        assert dataclasses.asdict(flops_per_token(args, 2048)) == recorded["flops"]
    lower = []
    for key, value in recorded.items():
        if key.startswith("activations/"):
            _, ac, kernel, device = key.split("/")
            mode, every = {"none": ("none", "2"), "full": ("full", "2"), "selective3": ("selective", "3")}[ac]
            cfg = SimpleNamespace(activation_checkpoint=ActivationCheckpoint(mode=mode, selective_ac_option=every))
            kernel_args = dataclasses.replace(args, routing_kernel=kernel)
            estimate = _activation_elements_per_token(kernel_args, cfg, device)
            if family in CORRECTED_KEYS:
                assert estimate <= value, key
                lower.append(estimate < value)
            else:
                assert estimate == value, key
    assert any(lower) == (family in CORRECTED_KEYS)


def slug(family: str) -> str:
    return family.replace(" ", "_").replace("=", "").replace("+", "")


@pytest.mark.parametrize("family", FAMILIES)
def test_state_dict_keys_and_shapes_are_unchanged(family):
    with torch.device("meta"):
        model = Transformer(ModelArgs.from_flavor("debug", **FAMILIES[family]))
    listed = "".join(f"{k} {tuple(v.shape)}\n" for k, v in model.state_dict().items())
    assert listed == (FIXTURES / "state_dict_keys" / f"{slug(family)}.txt").read_text()


def pre_plan_fields(args) -> dict:
    """ModelArgs as the pre-plan code had them (routing_group_size came later and is resumable;
    the fields of LEGACY_MODEL_DEFAULTS (routing layout, head layout, document masking) came later
    and the trainer's fingerprint leaves them out at their defaults)."""
    later = ("routing_group_size", *LEGACY_MODEL_DEFAULTS)
    return {k: v for k, v in dataclasses.asdict(args).items() if k not in later}


def test_checkpoint_written_before_the_plan_resumes(tmp_path):
    """A delta-block train state (model, AdamW after one step) saved by the pre-plan code loads
    into today's model and gives the same logits; training continues from it."""
    run = tmp_path / "run"
    shutil.copytree(FIXTURES / "pre_plan_checkpoint", run)
    expected = torch.load(run / "expected.pt", weights_only=True)
    args = ModelArgs(**expected["args"])
    model = Transformer(args)
    model.init_weights()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    manager = CheckpointManager(CheckpointConfig(enable=True, folder="checkpoint"), run, model=model,
                                optimizer=optimizer, fingerprint={"model_args": pre_plan_fields(args)})
    assert manager.load() == 1
    with torch.no_grad():
        # The fixture's logits were computed on another CPU: matrix products round differently
        # across CPU models (an AMD EPYC differs from the recording machine in the last bits), so
        # compare within a tolerance far below what a wrong weight would change (|logits| <= 0.36
        # here; one mis-loaded tensor moves them by more than 1e-2), not bitwise.
        torch.testing.assert_close(model(expected["batch"]), expected["logits"], rtol=1e-5, atol=1e-6)
    assert all(optimizer.state[p]["step"].item() == 1 for p in model.parameters())
    model(expected["batch"]).float().logsumexp(-1).mean().backward()
    optimizer.step()
    assert all(optimizer.state[p]["step"].item() == 2 for p in model.parameters())
