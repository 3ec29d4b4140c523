"""The paper's delta layout (issue 14, acceptance 3): its source list at every site equals a list
built by hand from the five points of the issue, for 1 to 9 layers and blocks of 1 to 4 layers."""
from __future__ import annotations

from collections import Counter

import pytest

from mhar_titan.models.args import ModelArgs, count_parameters
from mhar_titan.models.plan import RoutingPlan

SHAPE = dict(dim=16, n_heads=2, n_kv_heads=1, ffn_dim=32, vocab_size=32, max_seq_len=8, norm_eps=1e-5,
             routing_eps=1e-5, residual="attn_res", routing_mode="delta", routing_null_source=True,
             routing_heads=2, routing_layout="paper")


def by_hand(n_layers: int, block_layers: int | None) -> list[list]:
    """Source values per site from the issue's five points. A value is ("null", site) or a
    Counter of terms ("emb", sublayer numbers 2i / 2i+1).

    1. each sublayer site has its own null, read first; 2. there is no final site;
    3. layer 0's attention reads only its null and the embedding joins after it; a block source is
       appended after the boundary layer's attention routing; 4. at a boundary the appended source
       is the stream so far (before that attention output) minus the last appended source.
    Sublayer granularity (block_layers None): the embedding, then every sublayer output."""
    stream, appended, sites = Counter(["emb"]), [], []
    for layer in range(n_layers):
        attention, mlp = 2 * layer, 2 * layer + 1
        sites.append([("null", attention), *appended])
        if block_layers is None:
            if not appended:
                appended.append(Counter(["emb"]))
            appended.append(Counter([attention]))
        elif layer % block_layers == 0:
            appended.append(stream.copy() if not appended else stream - appended[-1])
        stream[attention] += 1
        sites.append([("null", mlp), *appended])
        stream[mlp] += 1
        if block_layers is None:
            appended.append(Counter([mlp]))
    return sites


def plan_values(plan: RoutingPlan) -> list[list]:
    values = []
    for site in plan.sites:
        row = []
        for j in site.reads:
            source = plan.sources[j]
            if source.kind == "null":
                row.append(("null", j))
            else:
                row.append(Counter((["emb"] if source.embedding else []) + list(source.sublayers)))
        values.append(row)
    return values


@pytest.mark.parametrize("block_layers", [None, 1, 2, 3, 4], ids=lambda k: "sublayer" if k is None else f"block{k}")
@pytest.mark.parametrize("n_layers", range(1, 10))
def test_paper_sources_equal_the_hand_built_lists(n_layers, block_layers):
    granularity = {} if block_layers is None else dict(routing_granularity="block", routing_block_layers=block_layers)
    args = ModelArgs(**SHAPE, n_layers=n_layers, **granularity)
    plan = RoutingPlan.from_args(args)
    assert plan.layout == "paper" and plan.final is None and plan.n_nulls == 2 * n_layers
    assert plan_values(plan) == by_hand(n_layers, block_layers)
    assert args.n_routing_sites == 2 * n_layers
    clean = ModelArgs(**{**SHAPE, "routing_layout": "clean"}, n_layers=n_layers, **granularity)
    d = SHAPE["dim"]
    # paper: 2L sites (no final) and 2L nulls; clean: 2L + 1 sites and one null
    assert count_parameters(args).routing - count_parameters(clean).routing == (2 * n_layers - 1) * d - (2 * d + 1)


def test_alternating_block_sources_of_the_issue():
    """Point 4's table: emb, D1, emb + D2, D1 + D3, emb + D2 + D4 (blocks of 2 layers, 9 layers)."""
    plan = RoutingPlan.from_args(ModelArgs(**SHAPE, n_layers=9, routing_granularity="block", routing_block_layers=2))
    D = {n: set(range(4 * (n - 1), 4 * n)) for n in range(1, 5)}
    blocks = [plan.sources[j] for j in plan.sites[-1].reads[1:]]
    assert [(s.embedding, set(s.sublayers)) for s in blocks] == [
        (True, set()), (False, D[1]), (True, D[2]), (False, D[1] | D[3]), (True, D[2] | D[4])]


def test_paper_layout_needs_delta_nulls_and_the_norm_eps():
    with pytest.raises(ValueError, match="routing_eps = norm_eps = 1e-05"):
        ModelArgs(**{**SHAPE, "routing_eps": 1e-6}, n_layers=2)
    with pytest.raises(ValueError, match="routing_null_source=true"):
        ModelArgs(**{**SHAPE, "routing_null_source": False}, n_layers=2)
    with pytest.raises(ValueError, match="routing_mode='delta'"):
        ModelArgs(**{**SHAPE, "routing_mode": "replace"}, n_layers=2)


def test_fingerprint_of_a_clean_model_is_the_one_before_layouts_existed():
    """Checkpoints written before routing_layout existed still resume (their fingerprints lack it);
    a paper-layout model's fingerprint names its layout."""
    from mhar_titan.checkpoint import checkpoint_fingerprint

    clean = ModelArgs(**{**SHAPE, "routing_layout": "clean"}, n_layers=2)
    assert "routing_layout" not in checkpoint_fingerprint(clean, "gpt2")["model_args"]
    assert checkpoint_fingerprint(ModelArgs(**SHAPE, n_layers=2), "gpt2")["model_args"]["routing_layout"] == "paper"
