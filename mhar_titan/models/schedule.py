"""The routing schedule: the routing plan resolved once per model (lifetime: the model).

`RoutingSchedule.from_plan` resolves, once per model, what each site and block does: which
entries each site routes over (`SiteCall`), its group, the phase-1 states entering and leaving
each block, the entries the forward releases after each block (`LayerSchedule`), and the fused
kernels' depth buffer: one slot per routed entry and every fused call's rows (`buffer_layout`,
`BufferCall`, docs/DESIGN.md "The depth buffer"). No plan lookup then runs per site and forward.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from mhar_kernels.depth_buffer import Reads, reads as device_reads

from .plan import Group, RoutingPlan, Site


class SiteCall(NamedTuple):
    """How one site is routed, resolved from the plan once per model.

    site: the plan's `Site`. reads: its entries of the source list, as a slice where they are
    consecutive (per-call sublayer routing reads every entry so far), else the indices.
    null_only: every entry it reads is a (d,) null source (paper layout, layer 0's attention).
    group: its group of more than one site, None for a per-call site; position: its place in it;
    late: the in-group entries its merge reads (grouped only); starts: its block runs the
    group's phase 1 here (position 0 of a group of more than one site). null: the (d,) null
    entry it reads first (its group's, for phase 1), else None. rows, phase1_rows: the indices of
    its fused calls on the depth buffer in `RoutingSchedule.buffer_calls` (its per-call routing or
    merge; the group's phase 1), None where it makes no such call."""

    site: Site
    reads: slice | tuple[int, ...]
    null_only: bool
    group: Group | None
    position: int
    late: tuple[int, ...]
    starts: bool
    null: int | None = None
    rows: int | None = None
    phase1_rows: int | None = None


class LayerSchedule(NamedTuple):
    """One block's part of the schedule: calls, its two sites' `SiteCall`s (None for the
    standard residual); carried, the sites of this layer whose phase 1 ran in an earlier block
    (their states enter the block, in site order); leaving, the later sites whose phase 1 runs
    in this block (their states leave it, in site order); group, the group of more than one site
    whose first site is in this layer, else None; released, the entries of the source list no
    site after this block reads or builds on (the forward drops them after it, so that they are
    freed once autograd is done with them); slots, per sublayer, one depth-buffer slot per entry
    it creates (None: no site routes over it); keeps, per sublayer and entry: a later entry is
    built from it, so the source list holds the tensor itself, not its buffer row."""

    calls: tuple[SiteCall | None, SiteCall | None]
    carried: tuple[int, ...]
    leaving: tuple[int, ...]
    group: Group | None
    released: tuple[int, ...]
    slots: tuple[tuple[int | None, ...], tuple[int | None, ...]] = ((), ())
    keeps: tuple[tuple[bool, ...], tuple[bool, ...]] = ((), ())


def _as_slice(indices: tuple[int, ...]) -> slice | tuple[int, ...]:
    if indices and indices == tuple(range(indices[0], indices[-1] + 1)):
        return slice(indices[0], indices[-1] + 1)
    return indices


def site_call(plan: RoutingPlan, site: Site) -> SiteCall:
    """The `SiteCall` of `site` under `plan`."""
    group, position = plan.group_of(site.index)
    grouped = group.size > 1
    return SiteCall(site, _as_slice(site.reads), all(plan.sources[j].kind == "null" for j in site.reads),
                    group if grouped else None, position, group.late[position] if grouped else (),
                    grouped and position == 0)


def carried_sites(plan: RoutingPlan, layer: int) -> tuple[int, ...]:
    """Sites of `layer` whose phase 1 ran in an earlier block (their states enter the block)."""
    return tuple(s.index for s in plan.layer_sites(layer)
                 if s is not None and plan.group_of(s.index)[0].sites[0] < 2 * layer)


def leaving_sites(plan: RoutingPlan, layer: int) -> tuple[int, ...]:
    """Sites after `layer` whose phase 1 runs in its block (their states leave the block)."""
    out = []
    for site in plan.layer_sites(layer):
        if site is None:
            continue
        group, position = plan.group_of(site.index)
        if position == 0:
            out += [s for s in group.sites if s > 2 * layer + 1]
    return tuple(out)


class BufferCall(NamedTuple):
    """One fused call on the depth buffer, resolved from the plan: `slots`, the rows it reads in
    its source order; `adds`, per row, whether its backward adds to the row's gradient (False: it
    is the row's last reader in the forward, so the first in the backward, and writes it)."""

    slots: tuple[int, ...]
    adds: tuple[bool, ...]


def buffer_layout(plan: RoutingPlan) -> tuple[dict[int, int], list[tuple[tuple, tuple[int, ...]]]]:
    """The depth buffer of `plan` (docs/DESIGN.md "The depth buffer"): ({entry: slot} for every
    (B, T, d) entry some site routes over, in list order), and the fused calls in forward order as
    (key, entries read): ("site", s) per-call routing or the merge of site s (its in-group reads),
    ("phase1", s) the phase 1 of the group starting at site s. A site that reads only null
    sources makes no buffer call."""
    routed = sorted({j for site in plan.sites for j in site.reads if plan.sources[j].kind != "null"})
    slots = {j: slot for slot, j in enumerate(routed)}
    calls = []
    for site in plan.sites:
        if all(plan.sources[j].kind == "null" for j in site.reads):
            continue
        group, position = plan.group_of(site.index)
        if group.size == 1:
            calls.append((("site", site.index), tuple(j for j in site.reads if j in slots)))
            continue
        if position == 0:
            calls.append((("phase1", site.index), tuple(j for j in group.reads if j in slots)))
        if group.late[position]:
            calls.append((("site", site.index), tuple(group.late[position])))
    return slots, calls


@dataclass(frozen=True)
class RoutingSchedule:
    """The routing plan resolved once per model (module docstring): `layers`, one
    `LayerSchedule` per layer (n_layers of them, also for the standard residual); `final`, the
    final site's `SiteCall` (None where the plan has none); for the fused kernels' depth buffer
    (`buffer_layout`): `capacity` (its rows), `initial_slots` (per initial entry, its slot or
    None), `initial_keeps` (per initial entry, whether a later entry is built from it, as
    `LayerSchedule.keeps`), `buffer_calls` (every fused call's `BufferCall`, indexed by `SiteCall.rows` /
    `SiteCall.phase1_rows`). Build with `from_plan`."""

    plan: RoutingPlan
    layers: tuple[LayerSchedule, ...]
    final: SiteCall | None
    capacity: int = 0
    initial_slots: tuple[int | None, ...] = ()
    initial_keeps: tuple[bool, ...] = ()
    buffer_calls: tuple[BufferCall, ...] = ()
    _reads: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_plan(cls, plan: RoutingPlan, n_layers: int) -> "RoutingSchedule":
        """The schedule of `plan` for a model of `n_layers` layers."""
        slots, calls = buffer_layout(plan)
        last = {j: i for i, (_, entries) in enumerate(calls) for j in entries}
        buffer_calls = tuple(BufferCall(tuple(slots[j] for j in entries), tuple(last[j] != i for j in entries))
                             for i, (_, entries) in enumerate(calls))
        index = {key: i for i, (key, _) in enumerate(calls)}
        built_from = {op for source in plan.sources for _, op in source.recipe if isinstance(op, int)}

        def resolved(site: Site) -> SiteCall:
            call = site_call(plan, site)
            group = plan.group_of(site.index)[0]
            first = (group.reads if call.starts else site.reads)[:1]
            null = first[0] if first and plan.sources[first[0]].kind == "null" else None
            return call._replace(null=null, rows=index.get(("site", site.index)),
                                 phase1_rows=index.get(("phase1", site.index)))

        layers, released, created = [], set(), sum(1 for s in plan.sources if s.site is None)
        for layer in range(n_layers):
            sites = plan.layer_sites(layer)
            calls_here = tuple(None if s is None else resolved(s) for s in sites)
            made = []  # per sublayer, the entries it creates
            for s in sites:
                made.append(range(created, created + (len(s.creates) if s is not None else 0)))
                created += len(made[-1])
            group = next((c.group for c in calls_here if c is not None and c.starts), None)
            # entries that exist after this block and that no site after it reads or builds on
            drop = tuple(j for j in range(created) if j not in released and plan.last_use[j] <= 2 * layer + 1)
            released.update(drop)
            layers.append(LayerSchedule(
                calls_here, carried_sites(plan, layer), leaving_sites(plan, layer), group, drop,
                tuple(tuple(slots.get(j) for j in entries) for entries in made),
                tuple(tuple(j in built_from for j in entries) for entries in made)))
        final = None if plan.final is None else resolved(plan.final)
        initial = tuple(slots.get(source.index) for source in plan.initial)
        initial_keeps = tuple(source.index in built_from for source in plan.initial)
        return cls(plan, tuple(layers), final, len(slots), initial, initial_keeps, buffer_calls)

    def reads(self, device: torch.device) -> tuple[Reads, ...]:
        """Every fused call's `Reads` on `device` (made once per device: their slot and add
        vectors are the same at every step)."""
        found = self._reads.get(device)
        if found is None:
            found = self._reads[device] = tuple(device_reads(c.slots, c.adds, device) for c in self.buffer_calls)
        return found
