"""Routing sources kept by reference (`mhar_kernels.launch.save_with_sources`): a fused routing call
whose sources are all shared entries that outlive their block keeps them as plain references
instead of saving them (under activation checkpointing every saved tensor runs torch's pack and
unpack hooks), with the same gradients, the same check against in-place changes, and never for an
entry that lives only inside its block (block granularity's partial block). A block recomputed under
activation checkpointing remakes its entries on its first forward's gradient sinks (the table path)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mhar_kernels import launch, op
from mhar_titan.models.args import ModelArgs
from mhar_titan.models.model import Transformer
from mhar_titan.models.plan import RoutingPlan
from mhar_titan.models.router import RoutingSchedule
from mhar_titan.parallel import apply_ac
from helpers import autograd_nodes

FAMILIES = {
    "per call": dict(),
    "grouped g=3": dict(routing_group_size=3),
    "block": dict(routing_granularity="block", routing_block_layers=2),
    "delta null": dict(routing_mode="delta", routing_null_source=True),
}


def tiny(family: str, kernel: str = "triton") -> ModelArgs:
    return ModelArgs(dim=32, n_layers=4, n_heads=2, n_kv_heads=1, ffn_dim=64, vocab_size=64, max_seq_len=16,
                     residual="attn_res", routing_heads=4, routing_kernel=kernel, **FAMILIES[family])


def routing_nodes(loss: torch.Tensor) -> list:
    """The fused routing calls' autograd nodes (per call, phase 1, merge) of loss's graph."""
    return [node for node in autograd_nodes(loss)
            if type(node).__name__ in ("_EagerRouteBackward", "Phase1Backward", "MergeBackward")]


def step(family: str, ac: str, keep: bool, monkeypatch) -> tuple[torch.Tensor, dict, int, int]:
    """(loss, gradients, kept calls, calls) of one step of the tiny `family` model with activation
    checkpointing `ac`; keep=False makes every call save its sources (the path before)."""
    with monkeypatch.context() as patch:
        if not keep:
            patch.setattr(launch, "keeps_sources", lambda sinks: False)
        torch.manual_seed(0)
        model = Transformer(tiny(family))
        model.init_weights()
        with torch.no_grad():
            model.routing.query.normal_()
            if model.routing.alpha is not None:  # delta mode: open the gates (0 at init)
                model.routing.alpha.fill_(0.5)
        apply_ac(model, SimpleNamespace(mode=ac, selective_ac_option="1", preserve_rng_state=False))
        tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
        loss = model(tokens).logsumexp(-1).mean()
        nodes = routing_nodes(loss)
        kept = sum(getattr(n, "sources_kept", False) for n in nodes)
        loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}, kept, \
        len(nodes)


@pytest.mark.parametrize("ac", ["none", "full"])
@pytest.mark.parametrize("family", FAMILIES)
def test_kept_sources_give_the_saved_path_gradients_bitwise(family, ac, monkeypatch):
    """Every family, AC none and full: the loss and every parameter gradient with sources kept by
    reference equal, bit for bit, those of the same step with every source saved; calls do keep
    them (per call and grouped: every call reading only entries that outlive their block)."""
    loss, grads, kept, calls = step(family, ac, True, monkeypatch)
    loss0, grads0, kept0, calls0 = step(family, ac, False, monkeypatch)
    assert kept0 == 0 and calls == calls0 > 0
    assert kept > 0, (family, kept, calls)
    assert torch.equal(loss, loss0)
    assert grads.keys() == grads0.keys()
    for name, g in grads.items():
        assert torch.equal(g, grads0[name]), name
    assert grads["routing.query"].abs().sum() > 0


def test_an_entry_that_lives_inside_its_block_is_never_kept(monkeypatch):
    """Block granularity: the partial block after a layer's attention sublayer is read by that
    layer's MLP site only (no later block holds it), so those calls save their sources (kept by
    reference it would outlive the block under activation checkpointing); the other calls keep
    theirs."""
    args = tiny("block")
    plan = RoutingPlan.from_args(args)
    schedule = RoutingSchedule.from_plan(plan, args.n_layers)
    inside = [(layer, row) for layer, part in enumerate(schedule.layers) for row in (0, 1)
              if not all(part.outlives[row])]
    assert inside, "block granularity creates entries read only inside their block"
    _, _, kept, calls = step("block", "full", True, monkeypatch)
    assert 0 < kept < calls


@pytest.mark.parametrize("family", FAMILIES)
def test_schedule_marks_an_entry_outliving_its_block_when_a_later_site_uses_it(family):
    """`LayerSchedule.outlives`: per sublayer, one flag per entry it creates, True exactly when a
    site after the block reads or builds on the entry (`RoutingPlan.last_use`)."""
    args = tiny(family)
    plan = RoutingPlan.from_args(args)
    schedule = RoutingSchedule.from_plan(plan, args.n_layers)
    entry = len(plan.initial)
    for layer, part in enumerate(schedule.layers):
        for row, site in enumerate(plan.layer_sites(layer)):
            made = len(site.creates) if site is not None else 0
            assert part.outlives[row] == tuple(plan.last_use[j] > 2 * layer + 1 for j in range(entry, entry + made))
            entry += made
    assert entry == len(plan.sources)


def test_a_kept_source_changed_in_place_fails_the_backward():
    """As for a saved tensor: a source modified in place between the forward and the backward of a
    call that keeps it by reference makes the backward raise, naming the cause."""
    leaves = [torch.randn(1, 4, 16, requires_grad=True) for _ in range(3)]
    sources = [op.share_gradient(2 * x, outlives=True) for x in leaves]
    query, norm = torch.randn(16, requires_grad=True), torch.ones(16, requires_grad=True)
    out = op.route(sources, query, norm, 4)
    assert routing_nodes(out.sum())[0].sources_kept
    with torch.no_grad():
        sources[1].add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_sources_not_shared_or_not_outliving_are_saved():
    """A call with a source not made by `share_gradient`, or shared without `outlives`, saves its
    sources (`launch.keeps_sources` is False)."""
    x = [torch.randn(1, 4, 16, requires_grad=True) for _ in range(2)]
    assert not launch.keeps_sources(launch.sinks([op.share_gradient(2 * x[0], outlives=True), x[1]]))
    assert not launch.keeps_sources(launch.sinks([op.share_gradient(2 * t) for t in x]))
    assert launch.keeps_sources(launch.sinks([op.share_gradient(2 * t, outlives=True) for t in x]))
    assert not launch.keeps_sources([])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_recomputed_block_reads_its_first_forwards_source_table(family, monkeypatch):
    """Under activation checkpointing a recomputed block's entries take the gradient sinks of its
    first forward (`router.BlockSources.share`, `launch.remake`), so each recomputed routing call
    finds its sources in the step's source table as its first forward did: no recomputed call
    takes the general path (a table built per launch) that its first forward did not. The
    gradients are bitwise those of the recompute with fresh sinks (`launch.remake` refused: the
    recomputed sublayers over in-block entries then take the general path)."""
    def run(remake: bool):
        paths = {"forward": [], "recompute": []}
        with monkeypatch.context() as patch:
            lookup = launch.lookup

            def counting(sinks):
                found = lookup(sinks)
                recompute = torch._C._current_graph_task_id() != -1  # inside the backward
                paths["recompute" if recompute else "forward"].append(found is not None)
                return found

            patch.setattr(launch, "lookup", counting)
            if not remake:
                patch.setattr(launch, "remake", lambda sink, source: False)
            _, grads, _, _ = step(family, "full", True, monkeypatch)
        return paths, grads

    paths, grads = run(remake=True)
    fresh, fresh_grads = run(remake=False)
    assert len(paths["recompute"]) == len(fresh["recompute"]) > 0
    # every block is recomputed: a call over the block's own inputs and entries it made
    assert paths["recompute"].count(False) <= paths["forward"].count(False)
    if family != "block":  # block granularity skips its partial sums: some calls read no consecutive slots
        assert all(paths["forward"]) and all(paths["recompute"]), paths
        assert not all(fresh["recompute"])  # the test tells the two apart
    assert grads.keys() == fresh_grads.keys()
    for name, grad in grads.items():
        assert torch.equal(grad, fresh_grads[name]), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_call_saves_only_its_activations_and_keeps_its_rows(dtype):
    """A fused routing call's pseudo-query, key-norm and null-source rows are kept by reference,
    never through saved-tensor hooks (which activation checkpointing runs, about 8 us each): what
    the hooks see is the call's output, its statistics (one tensor: the logits and the lse) and, for
    bf16 sources, the mix residual."""
    leaves = [torch.randn(1, 4, 16, requires_grad=True) for _ in range(3)]
    sources = [op.share_gradient((2 * x).to(dtype), outlives=True) for x in leaves]
    query, norm = torch.randn(16, requires_grad=True), torch.ones(16, requires_grad=True)
    null = torch.randn(16, requires_grad=True)
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        out = op.route(sources, query.to(dtype), norm.to(dtype), 4, null_source=null.to(dtype))
    node = routing_nodes(out.sum())[0]
    rows = launch.kept(node)[:3]
    assert [r.shape for r in rows] == [(16,)] * 3 and node.sources_kept
    assert not any(t is r for t in packed for r in rows)
    shapes = sorted(tuple(t.shape) for t in packed)
    # stats (N + 1, B*T, H): the logits of the null and the 3 sources, then the lse
    assert shapes == sorted([(1, 4, 16), (5, 4, 4)] + ([(1, 4, 16)] if dtype is torch.bfloat16 else [])), shapes
    out.float().sum().backward()
    assert query.grad.abs().sum() > 0 and null.grad.abs().sum() > 0


def test_a_kept_row_changed_in_place_fails_the_backward():
    """As for a saved tensor: a pseudo-query row modified in place between the forward and the
    backward of the call that keeps it makes the backward raise, naming the cause."""
    sources = [op.share_gradient(2 * torch.randn(1, 4, 16, requires_grad=True), outlives=True) for _ in range(2)]
    query = torch.randn(16, requires_grad=True)
    row = query * 1
    out = op.route(sources, row, torch.ones(16, requires_grad=True), 4)
    with torch.no_grad():
        row.mul_(2.0)
    with pytest.raises(RuntimeError, match="parameter rows .* modified by an inplace operation"):
        out.sum().backward()
