"""The model's side of depth routing: its parameters and the Router that feeds every block.

How a routing site is computed is the op package's job (`mhar_kernels.dispatch`, one backend
rule over the reference, the grouped reference and the fused kernels). This module maps the
routing plan onto those calls:

- `DepthRouting`: all routing parameters of the model (pseudo-queries, key norms, gates, nulls).
- `RoutingSettings`: what every site shares (kernel, heads H, eps, the permuted head layout).
- `RoutingSchedule`: the plan resolved once per model into what each site and block does (which
  entries it routes over, its group, the states entering and leaving each block, the entries
  the forward releases after it), so that no plan lookup runs per site and forward.
- `Router`: built once per forward from the schedule, the parameters and the settings. It takes
  every routing parameter's rows once (`DepthRouting.rows`: views with one backward node per
  parameter), makes the initial source list, gives each block one `BlockRouting` argument (that
  block's rows and the phase-1 states carried to it, all tensors, so activation checkpointing
  keeps them as block inputs), takes the block's new states back, and routes the final site.
  With an observer it hands every site's sources to it and gives it the reference's
  depth-softmax weights (analysis).
- `sublayer_input`: what a block calls for each of its two sublayers.

Grouped routing (`routing_group_size` g > 1, docs/DESIGN.md "Grouped routing"): the block holding
a group's first site runs its phase 1 and merges the states of its own sites; the states of sites
in later blocks leave it in `BlockOutput.states` (a tuple, in site order) and reach those blocks
through the Router.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Sequence

import torch
from torch import Tensor, nn

from mhar_kernels import contract, dispatch, reference
from mhar_kernels.depth_buffer import DepthBuffer, Reads, reads as device_reads

from .args import ModelArgs
from .plan import OUTPUT, Group, RoutingPlan, Site


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

    def into(self, slot: int | None, token: Tensor | None) -> "Projection | None":
        """Where a sublayer's output projection writes: depth-buffer row `slot` (its one entry is
        its output as it is, `LayerSchedule.direct`) after the write that made `token`, where there
        is a buffer; else None (a new tensor)."""
        return None if self.buffer is None or slot is None else Projection(self.buffer, slot, token)


    def add(self, created: list[Tensor], slots: Sequence[int | None], keeps: Sequence[bool],
            token: Tensor | None, direct: int | None = None) -> tuple[list[Tensor], Tensor | None]:
        """Write the new entries `created` into their depth-buffer slots (None: not routed over;
        `direct`: the slot the output projection already computed its entry into, `into`) after the write that made
        `token`; returns (the entries as the source list holds them: the buffer's row, or the
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
            if slot is not None and slot != direct:
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


class Projection:
    """A sublayer's output projection computed straight into a depth-buffer slot
    (`DepthBuffer.project`: no copy of its result): called as projection(linear, x) by the
    sublayer's module (so its forward hooks see the output), it keeps the write's token. A
    projection that is not a plain bias-free `nn.Linear` without hooks (a subclass, an adapter),
    or one under autocast, runs as a module and its output is copied into the slot."""

    __slots__ = ("buffer", "slot", "token")

    def __init__(self, buffer: DepthBuffer, slot: int, token: Tensor | None):
        self.buffer, self.slot, self.token = buffer, slot, token

    def __call__(self, linear: nn.Linear, x: Tensor) -> Tensor:
        if (type(linear) is not nn.Linear or linear.bias is not None or linear._forward_hooks
                or linear._forward_pre_hooks or torch.is_autocast_enabled(x.device.type)):
            out = linear(x)
            self.token = self.buffer.write(self.slot, out, self.token)
            return out
        out, self.token = self.buffer.project(self.slot, x, linear.weight, self.token)
        return out


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


@dataclass(frozen=True)
class RoutingSettings:
    """What every routing site of a model shares: the configured `kernel` (routing_kernel),
    `heads` (resolved H), `eps`, and for the permuted head layout the model `dim` and
    `permutation_seed` (None for contiguous heads)."""

    kernel: str
    heads: int
    eps: float
    dim: int = 0
    permutation_seed: int | None = None

    @classmethod
    def from_args(cls, args: ModelArgs) -> "RoutingSettings":
        seed = args.routing_head_layout_seed if args.routing_head_layout == "permuted" else None
        return cls(args.routing_kernel, args.resolved_routing_heads, args.routing_eps, args.dim, seed)

    @property
    def permutation(self) -> Tensor | None:
        """The permuted head layout's int64 (d,) permutation (`reference.head_permutation`, on the
        CPU, made once per process), None for contiguous heads."""
        return None if self.permutation_seed is None else reference.head_permutation(self.dim, self.permutation_seed)


class SiteRows(NamedTuple):
    """Every routing parameter's rows for one forward (`DepthRouting.rows`), all views.

    query, key_norm: S rows (d,), by site. alpha: S rows (1,) in delta mode, else None.
    group_query, group_key_norm: {group index: its (g, d) rows} for the groups of more than one
    site (grouped routing), empty for per-call routing."""

    query: tuple[Tensor, ...]
    key_norm: tuple[Tensor, ...]
    alpha: tuple[Tensor, ...] | None
    group_query: dict[int, Tensor]
    group_key_norm: dict[int, Tensor]


def parameter_rows(parameter: Tensor, groups: Sequence[Group]) -> tuple[tuple[Tensor, ...], dict[int, Tensor]]:
    """The rows of an (S, ...) routing parameter as views: per site its row (S rows of shape
    (...)), and {group index: its (g, ...) rows} for every group of more than one site.

    Per-call routing unbinds the parameter once (one backward node, which stacks the S row
    gradients into one (S, ...) gradient); grouped routing splits it once by group and unbinds
    each group's rows (one node per group besides). Indexing a row per site instead gives each
    site a backward that writes a zero-filled (S, ...) tensor, and autograd one (S, ...) addition
    per site."""
    if len(groups) == parameter.shape[0]:  # the groups cover the S sites: S groups are S single sites
        return parameter.unbind(0), {}
    chunks = parameter.split([group.size for group in groups])
    rows = tuple(row for chunk in chunks for row in chunk.unbind(0))
    return rows, {group.index: chunk for group, chunk in zip(groups, chunks) if group.size > 1}


class DepthRouting(nn.Module):
    """All routing parameters of the model (MHAR_SPEC section 2; DESIGN.md "Placement").

    query (S, d): pseudo-queries, row 2i / 2i+1 = layer i's attention / MLP site, row 2L = final.
    key_norm (S, d): key RMSNorm weights. alpha (S, 1): delta gates (delta mode only; shape (1,)
    per site because FSDP rejects 0-dim parameters). null_source: when enabled, (d,), or (2L, d)
    in the paper layout (row k = the null of site k; plan.py). log_temperature (S, H): with
    `routing_temperature = "learned"` only, one learnable log-temperature per site and routing
    head, initialised to log(routing_logit_scale); None otherwise.

    Logit scale and temperature (docs/DESIGN.md "Logit scale and temperature", which also says
    why Adam does not absorb a fixed scale): every depth logit of site s and head h is
    t_{s,h} <q_s[h], RMSNorm(k)[h]>, t the fixed `routing_logit_scale` or, learned,
    exp(log_temperature[s, h]). The factor is folded into the query once per forward,
    q_eff[s, h] = t_{s,h} q_s[h] (`effective_queries`, the ONE accessor of a site's effective
    pseudo-query), so every routing path runs unchanged on q_eff; at scale 1 with a fixed
    temperature the raw parameter itself is used (bitwise the unscaled model). Gradients through
    the fold: dL/dq_s[h] = t_{s,h} dL/dq_eff[h], dL/dlog t_{s,h} = <dL/dq_eff[h], q_eff[h]>.
    """

    def __init__(self, args: ModelArgs, plan: RoutingPlan | None = None):
        super().__init__()
        plan = plan or RoutingPlan.from_args(args)
        S, d, nulls = plan.n_sites, args.dim, plan.n_nulls
        self.query = nn.Parameter(torch.empty(S, d))
        self.key_norm = nn.Parameter(torch.empty(S, d))
        self.alpha = nn.Parameter(torch.empty(S, 1)) if args.routing_mode == "delta" else None
        self.null_source = nn.Parameter(torch.empty((nulls, d) if nulls > 1 else (d,))) if nulls else None
        self.logit_scale = args.resolved_logit_scale  # c, a float (args.logit_scale)
        self.heads = args.resolved_routing_heads
        self.settings = RoutingSettings.from_args(args)
        learned = args.routing_temperature == "learned"
        self.log_temperature = nn.Parameter(torch.empty(S, self.heads)) if learned else None

    def reset_parameters(self) -> None:
        """Pseudo-queries exactly 0 (uniform depth softmax, MHAR_SPEC pitfall 2), key norms 1, gates 0, null 0,
        log-temperatures log(routing_logit_scale) (the learned temperature starts at the fixed scale)."""
        nn.init.zeros_(self.query)
        nn.init.ones_(self.key_norm)
        if self.alpha is not None:
            nn.init.zeros_(self.alpha)
        if self.null_source is not None:
            nn.init.zeros_(self.null_source)
        if self.log_temperature is not None:
            nn.init.constant_(self.log_temperature, math.log(self.logit_scale))

    def null_sources(self) -> list[Tensor]:
        """The (d,) null sources in the order of the plan's null entries (empty when disabled)."""
        if self.null_source is None:
            return []
        return [self.null_source] if self.null_source.dim() == 1 else list(self.null_source.unbind(0))

    @property
    def learned(self) -> bool:
        """Whether the temperatures are learned (`routing_temperature = "learned"`)."""
        return self.log_temperature is not None

    @property
    def scaled(self) -> bool:
        """Whether the effective pseudo-queries differ from the raw ones (a scale other than 1, or
        a learned temperature)."""
        return self.log_temperature is not None or self.logit_scale != 1.0

    def temperatures(self) -> Tensor:
        """(S, H) factors t_{s,h} every depth logit of site s, head h is multiplied by (class
        docstring): exp(log_temperature), or the fixed scale; in the query's dtype, on its device."""
        if self.log_temperature is not None:
            return self.log_temperature.exp().to(self.query.dtype)
        return torch.full((self.query.shape[0], self.heads), self.logit_scale, dtype=self.query.dtype,
                          device=self.query.device)

    def effective_queries(self) -> Tensor:
        """(S, d) effective pseudo-queries q_eff[s, h] = t_{s,h} q_s[h], head h being the layout's
        coordinates of head h (contiguous slices, or the permuted layout's): the one accessor every
        reader of a site's query uses (class docstring). Differentiable; the raw parameter itself
        at scale 1 with a fixed temperature."""
        if not self.scaled:
            return self.query
        if self.log_temperature is None:
            return self.query * self.logit_scale
        S, d = self.query.shape
        t = self.log_temperature.exp().to(self.query.dtype).unsqueeze(-1)  # (S, H, 1)
        permutation = self.settings.permutation
        if permutation is None:
            return (self.query.view(S, self.heads, -1) * t).view(S, d)
        perm = permutation.to(self.query.device)  # head h owns coordinates perm[h K:(h + 1) K]
        scaled = (self.query.index_select(1, perm).view(S, self.heads, -1) * t).view(S, d)
        return scaled.index_select(1, torch.argsort(perm))

    def effective_query(self, site: int) -> Tensor:
        """(d,) effective pseudo-query of `site` (`effective_queries`' row)."""
        return self.effective_queries()[site]

    def rows(self, groups: Sequence[Group]) -> SiteRows:
        """Every parameter's per-site and per-group rows for one forward (`parameter_rows`), taken
        once per forward (under FSDP2 from the unsharded parameters), for the plan's `groups`; the
        query rows are the effective pseudo-queries (`effective_queries`, folded once here)."""
        query, group_query = parameter_rows(self.effective_queries(), groups)
        key_norm, group_key_norm = parameter_rows(self.key_norm, groups)
        alpha = None if self.alpha is None else self.alpha.unbind(0)
        return SiteRows(query, key_norm, alpha, group_query, group_key_norm)


# ---------------------------------------------------------------------------- the schedule
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
    built from it, so the source list holds the tensor itself, not its buffer row; direct, per
    sublayer, the slot its output projection computes straight into (its one entry is its output
    as it is, `BlockSources.into`), else None."""

    calls: tuple[SiteCall | None, SiteCall | None]
    carried: tuple[int, ...]
    leaving: tuple[int, ...]
    group: Group | None
    released: tuple[int, ...]
    slots: tuple[tuple[int | None, ...], tuple[int | None, ...]] = ((), ())
    keeps: tuple[tuple[bool, ...], tuple[bool, ...]] = ((), ())
    direct: tuple[int | None, int | None] = (None, None)


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


def _direct(site: Site | None, slots: dict[int, int]) -> int | None:
    """The slot `site`'s sublayer output projection computes into: where the sublayer is an
    attention (the MLP's projection is a block's last op, which activation checkpointing's early
    stop does not recompute when it is torch's own linear: a custom projection, whose saved
    tensors are packed after it ran, would run again; its copy into the slot is cheaper), its one
    created entry is its output as it is (recipe ((1, OUTPUT),)) and some site routes over it;
    else None."""
    if (site is None or site.sublayer != "attention" or len(site.creates) != 1
            or site.creates[0].recipe != ((1, OUTPUT),)):
        return None
    return slots.get(site.creates[0].index)


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
                tuple(tuple(j in built_from for j in entries) for entries in made),
                tuple(_direct(s, slots) for s in sites)))
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


# ---------------------------------------------------------------------------- one site
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


# ---------------------------------------------------------------------------- once per forward
Observer = Callable[[int, list, "Router"], None]
"""observer(site index, the sources it routes over, the router), called for every site in order."""


class Router:
    """Depth routing of one forward (module docstring): built from the `schedule`
    (`RoutingSchedule`), the routing parameters `params` (`DepthRouting`) and the `settings`;
    `observer` (optional) sees every site. `plan` is the schedule's routing plan. `buffered`:
    the fused kernels may route over one depth buffer per forward (False where the blocks are
    compiled: torch.compile traces the list-of-sources custom ops instead). After
    `initial_sources`, `buffer` is the forward's `DepthBuffer` (None where routing runs on another
    backend) and `token` the newest write's token; `block_done` takes each block's back."""

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

    def final(self, h: Tensor | None, sources: list) -> Tensor:
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
