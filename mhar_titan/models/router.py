"""The model's side of depth routing: its parameters and the Router that feeds every block.

How a routing site is computed is the op package's job (`mhar_kernels.dispatch`, one backend
rule over the reference, the grouped reference and the fused kernels). This module maps the
routing plan onto those calls:

- `DepthRouting`: all routing parameters of the model (pseudo-queries, key norms, gates, nulls).
- `RoutingSettings`: what every site shares (kernel, heads H, eps, the permuted head layout).
- `Router`: built once per forward from the plan, the parameters and the settings. It makes the
  initial source list, gives each block one `BlockRouting` argument (that block's rows and the
  phase-1 states carried to it, all tensors, so activation checkpointing keeps them as block
  inputs), takes the block's new states back, and routes the final site. With an observer it
  hands every site's sources to it and gives it the reference's depth-softmax weights (analysis).
- `sublayer_input`: what a block calls for each of its two sublayers.

Grouped routing (`routing_group_size` g > 1, docs/DESIGN.md "Grouped routing"): the block holding
a group's first site runs its phase 1 and merges the states of its own sites; the states of sites
in later blocks leave it in `BlockOutput.states` (a tuple, in site order) and reach those blocks
through the Router.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

import torch
from torch import Tensor, nn

from mhar_kernels import contract, dispatch, reference

from .args import ModelArgs
from .plan import Group, RoutingPlan, Site


class State(NamedTuple):
    """Phase-1 routing state of one site: mix (B, T, d) (the storage dtype on the fused kernels,
    the compute dtype on the eager ones) and norm (B, T, H) fp32 (differentiable), lse (B, T, H)
    fp32 (not differentiable)."""

    mix: Tensor
    norm: Tensor
    lse: Tensor


class BlockRouting(NamedTuple):
    """One block's routing argument (tensors only).

    query, key_norm: (2, d) rows of the layer's two sites (attention, MLP); alpha: (2, 1), delta
    mode only. states: the phase-1 `State`s of the layer's sites computed in earlier blocks, in
    site order (`carried_sites`). group_query, group_key_norm: (g, d) rows of the group of more
    than one site whose first site is in this layer, else None.
    """

    query: Tensor
    key_norm: Tensor
    alpha: Tensor | None = None
    states: tuple[State, ...] = ()
    group_query: Tensor | None = None
    group_key_norm: Tensor | None = None


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


class DepthRouting(nn.Module):
    """All routing parameters of the model (MHAR_SPEC section 2; DESIGN.md "Placement").

    query (S, d): pseudo-queries, row 2i / 2i+1 = layer i's attention / MLP site, row 2L = final.
    key_norm (S, d): key RMSNorm weights. alpha (S, 1): delta gates (delta mode only; shape (1,)
    per site because FSDP rejects 0-dim parameters). null_source: when enabled, (d,), or (2L, d)
    in the paper layout (row k = the null of site k; plan.py).
    """

    def __init__(self, args: ModelArgs, plan: RoutingPlan | None = None):
        super().__init__()
        plan = plan or RoutingPlan.from_args(args)
        S, d, nulls = plan.n_sites, args.dim, plan.n_nulls
        self.query = nn.Parameter(torch.empty(S, d))
        self.key_norm = nn.Parameter(torch.empty(S, d))
        self.alpha = nn.Parameter(torch.empty(S, 1)) if args.routing_mode == "delta" else None
        self.null_source = nn.Parameter(torch.empty((nulls, d) if nulls > 1 else (d,))) if nulls else None

    def reset_parameters(self) -> None:
        """Pseudo-queries exactly 0 (uniform depth softmax, MHAR_SPEC pitfall 2), key norms 1, gates 0, null 0."""
        nn.init.zeros_(self.query)
        nn.init.ones_(self.key_norm)
        if self.alpha is not None:
            nn.init.zeros_(self.alpha)
        if self.null_source is not None:
            nn.init.zeros_(self.null_source)

    def null_sources(self) -> list[Tensor]:
        """The (d,) null sources in the order of the plan's null entries (empty when disabled)."""
        if self.null_source is None:
            return []
        return [self.null_source] if self.null_source.dim() == 1 else list(self.null_source.unbind(0))

    def site(self, index: int) -> dict:
        """Parameters of one site: query, norm_weight (d,), alpha (1,) or None."""
        return dict(
            query=self.query[index], norm_weight=self.key_norm[index],
            alpha=None if self.alpha is None else self.alpha[index],
        )


# ---------------------------------------------------------------------------- one site
def routed_sources(site: Site, sources: Sequence[Tensor], like: Tensor | None) -> list[Tensor]:
    """The entries `site` routes over. A site that reads only its (d,) null source (paper layout,
    layer 0's attention) gets it broadcast to the shape of `like` (B, T, d), so its mix is the null."""
    picked = [sources[j] for j in site.reads]
    if all(s.dim() == 1 for s in picked):
        picked = [s.to(like.dtype).expand_as(like).contiguous() for s in picked]
    return picked


def site_input(site: Site, sources: Sequence[Tensor], h: Tensor | None, query: Tensor, key_norm: Tensor,
               alpha: Tensor | None, settings: RoutingSettings) -> Tensor:
    """Per-call routing at `site` over the entries `site.reads` of `sources` (each (B, T, d), a
    (d,) null first): the mix (B, T, d), or h + alpha * mix for a delta-gated site (MHAR_SPEC 1.4).
    query, key_norm (d,), alpha (1,): the site's rows. Raises ValueError as `dispatch.route`."""
    return dispatch.route(
        routed_sources(site, sources, h), query, key_norm, settings.heads, settings.eps, settings.kernel,
        partial=h if site.gated else None, alpha=alpha if site.gated else None, permutation=settings.permutation,
    )


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
    heads = contract.check_route_args(full, query[0], key_norm[0], settings.heads, null_source=null)
    reads = tuple(tuple(j in early for j in group.reads) for early in group.early)
    out = dispatch.phase1(query, key_norm, reads, heads, settings.eps, settings.kernel,
                          *contract.with_null_source(null, full))
    g = group.size
    # each site's lse is its own tensor, not a view of the group's (a block output must not be a view)
    return {site: State(out[i], out[g + i], out[2 * g][..., i, :].contiguous()) for i, site in enumerate(group.sites)}


def merge(site: Site, late: Sequence[Tensor], state: State, dtype: torch.dtype, h: Tensor | None, query: Tensor,
          key_norm: Tensor, alpha: Tensor | None, settings: RoutingSettings) -> Tensor:
    """Phase 2 at `site`: its phase-1 `state` merged with its in-group sources `late` (each
    (B, T, d)), by `dispatch.merge`. dtype: the sources' storage dtype. query, key_norm (d,),
    alpha (1,): the site's rows. Returns the mix (B, T, d) in `dtype`, or h + alpha * mix for a
    delta-gated site (MHAR_SPEC 1.4). Raises ValueError for bad arguments as
    `mhar_kernels.contract.check_route_args`."""
    heads = settings.heads
    if late:
        heads = contract.check_route_args(list(late), query, key_norm, heads)
    return dispatch.merge(state.mix, state.norm, state.lse, query, key_norm, heads, settings.eps, dtype,
                          settings.kernel, *late, partial=h if site.gated else None,
                          alpha=alpha if site.gated else None)


def shared_entries(entries: list[Tensor], settings: RoutingSettings) -> list[Tensor]:
    """New source-list entries as the routing sites read them (`dispatch.share_gradient`)."""
    return [dispatch.share_gradient(e, settings.kernel, settings.heads) for e in entries]


def storage_dtype(sources: Sequence[Tensor | None]) -> torch.dtype:
    """The dtype of the (B, T, d) entries of a source list (every one has it)."""
    return next(s.dtype for s in sources if s is not None and s.dim() > 1)


# ---------------------------------------------------------------------------- inside a block
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


def sublayer_input(plan: RoutingPlan, settings: RoutingSettings, layer: int, row: int, h: Tensor | None,
                   sources: list[Tensor], routing: BlockRouting | None, states: dict[int, State]) -> Tensor:
    """Input of sublayer `row` (0 attention, 1 MLP) of `layer`: h for the standard residual, else
    its site's routing: per call, or (grouped) phase 1 when its group starts here, then its merge.
    `states`: the block's phase-1 states by site (updated in place; the block owns the dict)."""
    site = plan.layer_sites(layer)[row]
    if site is None:
        return h
    alpha = None if routing.alpha is None else routing.alpha[row]
    group, position = plan.group_of(site.index)
    if group.size == 1:
        return site_input(site, sources, h, routing.query[row], routing.key_norm[row], alpha, settings)
    if position == 0:
        states.update(phase1(group, sources, routing.group_query, routing.group_key_norm, settings))
    late = [sources[j] for j in group.late[position]]
    return merge(site, late, states.pop(site.index), storage_dtype(sources), h, routing.query[row],
                 routing.key_norm[row], alpha, settings)


# ---------------------------------------------------------------------------- once per forward
Observer = Callable[[int, list, "Router"], None]
"""observer(site index, the sources it routes over, the router), called for every site in order."""


class Router:
    """Depth routing of one forward (module docstring): built from the `plan`, the routing
    parameters `params` (`DepthRouting`) and the `settings`; `observer` (optional) sees every site."""

    def __init__(self, plan: RoutingPlan, params: DepthRouting, settings: RoutingSettings,
                 observer: Observer | None = None):
        self.plan, self.params, self.settings, self.observer = plan, params, settings, observer
        self.pending: dict[int, State] = {}  # phase-1 states of sites in later blocks

    def initial_sources(self, h: Tensor) -> list[Tensor]:
        """The plan's first entries (null sources, the embedding `h` (B, T, d) shared as the sites
        read it, `dispatch.share_gradient`)."""
        nulls = iter(self.params.null_sources())
        shared = shared_entries([h], self.settings)[0] if self.plan.initial else h
        return [next(nulls) if entry.kind == "null" else shared for entry in self.plan.initial]

    def block_routing(self, layer: int) -> BlockRouting:
        """The routing argument of block `layer`: its rows and the states carried to it."""
        p, rows = self.params, slice(2 * layer, 2 * layer + 2)
        states = tuple(self.pending.pop(s) for s in carried_sites(self.plan, layer))
        group_query = group_key_norm = None
        for site in (2 * layer, 2 * layer + 1):
            group, position = self.plan.group_of(site)
            if position == 0 and group.size > 1:
                group_rows = slice(site, site + group.size)
                group_query, group_key_norm = p.query[group_rows], p.key_norm[group_rows]
        return BlockRouting(p.query[rows], p.key_norm[rows], None if p.alpha is None else p.alpha[rows], states,
                            group_query, group_key_norm)

    def block_done(self, layer: int, states: tuple[State, ...], sources: list, h: Tensor | None) -> None:
        """Take block `layer`'s leaving states back and show the observer its two sites."""
        self.pending.update(zip(leaving_sites(self.plan, layer), states))
        if self.observer is not None:
            for site in self.plan.sites[2 * layer: 2 * layer + 2]:
                self.observer(site.index, routed_sources(site, sources, h), self)

    def final(self, h: Tensor | None, sources: list) -> Tensor:
        """The final site's routing (B, T, d): per call, or the merge of its phase-1 state; `h`
        itself where the plan has no final site (the paper layout)."""
        final = self.plan.final
        if final is None:
            return h
        if self.observer is not None:
            self.observer(final.index, [sources[j] for j in final.reads], self)
        p = self.params.site(final.index)
        if final.index in self.pending:
            late = [sources[j] for j in self.plan.group_of(final.index)[0].late[-1]]
            return merge(final, late, self.pending.pop(final.index), storage_dtype(sources), h, p["query"],
                         p["norm_weight"], p["alpha"], self.settings)
        return site_input(final, sources, h, p["query"], p["norm_weight"], p["alpha"], self.settings)

    @torch.no_grad()
    def weights(self, site: int, sources: Sequence[Tensor]) -> Tensor:
        """Depth-softmax weights (N, B, T, H), compute dtype, of `site` over `sources` (as handed to
        the observer), from the reference implementation (`route_reference(return_weights=True)`)."""
        p = self.params
        _, weights = reference.route_reference([s.detach() for s in sources], p.query[site].detach(),
                                               p.key_norm[site].detach(), self.settings.heads, self.settings.eps,
                                               return_weights=True, permutation=self.settings.permutation)
        return weights
