"""Routing groups in the plan: how each group splits its sites' reads into phase 1 (entries that exist
when the group starts, read once) and phase 2 (in-group entries), and the rows this saves."""
import logging
from dataclasses import replace
from types import SimpleNamespace

import pytest

from mhar_titan.models import plan as plan_module
from mhar_titan.models.args import FAMILIES, ModelArgs
from mhar_titan.models.plan import RoutingPlan, best_group_size

SHAPE = dict(dim=16, n_heads=2, n_kv_heads=1, ffn_dim=32, vocab_size=32, max_seq_len=8)
LAYOUTS = {
    "sublayer": {},
    "sublayer delta null": dict(routing_mode="delta", routing_null_source=True),
    "block k=2": dict(routing_granularity="block", routing_block_layers=2),
    "block k=3 delta null": dict(routing_granularity="block", routing_block_layers=3, routing_mode="delta",
                                 routing_null_source=True),
}


def closed_form_rows(n_sites: int, g: int) -> int:
    """Sublayer granularity, no null source: site s (1-based) reads s rows; a group starting at site
    s0 reads s0 rows in phase 1 and s - s0 rows at each of its sites s (docs/DESIGN.md bytes model)."""
    total = 0
    for s0 in range(1, n_sites + 1, g):
        total += s0 + sum(s - s0 for s in range(s0, min(s0 + g, n_sites + 1)))
    return total


@pytest.mark.parametrize("layout", LAYOUTS)
def test_groups_split_every_sites_reads(layout):
    """For 1..4 layers and every g: groups are consecutive, cover all sites; each site's reads are its
    early entries (existing at group start, all in the group's phase-1 reads) and its late ones
    (created by an earlier site of the same group), its phase-1 read flags mark exactly its early
    entries; g = 1 leaves nothing late."""
    for n_layers in range(1, 5):
        base = RoutingPlan.from_args(ModelArgs(**SHAPE, n_layers=n_layers, residual="attn_res", **LAYOUTS[layout]))
        for g in range(1, base.n_sites + 2):
            plan = replace(base, group_size=g)
            assert [s for group in plan.groups for s in group.sites] == list(range(plan.n_sites))
            for group in plan.groups:
                assert 1 <= group.size <= g and list(group.sites) == list(range(group.sites[0], group.sites[-1] + 1))
                start = min((e.index for e in plan.sources if e.site is not None and e.site >= group.sites[0]),
                            default=len(plan.sources))
                assert set(group.reads) == set().union(*group.early) and all(j < start for j in group.reads)
                for i, site in enumerate(group.sites):
                    assert plan.group_of(site) == (group, i)
                    early, late = group.early[i], group.late[i]
                    assert sorted(early + late) == sorted(plan.sites[site].reads)
                    assert all(group.sites[0] <= plan.sources[j].site < site for j in late)
                    assert g > 1 or not late
                    # phase 1's read flags: one per group entry, set exactly where this site reads it early
                    flags = group.phase1_reads[i]
                    assert len(flags) == len(group.reads)
                    assert [j for j, read in zip(group.reads, flags) if read] == sorted(early)
            if g == 1:
                assert plan.grouped_rows == plan.source_rows
            if g >= plan.n_sites:  # one group: phase 1 reads the initial entries once
                assert plan.grouped_rows == plan._rows(plan.groups[0].reads) + sum(map(plan._rows, plan.groups[0].late))


@pytest.mark.parametrize("flavor, g, rows, per_call", [("100m", 5, 105, 325), ("350m", 7, 301, 1225),
                                                       ("1b", 11, 589, 2701)])
def test_forward_source_rows_per_token(flavor, g, rows, per_call):
    """docs/DESIGN.md's table: forward source rows per token per call and grouped (issue 13: 589 at 1b, g = 11)."""
    args = ModelArgs.from_flavor(flavor, **FAMILIES["mhar H=8"], routing_group_size=g)
    plan = RoutingPlan.from_args(args)
    assert plan.group_size == g
    assert plan.grouped_rows == closed_form_rows(plan.n_sites, g) == rows
    assert plan.source_rows == closed_form_rows(plan.n_sites, 1) == per_call


def test_auto_group_size_minimises_the_rows_read_and_logs_once(caplog):
    """"auto" picks, per flavor, the g with the fewest rows read forward + backward (5 / 7 / 11 at
    100m / 350m / 1b, as docs/DESIGN.md), and logs the choice once."""
    plan_module._LOGGED.clear()
    with caplog.at_level(logging.INFO, logger=plan_module.__name__):
        for flavor, expected in (("100m", 5), ("350m", 7), ("1b", 11), ("1b", 11)):
            args = ModelArgs.from_flavor(flavor, **FAMILIES["mhar H=8"], routing_group_size="auto")
            plan = RoutingPlan.from_args(args)
            costs = [sum(replace(plan, group_size=g).routing_rows()) for g in range(1, plan.n_sites + 1)]
            assert plan.group_size == expected == 1 + costs.index(min(costs)), flavor
            assert costs[expected - 1] < costs[0], flavor
    choices = [r.getMessage() for r in caplog.records if "routing_group_size='auto'" in r.getMessage()]
    assert len(choices) == 3 and "g=11 for 73 sites" in choices[-1]


def test_routing_rows_per_call_and_grouped():
    """Per call: forward N, backward N + 2 per site. Grouped: a group of one site is per-call routing."""
    plan = RoutingPlan.from_args(ModelArgs(**SHAPE, n_layers=2, residual="attn_res"))
    counts = plan.source_counts
    assert plan.routing_rows() == (sum(counts), sum(counts) + 2 * len(counts))
    whole = replace(plan, group_size=plan.n_sites)  # phase 1 reads the embedding once; site s reads s - 1 late
    late = sum(n - 1 for n in counts)
    assert whole.routing_rows(state_rows=2) == (1 + 2 * 5 + late, 1 + 2 * 5 + late + 2 * 5)
    assert best_group_size(RoutingPlan.from_args(ModelArgs(**SHAPE, n_layers=1, residual="attn_res"))) == 1


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "big"])
def test_bad_group_size_is_a_clear_error(bad):
    with pytest.raises(ValueError, match="routing_group_size must be a positive integer"):
        ModelArgs(**SHAPE, residual="attn_res", routing_group_size=bad)
    with pytest.raises(ValueError, match="group_size must be a positive integer"):
        RoutingPlan.from_args(SimpleNamespace(residual="attn_res", n_layers=2, routing_granularity="sublayer",
                                              routing_block_layers=1, routing_mode="replace",
                                              routing_null_source=False, routing_group_size=bad))


def test_group_size_larger_than_the_sites_is_refused_with_the_valid_range():
    """Refused, not clamped: g above the number of sites S = 2L + 1 names S and the range 1..S."""
    for n_layers in (1, 2, 4):
        sites = RoutingPlan.from_args(ModelArgs(**SHAPE, n_layers=n_layers, residual="attn_res")).n_sites
        assert sites == 2 * n_layers + 1
        assert ModelArgs(**SHAPE, n_layers=n_layers, residual="attn_res", routing_group_size=sites)
        with pytest.raises(ValueError, match=rf"routing_group_size={sites + 1} is larger than the {sites} routing "
                                             rf"sites .* choose 1\.\.{sites}, or 'auto'"):
            ModelArgs(**SHAPE, n_layers=n_layers, residual="attn_res", routing_group_size=sites + 1)
    block = RoutingPlan.from_args(ModelArgs(**SHAPE, n_layers=4, residual="attn_res", routing_granularity="block",
                                            routing_block_layers=2))
    with pytest.raises(ValueError, match=rf"larger than the {block.n_sites} routing sites .*block granularity"):
        ModelArgs(**SHAPE, n_layers=4, residual="attn_res", routing_granularity="block", routing_block_layers=2,
                  routing_group_size=block.n_sites + 1)


def test_group_size_needs_routing_and_a_grouped_kernel():
    with pytest.raises(ValueError, match="needs residual='attn_res'"):
        ModelArgs(**SHAPE, routing_group_size=2)
    with pytest.raises(ValueError, match="runs with routing_kernel 'eager', 'triton' or 'auto'"):
        ModelArgs(**SHAPE, residual="attn_res", routing_group_size="auto", routing_kernel="compile")
    for kernel in ("eager", "triton", "auto"):
        assert ModelArgs(**SHAPE, residual="attn_res", routing_group_size=3, routing_kernel=kernel)
    with pytest.raises(ValueError, match="routing_layout='clean' only"):
        ModelArgs(**SHAPE, residual="attn_res", routing_group_size=3, routing_layout="paper", routing_mode="delta",
                  routing_null_source=True, routing_eps=1e-6)
    with pytest.raises(ValueError, match="routing_head_layout='contiguous' only"):
        ModelArgs(**SHAPE, residual="attn_res", routing_group_size=2, routing_head_layout="permuted")
    assert RoutingPlan.from_args(ModelArgs(**SHAPE, routing_group_size="auto")).group_size == 1
