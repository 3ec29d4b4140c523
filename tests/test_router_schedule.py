"""The Router's host-side layout (models/router.py): the routing plan resolved once per model
(`RoutingSchedule`) and the routing parameters' rows taken once per forward (`parameter_rows`),
so that a forward runs no plan lookup per site and a backward assembles each routing
parameter's gradient in one node instead of one zero-filled (S, d) tensor and one addition per site."""
from __future__ import annotations

import pytest
import torch

from mhar_titan.models.args import ModelArgs
from mhar_titan.models.model import Transformer
from mhar_titan.models.plan import RoutingPlan
from mhar_titan.models.routing_params import parameter_rows
from mhar_titan.models.schedule import RoutingSchedule, carried_sites, leaving_sites

FAMILIES = {
    "per call": dict(routing_heads=2),
    "grouped g=3": dict(routing_heads=2, routing_group_size=3),
    "delta null block g=2": dict(routing_heads=2, routing_mode="delta", routing_null_source=True,
                                 routing_granularity="block", routing_block_layers=2, routing_group_size=2),
    "paper delta": dict(routing_heads=2, routing_mode="delta", routing_null_source=True, routing_layout="paper"),
}


def tiny(**overrides) -> ModelArgs:
    return ModelArgs(dim=16, n_layers=5, n_heads=2, n_kv_heads=1, ffn_dim=32, vocab_size=64, max_seq_len=16,
                     residual="attn_res", **overrides)


@pytest.mark.parametrize("family", FAMILIES)
def test_schedule_releases_every_entry_once_after_its_last_use(family):
    """Each entry no later site reads is released after the first block that follows both its
    creation and its last use (what the forward did with a pass over the whole list per
    block), and never twice; an entry the final site reads is never released."""
    args = tiny(**FAMILIES[family])
    plan = RoutingPlan.from_args(args)
    schedule = RoutingSchedule.from_plan(plan, args.n_layers)
    exists, seen = len(plan.initial), {}
    for layer, part in enumerate(schedule.layers):
        exists += sum(len(site.creates) for site in plan.layer_sites(layer))
        expected = [j for j in range(exists) if plan.last_use[j] <= 2 * layer + 1 and j not in seen]
        assert list(part.released) == expected, (layer, part.released)
        seen.update(dict.fromkeys(part.released, layer))
        assert part.carried == carried_sites(plan, layer) and part.leaving == leaving_sites(plan, layer)
    final_reads = set(plan.final.reads) if plan.final is not None else set()
    assert final_reads.isdisjoint(seen)
    assert len(seen) == len(plan.sources) - len(final_reads)


def _parents_of(loss: torch.Tensor, parameter: torch.Tensor) -> list[str]:
    """Names of the autograd nodes whose gradient goes into `parameter`'s AccumulateGrad."""
    parents, stack, visited = [], [loss.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in visited:
            continue
        visited.add(node)
        for child, _ in node.next_functions:
            if child is not None and getattr(child, "variable", None) is parameter:
                parents.append(type(node).__name__)
            stack.append(child)
    return parents


@pytest.mark.parametrize("family, expected", [
    ("per call", ["UnbindBackward0"]),
    ("grouped g=3", ["SplitWithSizesBackward0"]),
    ("delta null block g=2", ["SplitWithSizesBackward0"]),
])
def test_each_routing_parameter_gets_its_gradient_from_one_node(family, expected):
    """A training forward takes the pseudo-queries' and key norms' rows once: one backward node
    feeds each parameter (the old per-block slice and per-site select fed it from every site),
    and the gradients equal those of indexing the parameter per site (the same values, summed)."""
    args = tiny(**FAMILIES[family])
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    with torch.no_grad():  # rows away from the uniform start, so every site's gradient differs
        model.routing.query.normal_(0, 0.5)
        model.routing.key_norm.normal_(1, 0.2)
    tokens = torch.randint(0, args.vocab_size, (2, 6))
    loss = model(tokens).float().square().mean()
    for parameter in (model.routing.query, model.routing.key_norm):
        assert _parents_of(loss, parameter) == expected
    loss.backward()
    rows = {name: p.grad.clone() for name, p in model.routing.named_parameters()}

    def indexed(parameter, groups):  # every row by indexing: one backward node per site
        return (tuple(parameter[i] for i in range(parameter.shape[0])),
                {g.index: parameter[g.sites[0]:g.sites[0] + g.size] for g in groups if g.size > 1})
    import mhar_titan.models.routing_params as routing_params
    original, routing_params.parameter_rows = routing_params.parameter_rows, indexed
    try:
        model.zero_grad(set_to_none=True)
        indexed_loss = model(tokens).float().square().mean()
        assert len(_parents_of(indexed_loss, model.routing.query)) > 1  # what the check above tells apart
        indexed_loss.backward()
    finally:
        routing_params.parameter_rows = original
    for name, p in model.routing.named_parameters():
        torch.testing.assert_close(p.grad, rows[name], rtol=1e-6, atol=1e-7, msg=name)


def test_parameter_rows_are_views_of_the_parameter():
    """Per-call rows are the parameter's rows; grouped rows are views of its group chunks."""
    p = torch.arange(18.0).reshape(9, 2).clone()  # not itself a view
    groups = RoutingPlan.from_args(tiny(routing_heads=2, routing_group_size=3)).groups[:3]  # sizes 3, 3, 3
    rows, chunks = parameter_rows(p, groups)
    assert [r.tolist() for r in rows] == [[2.0 * i, 2.0 * i + 1] for i in range(9)]
    assert sorted(chunks) == [0, 1, 2] and chunks[1].tolist() == [[6.0, 7.0], [8.0, 9.0], [10.0, 11.0]]
    assert all(r._base is p for r in rows) and all(c._base is p for c in chunks.values())
    per_call = RoutingPlan.from_args(tiny(routing_heads=2)).groups[:9]
    rows, chunks = parameter_rows(p, per_call)
    assert chunks == {} and all(r._base is p for r in rows)
