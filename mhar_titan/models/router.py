"""Depth routing of one forward (lifetime: one forward): the attn_res connection's flow and links.

How a routing site is computed is the op package's job (`mhar_kernels.dispatch`, one backend
rule over the reference, the grouped reference and the fused kernels). This module maps the
routing schedule (schedule.py, made once per model from the routing plan) onto those calls, with
the model's routing parameters (routing_params.py):

- `Router`: the flow of one forward (connections/base.py). Built from the schedule, the
  parameters and the settings, it takes every routing parameter's rows once
  (`DepthRouting.rows`: views with one backward node per parameter), makes the initial source
  list (and the fused kernels' depth buffer), gives each block its `RoutingLink` (that block's
  rows and the phase-1 states carried to it, all tensors, so activation checkpointing keeps them
  as block inputs), takes the block's new entries and states back, and routes the final site.
  With an observer it hands every site's sources to it and gives it the reference's
  depth-softmax weights (analysis).
- `RoutingLink`: a block's link: the input of each of its two sublayers (`route_site`) and the
  entries each sublayer's output creates (`new_sources`), written into the depth buffer.

Grouped routing (`routing_group_size` g > 1, docs/DESIGN.md "Grouped routing"): the block holding
a group's first site runs its phase 1 and merges the states of its own sites; the states of sites
in later blocks leave it in `BlockOutput.states` (a tuple, in site order) and reach those blocks
through the Router.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import torch
from torch import Tensor

from mhar_kernels import contract, dispatch, reference
from mhar_kernels.depth_buffer import DepthBuffer, Reads

from .plan import OUTPUT, STREAM, Group, Site
from .routing_params import DepthRouting, RoutingSettings
from .schedule import LayerSchedule, RoutingSchedule, SiteCall


class State(NamedTuple):
    """Phase-1 routing state of one site: mix (B, T, d) (the storage dtype on the fused kernels,
    the compute dtype on the eager ones) and norm (B, T, H) fp32 (differentiable), lse (B, T, H)
    fp32 (not differentiable); given, on the fused kernels over a depth buffer: (the group's
    `MixGradients`, the site's position, the group size), where its merge writes the mix's
    gradient (`dispatch.merge_rows`), else None."""

    mix: Tensor
    norm: Tensor
    lse: Tensor
    given: tuple | None = None


class BlockSources:
    """The source list as a block receives it: `entries`, a tuple of the entries so far ((B, T, d)
    tensors, (d,) null sources, None for entries no later site reads), and, where the fused kernels
    route over a depth buffer, `buffer` (the micro-batch's `DepthBuffer`) and `reads` (the
    schedule's `Reads` per fused call on the buffer's device), else None. A plain object, not a
    tuple: the wrappers around a block (activation checkpointing, FSDP2) then do not walk the N
    entries at every block; they are the Router's, alive for the whole step."""

    __slots__ = ("entries", "buffer", "reads")

    def __init__(self, entries: tuple, buffer: DepthBuffer | None = None, reads: tuple | None = None):
        self.entries, self.buffer, self.reads = entries, buffer, reads


    def add(self, created: list[Tensor], slots: Sequence[int | None], keeps: Sequence[bool],
            token: Tensor | None) -> tuple[list[Tensor], Tensor | None]:
        """Write the new entries `created` into their depth-buffer slots (None: not routed over),
        each by a copy, after the write that made `token`; returns (the entries as the source list holds them: the buffer's row, or the
        tensor itself where a later entry is built from it (`keeps`) or it has no slot; the newest
        token). Without a buffer, (created, token). Every entry is first taken to the storage
        dtype (the buffer's, else the embedding's): under autocast a sublayer's output is in the
        autocast dtype while the embedding and the stream are not, every source of a routing call
        has one dtype, and a partial sum built from an entry is then summed in it on every path."""
        buffer = self.buffer
        dtype = buffer.values.dtype if buffer is not None else storage_dtype(self.entries) if created else None
        created = [value if value.dtype is dtype else value.to(dtype) for value in created]
        if buffer is None:
            return created, token
        entries = []
        for value, slot, keep in zip(created, slots, keeps, strict=True):
            if slot is not None:
                token = buffer.write(slot, value, token)
            entries.append(held(buffer, value, slot, keep))
        return entries, token


def held(buffer: DepthBuffer, value: Tensor, slot: int | None, keep: bool) -> Tensor:
    """What the source list holds for an entry written into depth-buffer row `slot` (None: it has
    no row): the buffer's row, so that the entry's own tensor is freed, unless a later entry is
    built from it (`keep`, `RoutingSchedule.keeps`) or it has no row, where the tensor `value`
    itself. A later entry's recipe must read the autograd tensor: the buffer's row has no graph,
    so a recipe over it would give the entry's producer no gradient through that recipe (the
    paper layout's first block source, stream - embedding, lost the embedding's part)."""
    return value if keep or slot is None else buffer.values[slot]


class BlockRouting(NamedTuple):
    """One block's routing argument (tensors only).

    query, key_norm: the (d,) rows of the layer's two sites (attention, MLP); alpha: their (1,)
    rows, delta mode only. states: the phase-1 `State`s of the layer's sites computed in earlier
    blocks, in site order (`LayerSchedule.carried`). group_query, group_key_norm: (g, d) rows of
    the group of more than one site whose first site is in this layer, else None. token: the
    newest depth-buffer write's token (`mhar_kernels.depth_buffer`) where the block routes over a
    buffer, else None.
    """

    query: tuple[Tensor, Tensor]
    key_norm: tuple[Tensor, Tensor]
    alpha: tuple[Tensor, Tensor] | None = None
    states: tuple[State, ...] = ()
    group_query: Tensor | None = None
    group_key_norm: Tensor | None = None
    token: Tensor | None = None


def routed_sources(call: SiteCall, sources: Sequence[Tensor], like: Tensor | None) -> list[Tensor]:
    """The entries the site of `call` routes over. A site that reads only its (d,) null source
    (paper layout, layer 0's attention) gets it broadcast to the shape of `like` (B, T, d), so
    its mix is the null."""
    reads = call.reads
    picked = sources[reads] if isinstance(reads, slice) else [sources[j] for j in reads]
    if call.null_only:
        picked = [s.to(like.dtype).expand_as(like).contiguous() for s in picked]
    return picked


def phase1(group: Group, sources: Sequence[Tensor | None], query: Tensor, key_norm: Tensor,
           settings: RoutingSettings) -> dict[int, State]:
    """Phase 1 of `group` over the model's source list `sources` (entries `group.reads`; a
    leading (d,) entry is the null source), by `dispatch.phase1`. query, key_norm: the group's
    rows (g, d). Returns {site index: State} for every site of the group.

    Raises:
        ValueError: a site reads no entry that exists when its group starts, or bad arguments
            as `mhar_kernels.contract.check_route_args`.
    """
    if not all(group.early):
        raise ValueError(f"group {group.index}: every site must read an entry that exists when the group starts "
                         f"(early reads {group.early})")
    null, full = contract.split_null_source([sources[j] for j in group.reads])
    entries = contract.with_null_source(null, full) if full else [null]  # (no full source: dispatch says so)
    out = dispatch.phase1(query, key_norm, group.phase1_reads, settings.heads, settings.eps, settings.kernel, *entries)
    g = group.size
    lse = out[2 * g].unbind(0)  # (g, B, T, H), site-major: each site's lse a view, no copy
    return {site: State(out[i], out[g + i], lse[i]) for i, site in enumerate(group.sites)}


def merge(site: Site, late: Sequence[Tensor], state: State, dtype: torch.dtype, h: Tensor | None, query: Tensor,
          key_norm: Tensor, alpha: Tensor | None, settings: RoutingSettings) -> Tensor:
    """Phase 2 at `site`: its phase-1 `state` merged with its in-group sources `late` (each
    (B, T, d)), by `dispatch.merge`. dtype: the sources' storage dtype. query, key_norm (d,),
    alpha (1,): the site's rows. Returns the mix (B, T, d) in `dtype`, or h + alpha * mix for a
    delta-gated site (MHAR_SPEC 1.4). Raises ValueError for bad arguments as
    `mhar_kernels.contract.check_route_args` (`dispatch.merge` checks them)."""
    return dispatch.merge(state.mix, state.norm, state.lse, query, key_norm, settings.heads, settings.eps, dtype,
                          settings.kernel, *late, partial=h if site.gated else None,
                          alpha=alpha if site.gated else None)


def storage_dtype(sources: Sequence[Tensor | None]) -> torch.dtype:
    """The dtype of the (B, T, d) entries of a source list (every one has it)."""
    return next(s.dtype for s in sources if s is not None and s.dim() > 1)


def route_site(call: SiteCall, settings: RoutingSettings, h: Tensor | None, entries: Sequence,
               sources: BlockSources, token: Tensor | None, states: dict[int, State], query: Tensor,
               key_norm: Tensor, alpha: Tensor | None, group_query: Tensor | None = None,
               group_key_norm: Tensor | None = None) -> Tensor:
    """The routing of `call`'s site over the source list `entries` (each (B, T, d), (d,) null
    sources): per call, or (grouped) phase 1 when its group starts here, then its merge. On the
    fused kernels' depth buffer where `sources` has one (after the write that made `token`), else
    through the list functions of `mhar_kernels.dispatch`. query, key_norm (d,), alpha (1,): the
    site's rows; group_query, group_key_norm (g, d): its group's, where the group starts here.
    `states`: phase-1 states by site (updated in place: the group's added, the site's taken).
    Returns the mix (B, T, d), or h + alpha * mix at a delta-gated site (MHAR_SPEC 1.4).
    Raises ValueError for bad arguments as `mhar_kernels.contract.check_route_args`."""
    partial, alpha = (h, alpha) if call.site.gated else (None, None)
    buffer = sources.buffer if call.rows is not None or call.group is not None else None
    if partial is not None and buffer is None:  # the stream in the sources' dtype, as the buffer's kernels take it
        partial = partial.to(storage_dtype(entries))  # (it differs under autocast of another dtype than the model's)
    reads = sources.reads
    null = None if call.null is None else entries[call.null]
    if call.group is None:
        if buffer is not None:
            return dispatch.route_rows(buffer, reads[call.rows], token, query, key_norm, settings.heads, settings.eps,
                                       partial=partial, alpha=alpha, null_source=null)
        return dispatch.route(routed_sources(call, entries, h), query, key_norm, settings.heads, settings.eps,
                              settings.kernel, partial=partial, alpha=alpha, permutation=settings.permutation)
    if call.starts and buffer is not None:
        group, g = call.group, call.group.size
        *out, given = dispatch.phase1_rows(buffer, reads[call.phase1_rows], token, group_query, group_key_norm,
                                           group.phase1_reads, settings.heads, settings.eps, null)
        states.update({s: State(out[i], out[g + i], out[2 * g][i], (given, i, g)) for i, s in enumerate(group.sites)})
    elif call.starts:
        states.update(phase1(call.group, entries, group_query, group_key_norm, settings))
    state = states.pop(call.site.index)
    if buffer is not None:
        return dispatch.merge_rows(state.mix, state.norm, state.lse, query, key_norm, settings.heads, settings.eps,
                                   buffer, None if call.rows is None else reads[call.rows], token, state.given,
                                   partial=partial, alpha=alpha)
    return merge(call.site, [entries[j] for j in call.late], state, storage_dtype(entries), h, query, key_norm, alpha,
                 settings)


def sublayer_input(call: SiteCall | None, settings: RoutingSettings, row: int, h: Tensor | None,
                   entries: list[Tensor], routing: BlockRouting | None, states: dict[int, State],
                   sources: BlockSources, token: Tensor | None) -> Tensor:
    """Input of sublayer `row` (0 attention, 1 MLP) of a block: h for the standard residual
    (`call` None), else `route_site` with the block's rows (`routing`); `states`: the block's
    phase-1 states by site (the block owns the dict)."""
    if call is None:
        return h
    return route_site(call, settings, h, entries, sources, token, states, routing.query[row], routing.key_norm[row],
                      None if routing.alpha is None else routing.alpha[row], routing.group_query, routing.group_key_norm)


class BlockOutput(NamedTuple):
    """What a block returns in every mode.

    h: the residual stream after the block (B, T, d); None in replace mode, where routing
    replaces it. sources: the entries its two sublayers added to the source list, in plan order
    (sublayer outputs or block partial sums, each (B, T, d)); empty for the standard residual.
    states: grouped routing only, the phase-1 `router.State`s of later blocks' sites, in site
    order (`router.LayerSchedule.leaving`); empty otherwise. token: the newest depth-buffer
    write's token where routing runs on the fused kernels' buffer (`mhar_kernels.depth_buffer`),
    else None.
    """

    h: Tensor | None
    sources: tuple[Tensor, ...]
    states: tuple[State, ...] = ()
    token: Tensor | None = None


def new_sources(site: Site | None, sources: list[Tensor], output: Tensor, h: Tensor | None) -> list[Tensor]:
    """The entries `site`'s sublayer creates: each recipe of the plan summed left to right over
    the sublayer `output`, the stream `h` after it and earlier entries of `sources`."""
    created: list[Tensor] = []
    for entry in site.creates if site is not None else ():
        value = None
        for coefficient, operand in entry.recipe:
            if operand == OUTPUT:
                x = output
            elif operand == STREAM:
                x = h
            else:  # an index into the source list, the entries created here continuing it
                x = sources[operand] if operand < len(sources) else created[operand - len(sources)]
            value = x if value is None else (value + x if coefficient > 0 else value - x)
        created.append(value)
    return created


class BlockInput(NamedTuple):
    """What the Router carries into a block: the stream h (B, T, d) (None in replace mode) and the
    block's `BlockRouting`. Tensors in a tuple: FSDP2 registers its post-backward hook on a block's
    tensor inputs, so the routing rows (which need a gradient) must be among them in replace mode,
    where no stream enters."""

    h: Tensor | None
    routing: BlockRouting


class BlockState(NamedTuple):
    """A block call's routing state (`RoutingLink.enter`): the stream h (B, T, d) (None in replace
    mode), the block's `BlockRouting`, the source list as the block extends it (`entries`, a list;
    the block's own entries from index `start` on), the phase-1 `State`s by site (the block's own
    dict) and the newest depth-buffer write's token."""

    h: Tensor | None
    routing: BlockRouting
    entries: list
    start: int
    states: dict
    token: Tensor | None


class RoutingLink:
    """One block's link (connections/base.py) in one forward: its two sites' `SiteCall`s and
    `LayerSchedule` (`schedule`), the plan's two `Site`s, the shared `RoutingSettings` and the source
    list so far (`sources`, a `BlockSources`); the block's rows and the states carried to it come in
    its `BlockInput`. A sublayer's input is `route_site`'s; its output makes the entries of its
    site's recipes (`new_sources`), written into the depth buffer (`BlockSources.add`)."""

    __slots__ = ("schedule", "sites", "settings", "sources")

    def __init__(self, schedule: LayerSchedule, sites: tuple[Site, Site], settings: RoutingSettings,
                 sources: BlockSources):
        self.schedule, self.sites, self.settings, self.sources = schedule, sites, settings, sources

    def enter(self, carried: BlockInput) -> BlockState:
        entries, routing = list(self.sources.entries), carried.routing
        return BlockState(carried.h, routing, entries, len(entries), dict(zip(self.schedule.carried, routing.states)),
                          routing.token)

    def read(self, sublayer: int, state: BlockState) -> Tensor:
        return sublayer_input(self.schedule.calls[sublayer], self.settings, sublayer, state.h, state.entries,
                              state.routing, state.states, self.sources, state.token)

    def write(self, sublayer: int, state: BlockState, output: Tensor) -> BlockState:
        h = None if state.h is None else state.h + output
        new, token = self.sources.add(new_sources(self.sites[sublayer], state.entries, output, h),
                                      self.schedule.slots[sublayer], self.schedule.keeps[sublayer], state.token)
        state.entries.extend(new)
        return state._replace(h=h, token=token)

    def leave(self, state: BlockState) -> BlockOutput:
        return BlockOutput(state.h, tuple(state.entries[state.start:]),
                           tuple(state.states[s] for s in self.schedule.leaving), state.token)


# ---------------------------------------------------------------------------- once per forward
Observer = Callable[[int, list, "Router"], None]
"""observer(site index, the sources it routes over, the router), called for every site in order."""


class Router:
    """Depth routing of one forward, the attn_res connection's flow (connections/base.py; module
    docstring): built from the `schedule` (`RoutingSchedule`), the routing parameters `params`
    (`DepthRouting`) and the `settings`; `observer` (optional) sees every site. `plan` is the
    schedule's routing plan. `buffered`: the fused kernels may route over one depth buffer per
    forward (False where the blocks are compiled: torch.compile traces the list-of-sources custom
    ops instead). `start(x0)` makes the initial source list; then `block(i)` / `done(i, out)` per
    block and `final()`. `buffer` is the forward's `DepthBuffer` (None where routing runs on
    another backend), `token` the newest write's token, `entries` the source list so far (None for
    entries no later site reads) and `h` the stream (None in replace mode)."""

    def __init__(self, schedule: RoutingSchedule, params: DepthRouting, settings: RoutingSettings,
                 observer: Observer | None = None, buffered: bool = True):
        self.schedule, self.plan, self.params, self.settings = schedule, schedule.plan, params, settings
        self.observer = observer
        self.rows = params.rows(self.plan.groups)
        self.pending: dict[int, State] = {}  # phase-1 states of sites in later blocks
        self.buffered = buffered
        self.buffer: DepthBuffer | None = None
        self.reads: tuple[Reads, ...] | None = None
        self.token: Tensor | None = None
        self.entries: list = []
        self.h: Tensor | None = None

    def start(self, x0: Tensor) -> None:
        """Begin the forward at the token embedding `x0` (B, T, d): the initial source list, and the
        stream where the plan keeps one (standard residual inside delta mode)."""
        self.entries = self.initial_sources(x0)
        self.h = x0 if self.plan.stream else None

    def block(self, layer: int) -> tuple[BlockInput, RoutingLink]:
        """Block `layer`'s arguments: its `BlockInput` (the stream and its rows), and its `RoutingLink`."""
        return (BlockInput(self.h, self.block_routing(layer)),
                RoutingLink(self.schedule.layers[layer], self.plan.layer_sites(layer), self.settings,
                            self.sources(self.entries)))

    def done(self, layer: int, out: BlockOutput) -> None:
        """Take block `layer`'s `BlockOutput` back: its entries join the source list, its states and
        token are kept, the observer sees its sites, and the entries no later site uses are dropped
        (block-delta partial sums are never routed over), so that they are freed once autograd is
        done with them."""
        h, new, states, token = out
        self.entries += new
        self.h = h
        self.block_done(layer, states, self.entries, h, token)
        for j in self.schedule.layers[layer].released:
            self.entries[j] = None

    def final(self) -> Tensor:
        """The read-out (B, T, d) before the final norm: the final site's routing, or the stream
        where the plan has no final site (the paper layout)."""
        return self.final_site(self.h, self.entries)

    def initial_sources(self, h: Tensor) -> list[Tensor]:
        """The plan's first entries (null sources, the embedding `h` (B, T, d)). Where the fused
        kernels route this forward (`dispatch.backend` is "triton", outside torch.compile), the
        depth buffer is made here (its `capacity` rows, in h's dtype) and the embedding written
        into its slot."""
        schedule, settings = self.schedule, self.settings
        if (self.buffered and schedule.capacity and not torch.compiler.is_compiling()
                and dispatch.backend(settings.kernel, h.device, h.shape[-1], settings.heads) == "triton"):
            contract.check_route_args([h], self.rows.query[0], self.rows.key_norm[0], settings.heads)
            self.buffer, self.reads = DepthBuffer(schedule.capacity, h), schedule.reads(h.device)
        nulls = iter(self.params.null_sources())
        entries = []
        for entry, slot, keep in zip(self.plan.initial, schedule.initial_slots, schedule.initial_keeps, strict=True):
            if entry.kind == "null":
                entries.append(next(nulls))
            elif self.buffer is not None and slot is not None:
                self.token = self.buffer.write(slot, h, self.token)
                entries.append(held(self.buffer, h, slot, keep))
            else:
                entries.append(h)
        return entries

    def sources(self, entries: Sequence) -> BlockSources:
        """The source list as the next block (or the final site) receives it."""
        return BlockSources(tuple(entries), self.buffer, self.reads)

    def block_routing(self, layer: int) -> BlockRouting:
        """The routing argument of block `layer`: its rows and the states carried to it."""
        rows, schedule = self.rows, self.schedule.layers[layer]
        two = slice(2 * layer, 2 * layer + 2)
        states = tuple(self.pending.pop(s) for s in schedule.carried)
        group = schedule.group
        return BlockRouting(rows.query[two], rows.key_norm[two], None if rows.alpha is None else rows.alpha[two],
                            states, None if group is None else rows.group_query[group.index],
                            None if group is None else rows.group_key_norm[group.index], self.token)

    def block_done(self, layer: int, states: tuple[State, ...], sources: list, h: Tensor | None,
                   token: Tensor | None = None) -> None:
        """Take block `layer`'s leaving states and newest token back and show the observer its two
        sites."""
        schedule = self.schedule.layers[layer]
        self.pending.update(zip(schedule.leaving, states))
        self.token = token
        if self.observer is not None:
            for call in schedule.calls:
                self.observer(call.site.index, routed_sources(call, sources, h), self)

    def final_site(self, h: Tensor | None, sources: list) -> Tensor:
        """The final site's routing (B, T, d): per call, or the merge of its phase-1 state; `h`
        itself where the plan has no final site (the paper layout)."""
        call = self.schedule.final
        if call is None:
            return h
        index, rows = call.site.index, self.rows
        if self.observer is not None:
            self.observer(index, routed_sources(call, sources, h), self)
        return route_site(call, self.settings, h, sources, self.sources(sources), self.token, self.pending,
                          rows.query[index], rows.key_norm[index], None if rows.alpha is None else rows.alpha[index])

    def site_rows(self, site: int) -> tuple[Tensor, Tensor]:
        """(effective pseudo-query, key-norm weight) of `site` in this forward, each (d,): the rows
        its routing call reads (`DepthRouting.effective_queries`), for analysis."""
        return self.rows.query[site], self.rows.key_norm[site]

    @torch.no_grad()
    def weights(self, site: int, sources: Sequence[Tensor]) -> Tensor:
        """Depth-softmax weights (N, B, T, H), compute dtype, of `site` over `sources` (as handed to
        the observer), from the reference implementation (`route_reference(return_weights=True)`)
        with the site's effective pseudo-query of this forward (its logit scale or learned
        temperature folded in, `DepthRouting.effective_queries`): the weights the forward used."""
        query, key_norm = self.site_rows(site)
        _, weights = reference.route_reference([s.detach() for s in sources], query.detach(),
                                               key_norm.detach(), self.settings.heads, self.settings.eps,
                                               return_weights=True, permutation=self.settings.permutation)
        return weights
