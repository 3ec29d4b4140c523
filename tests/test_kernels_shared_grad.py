"""The depth buffer's gradient rows (`mhar_kernels.depth_buffer`, docs/DESIGN.md "The depth buffer").

Every fused routing call over a depth buffer writes or adds its sources' gradients into their rows
of one gradient buffer inside its backward kernel, so autograd adds no source gradient. Which
reader writes a row and which add is fixed by the routing plan (`RoutingSchedule.buffer_calls`:
the last reader in the forward writes); the token chain orders every reader of slot i before the
write of slot i, whose backward hands the finished row to the source's producer. Here: the
schedule against a walk of the plan, what really runs in a model step (every family, activation
checkpointing none and full, early stop on and off: `depth_buffer_probe.check_order`) with fp64
gradients equal to the eager path's, the rows' sums against autograd's in fp32 and bf16, a
retained graph run twice, and double backward."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

import mhar_kernels
from mhar_kernels import depth_buffer, op
from mhar_kernels.depth_buffer import DepthBuffer
from mhar_titan.models.args import ModelArgs
from mhar_titan.models.model import Transformer
from mhar_titan.models.plan import RoutingPlan
from mhar_titan.models.schedule import RoutingSchedule
from mhar_titan.parallel import apply_ac
from depth_buffer_probe import check_order, recording
from kernels_oracle import DEVICE, random_routing_model, rel_err

D, HEADS, SITES = 64, 4, 6

# ---------------------------------------------------------------------------- the schedule
SHAPE = dict(dim=32, n_layers=4, n_heads=2, n_kv_heads=1, ffn_dim=64, vocab_size=64, max_seq_len=16,
             residual="attn_res", routing_heads=4)
PLANS = {
    "per call": dict(),
    "grouped g=2": dict(routing_group_size=2),
    "grouped g=3": dict(routing_group_size=3),
    "grouped g=9": dict(routing_group_size=9),
    "block k=2": dict(routing_granularity="block", routing_block_layers=2),
    "block k=3 g=4": dict(routing_granularity="block", routing_block_layers=3, routing_group_size=4),
    "delta null": dict(routing_mode="delta", routing_null_source=True),
    "delta block null g=3": dict(routing_mode="delta", routing_null_source=True, routing_granularity="block",
                                 routing_block_layers=2, routing_group_size=3),
    "paper": dict(routing_mode="delta", routing_null_source=True, routing_layout="paper", routing_eps=1e-5,
                  norm_eps=1e-5),
}


def walk(plan: RoutingPlan) -> list[tuple[str, int, list[int]]]:
    """The fused calls of one forward, found by walking the sites: (kind, site, the entries it reads
    in its source order, null sources left out). A site in a group of g > 1 consecutive sites
    (chunks of g from site 0) reads the entries that existed when its group started through the
    group's phase 1 (run at the group's first site, over every such entry a site of the group
    reads, in list order), and the entries made inside the group through its own merge."""
    g, sites, calls = plan.group_size, plan.sites, []
    full = {j for j, s in enumerate(plan.sources) if s.kind != "null"}
    for site in sites:
        first = site.index - site.index % g
        members = sites[first:min(first + g, len(sites))]
        reads = [j for j in site.reads if j in full]
        if len(members) == 1:
            if reads:
                calls.append(("call", site.index, reads))
            continue

        def old(j):
            made_by = plan.sources[j].site
            return made_by is None or made_by < first

        if site.index == first:
            start = sorted({j for member in members for j in member.reads if j in full and old(j)})
            if start:
                calls.append(("phase1", site.index, start))
        late = [j for j in reads if not old(j)]
        if late:
            calls.append(("merge", site.index, late))
    return calls


@pytest.mark.parametrize("family", PLANS)
def test_buffer_calls_are_the_plans_reads_and_the_last_forward_reader_writes(family):
    """`RoutingSchedule` against a walk of the plan: one slot per (B, T, d) entry some site reads,
    in list order (the capacity); every fused call in forward order with its rows in its source
    order, each row flagged "add" unless the call is the row's last reader in the forward; each
    site's calls indexed by its `SiteCall`; each entry a sublayer (or the embedding) creates
    written into its slot, None where no site reads it."""
    args = ModelArgs(**SHAPE, **PLANS[family])
    plan = RoutingPlan.from_args(args)
    schedule = RoutingSchedule.from_plan(plan, args.n_layers)
    calls = walk(plan)
    routed = sorted({j for _, _, entries in calls for j in entries})
    slot = {j: i for i, j in enumerate(routed)}
    assert schedule.capacity == len(routed) > 0
    last = {j: i for i, (_, _, entries) in enumerate(calls) for j in entries}
    assert [(c.slots, c.adds) for c in schedule.buffer_calls] == [
        (tuple(slot[j] for j in entries), tuple(last[j] != i for j in entries))
        for i, (_, _, entries) in enumerate(calls)]
    site_calls = [call for part in schedule.layers for call in part.calls if call is not None]
    site_calls += [schedule.final] if schedule.final is not None else []
    for call in site_calls:
        mine = {kind: i for i, (kind, site, _) in enumerate(calls) if site == call.site.index}
        assert call.rows == mine.get("call", mine.get("merge")), (call.site.index, mine)
        assert call.phase1_rows == mine.get("phase1"), (call.site.index, mine)
    assert schedule.initial_slots == tuple(slot.get(s.index) for s in plan.initial)
    created = [s.index for s in plan.sources if s.site is not None]
    assert [x for part in schedule.layers for row in part.slots for x in row] == [slot.get(j) for j in created]
    assert sum(len(entries) for _, _, entries in calls) > len(routed)  # some rows have several readers


# ---------------------------------------------------------------------------- a model step
FAMILIES = {
    "per call": dict(),
    "grouped g=3": dict(routing_group_size=3),
    "block k=2": dict(routing_granularity="block", routing_block_layers=2),
    "delta null": dict(routing_mode="delta", routing_null_source=True),
    "delta block null g=3": PLANS["delta block null g=3"],
    "paper": PLANS["paper"],
}
AC = {"none": ("none", True), "full": ("full", True), "full, no early stop": ("full", False)}
_eager: dict = {}


def model_step(family: str, kernel: str, ac: str = "none", early_stop: bool = True) -> dict:
    """One fp64 step of a 4-layer model of `family` (9 routing sites, 8 in the paper layout;
    non-uniform routing, open gates, non-zero null sources) with activation checkpointing `ac`
    (early stop as given): {"grads": the loss and every parameter's gradient}; on the fused
    kernels also "log" (the probe's) and the Router's depth buffer "before" (a copy after the
    forward) and "after" (after the backward)."""
    args = ModelArgs(**SHAPE, routing_kernel=kernel, **FAMILIES[family])
    model, device = random_routing_model(args, 1.0, torch.float64, kernel)
    apply_ac(model, SimpleNamespace(mode=ac, selective_ac_option="1", preserve_rng_state=False))
    tokens = torch.randint(0, args.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1)).to(device)
    out = {}
    with recording() as log, set_checkpoint_early_stop(early_stop):
        loss = model(tokens).logsumexp(-1).mean()
        values = next((e.values for e in log if e.kind == "write"), torch.empty(0))  # the Router's writes first
        out["before"] = values.clone()
        loss.backward()
        out["after"] = values
    out["log"] = log
    out["grads"] = {name.replace("._checkpoint_wrapped_module", ""): None if p.grad is None else p.grad.cpu()
                    for name, p in model.named_parameters()}
    out["grads"]["loss"] = loss.detach().cpu()
    return out


@pytest.mark.parametrize("ac", AC)
@pytest.mark.parametrize("family", FAMILIES)
def test_every_row_is_written_by_its_last_reader_and_handed_on_after_every_reader(family, ac):
    """What one fp64 model step on the fused kernels really did (`depth_buffer_probe`): one depth
    buffer for the step; for every row, each reader's backward ran once, the last forward reader wrote the row
    first and every other reader added into it, and the row went to the source's producer after
    every reader (the token chain). Under activation checkpointing (early stop on and off) the
    recomputed blocks wrote the same values into their slots (each rewrite compared with the row
    it replaced, and the whole buffer before and after the backward). The loss and every gradient
    equal the eager path's within fp64 rounding."""
    mode, early_stop = AC[ac]
    got = model_step(family, "triton", mode, early_stop)
    counts = check_order(got["log"])
    # (the paper layout's first site reads only its null source: a list call, a buffer of its own)
    assert counts["buffers"] == 1 + (family == "paper") and counts["shared"] > 0, counts
    if mode == "none":
        assert counts["rewrites"] == 0, counts
    elif not early_stop:  # every block recomputed to its end (early stop may end before its last writes)
        assert counts["rewrites"] > 0, counts
    assert torch.equal(got["before"], got["after"])
    if family not in _eager:
        _eager[family] = model_step(family, "eager")["grads"]
    eager = _eager[family]
    assert got["grads"].keys() == eager.keys()
    for name, expected in eager.items():
        assert expected.norm() > 0 and got["grads"][name] is not None, name
        assert rel_err(got["grads"][name], expected) < 1e-10, (name, rel_err(got["grads"][name], expected))


# ---------------------------------------------------------------------------- one buffer, by hand
def _inputs(dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    leaves = [torch.randn(2, 5, D, generator=gen).to(DEVICE, dtype).requires_grad_() for _ in range(SITES)]
    queries = [(0.5 * torch.randn(D, generator=gen)).to(DEVICE, dtype) for _ in range(SITES)]
    norm = (1 + 0.1 * torch.randn(D, generator=gen)).to(DEVICE, dtype)
    weights = torch.randn(2, 5, D, generator=gen).to(DEVICE, dtype)
    return leaves, queries, norm, weights


def _step(leaves, queries, norm, weights, buffered: bool, recompute: bool = False, retain: bool = False):
    """SITES routing calls as a model makes them: source s is 2 x_s plus call s - 1's output, and
    call s routes over sources 0..s (source s is read by SITES - s calls); source 0 also feeds the
    loss directly. buffered: the sources are written into one depth buffer and every call reads
    its rows (the last call writes every gradient row, the others add, as the schedule says);
    else each call routes over its own list (`mhar_kernels.route`) and autograd sums. Returns the
    leaves' gradients (two backwards through a retained graph with `retain`)."""
    buffer = token = None
    if buffered:
        buffer = DepthBuffer(SITES, leaves[0].detach())
        reads = [depth_buffer.reads(range(s + 1), [s < SITES - 1] * (s + 1), DEVICE) for s in range(SITES)]

    def site(s, q, token, *sources):
        if buffered:
            return op.route_buffer(buffer, reads[s], token, q, norm, HEADS)
        return mhar_kernels.route(list(sources), q, norm, HEADS)

    sources, out = [], None
    for s, (x, q) in enumerate(zip(leaves, queries)):
        sources.append(2 * x if out is None else 2 * x + out)
        if s == 0:
            loss = (sources[0].float() * weights.float()).sum()
        if buffered:
            token = buffer.write(s, sources[-1], token)
        args = (s, q, token, *sources)
        out = checkpoint(site, *args, use_reentrant=False) if recompute else site(*args)
        loss = loss + (out.float() * weights.float()).sum() / (s + 1)
    grads = torch.autograd.grad(loss, leaves, retain_graph=retain)
    return (grads, torch.autograd.grad(loss, leaves)) if retain else grads


@pytest.mark.parametrize("recompute", [False, True])
def test_fp32_gradient_rows_equal_autograd_sums_bitwise(recompute):
    """The rows the calls wrote and added into, handed on, give every source autograd's sum of the
    calls' gradients bit for bit in fp32 (the same additions in the same order: the later call's
    first; source 0's direct use, the earliest node, last), also when every call is recomputed
    under checkpointing."""
    inputs = _inputs(torch.float32)
    separate = _step(*inputs, buffered=False, recompute=recompute)
    shared = _step(*inputs, buffered=True, recompute=recompute)
    for s, (a, b) in enumerate(zip(separate, shared)):
        assert torch.equal(a, b), (s, (a - b).abs().max().item())
    assert all(g.abs().sum() > 0 for g in shared)


def test_bf16_gradient_rows_at_least_as_close_to_fp64():
    """In bf16 a row's addition in the kernel rounds once (fp32 sum, one rounding to the row),
    autograd's sum of bf16 gradients twice. Measured (interpreter, CPU, 2026-12-05, seeds 0 / 1 /
    2): mean relative error over the sources against fp64 0.0045 / 0.0048 / 0.0048 in the rows vs
    0.0046 / 0.0050 / 0.0049 summed by autograd, per source at most 1.05x autograd's; the
    per-source bound leaves a 2x margin."""
    truth = _step(*_inputs(torch.float64), buffered=False)
    bf16 = _inputs(torch.bfloat16)
    errors = [(rel_err(sh, t), rel_err(se, t)) for sh, se, t in
              zip(_step(*bf16, buffered=True), _step(*bf16, buffered=False), truth)]
    mean_shared, mean_separate = (sum(e) / len(errors) for e in zip(*errors))
    assert mean_shared <= mean_separate, errors
    assert all(sh <= 2 * se + 1e-3 for sh, se in errors), errors


def test_a_retained_graph_runs_again_from_fresh_rows():
    """A second backward through a retained graph gives the same gradients: each row is written
    again by its first reader in the backward, not added to what the first backward left."""
    first, second = _step(*_inputs(torch.float32, seed=2), buffered=True, retain=True)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    assert all(g.abs().sum() > 0 for g in first)


def test_double_backward_through_a_fused_calls_parameters_raises():
    """The backward is once differentiable: a second derivative through a call's pseudo-query
    raises (torch's `once_differentiable`)."""
    leaves, queries, norm, _ = _inputs(torch.float32, seed=6)
    query = queries[0].clone().requires_grad_()
    out = op.route(leaves[:3], query, norm, HEADS)
    grad, = torch.autograd.grad(out.float().square().sum(), query, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        grad.sum().backward()


def test_double_backward_through_a_source_raises():
    """A backward asked to build a graph through a routed source (create_graph=True) raises, naming
    what to do, instead of silently leaving the routing's part out of a second derivative (the
    buffer's gradient rows have no graph)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 4, 16, generator=gen).to(DEVICE).requires_grad_()
    other = torch.randn(1, 4, 16, generator=gen).to(DEVICE)
    query = torch.randn(16, generator=gen).to(DEVICE)
    out = mhar_kernels.route([2 * x, other], query, torch.ones(16, device=DEVICE), 4)
    with pytest.raises(RuntimeError, match="second derivative through depth routing"):
        torch.autograd.grad(out.square().sum() + x.pow(3).sum(), x, create_graph=True)
