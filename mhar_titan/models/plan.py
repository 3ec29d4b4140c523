"""The routing plan: which sources every depth-routing site reads (MHAR_SPEC sections 1.1, 1.2, 1.4).

The model keeps ONE growing list of sources per forward. It starts with the learnable null
source (when enabled) and the token embedding; after each sublayer, the entries that sublayer
creates are appended. A routing site reads a subset of the entries that exist when it runs.
`RoutingPlan.from_args(args)` writes all of this down once, as immutable data: the model's
forward and tracing, the metrics (source counts, routing FLOPs), the dry run's memory estimate
and the kernels' bytes accounting read it; nobody else re-derives it.

Sites are numbered like the rows of `DepthRouting.query`: site 2i is layer i's attention,
2i + 1 its MLP, 2L the final routing. Sublayer j is the output of site j (j < 2L).

Layout "clean" (this repository's convention; entry values in brackets):

| granularity, mode   | entries created after each sublayer  | a site reads                                  |
|---------------------|--------------------------------------|-----------------------------------------------|
| sublayer, replace   | its output a_i / m_i                 | every entry so far                            |
| sublayer, delta     | its output a_i / m_i                 | every entry so far (input h + alpha * mix)    |
| block, replace      | the open block's partial sum         | null, embedding, completed blocks, the open   |
|                     | [b_n^i = b_n^(i-1) + output]         | block's latest partial (Kimi Block AttnRes)   |
| block, delta        | the same partial sums                | null, embedding, completed blocks only        |

A block of k = routing_block_layers layers opens at every layer i with i % k == 0 (0-indexed)
and completes after the MLP of its last layer; its last partial sum is the completed block
(b_n in block-replace mode, the true block delta D_n in block-delta mode). The final routing
reads null, embedding and every completed block (the last one included).

Each created entry carries a recipe (a signed sum of this sublayer's output, the residual
stream after it and earlier entries), so another layout is new data built here, not new
branches in the model.

Layout "paper" (delta mode only; the authors' `delta` / `delta_mh` bookkeeping, MHAR_SPEC 1.4,
which the 8B conversion used). It differs from "clean" in five points, all identities while
the gates are 0:

1. null sources: one per sublayer site (entries 0..2L-1, entry k read by site k only, row k of
   the (2L, d) null parameter) instead of one shared (d,) null;
2. no final routing: the LM head reads norm(h) (no site 2L);
3. timing: layer 0's attention site reads its null alone (the embedding joins after it); at
   block granularity an entry made at a block boundary is read from that layer's MLP site on,
   not by its attention site;
4. block sources: at the first layer b of every block (b % k == 0), the entry appended is the
   stream before that layer's attention minus the previously appended entry (the embedding at
   b = 0), which gives emb, D_1, emb + D_2, D_1 + D_3, ... instead of true block deltas; it is
   made by the MLP site of layer b - 1 (recipe stream - entry) and read from layer b's MLP on;
5. routing eps: the model's norm eps (ModelArgs requires routing_eps == norm_eps for it).

Site order and parameter rows are the same as "clean" for the 2L sublayer sites.

Groups (grouped two-phase routing, docs/DESIGN.md "Grouped routing"): with
`routing_group_size` g, the sites are cut into groups of g consecutive sites (site 0 starts the
first group; the last group may be shorter). For each group, `Group.reads` are the entries that
exist when the group starts and that some site of the group reads: phase 1 reads each of them
once for all the group's sites; `Group.early[i]` / `Group.late[i]` split site i's reads into
those (merged from phase 1's state) and the in-group entries it reads itself (phase 2).
g = 1 is per-call routing: every group is one site whose reads are all early.
"""
from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field, replace

log = logging.getLogger(__name__)

OUTPUT = "output"  # recipe operand: the output of the sublayer that creates the entry
STREAM = "stream"  # recipe operand: the residual stream h after that sublayer (kept in delta mode)
# "block": an entry made once per completed block, for layouts that keep no partial sums
SOURCE_KINDS = ("null", "embedding", "output", "partial", "block")
LAYOUTS = ("clean", "paper")
# Rows of the storage dtype one (B, T, d) phase-1 state or its gradient costs (fp32 against bf16 sources).
STATE_ROWS = 2


@dataclass(frozen=True)
class Source:
    """One entry of the growing source list.

    index: position in the list. kind: one of `SOURCE_KINDS` ("block": a paper-layout block
    source, point 4 of the module docstring). site: index of the site whose
    sublayer creates it (None: exists before the first site). recipe: how the model computes
    it, ((coefficient +1 or -1, operand), ...) summed left to right, operand = `OUTPUT`,
    `STREAM` or the index of an earlier entry (empty for the null source and the embedding).
    embedding, sublayers: its value, the embedding (when True) plus the listed sublayer
    outputs (derived from the recipe; the null source has neither).
    """

    index: int
    kind: str
    site: int | None = None
    recipe: tuple[tuple[int, int | str], ...] = ()
    embedding: bool = False
    sublayers: tuple[int, ...] = ()


@dataclass(frozen=True)
class Site:
    """One routing site.

    index: site number (row of the routing parameters). layer: transformer layer (None for
    the final routing). sublayer: "attention", "mlp" or "final". reads: indices of the entries
    it routes over, in routing order. creates: the entries appended after its sublayer runs.
    gated: delta mode, input = h + alpha * mix. opens_block: a block (block granularity) starts
    at this sublayer. block: number n >= 1 of the block its sublayer belongs to (None at
    sublayer granularity and for the final routing).
    """

    index: int
    layer: int | None
    sublayer: str
    reads: tuple[int, ...]
    creates: tuple[Source, ...] = ()
    gated: bool = False
    opens_block: bool = False
    block: int | None = None

    @property
    def n_sources(self) -> int:
        return len(self.reads)


@dataclass(frozen=True)
class Block:
    """Block n (n >= 1) of block granularity: layers [first_layer, stop_layer); `source` is the
    entry that holds its completed sum (b_n, or the block delta D_n in delta mode)."""

    index: int
    first_layer: int
    stop_layer: int
    source: int


@dataclass(frozen=True)
class Group:
    """One group of consecutive routing sites (module docstring, "Groups").

    sites: the site indices, consecutive. reads: the entries that exist when the group starts
    and that some site of the group reads (phase 1 reads each once), in list order. early[i],
    late[i]: site sites[i]'s reads split into those in `reads` (phase 1) and those created
    inside the group (phase 2), each in the site's routing order.
    """

    index: int
    sites: tuple[int, ...]
    reads: tuple[int, ...]
    early: tuple[tuple[int, ...], ...]
    late: tuple[tuple[int, ...], ...]
    phase1_reads: tuple[tuple[bool, ...], ...] = field(init=False)
    """Per site of the group, one bool per entry of `reads`: the site reads it in phase 1 (the
    `reads` argument of `mhar_kernels.dispatch.phase1`); made once per group, not per forward (a
    plain field: torch.compile reads it inside a compiled block)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "phase1_reads", tuple(tuple(j in early_set for j in self.reads)
                                                       for early_set in map(set, self.early)))

    @property
    def size(self) -> int:
        return len(self.sites)


@dataclass(frozen=True)
class RoutingPlan:
    """Immutable routing plan of one `ModelArgs` (module docstring). Build with `from_args`.

    Fields: layout, granularity, mode, null_source, stream (the residual stream h is kept:
    standard residual and delta mode), sources (every entry, in list order), sites (in
    order; empty for the standard residual), blocks (block granularity only), group_size
    (g >= 1 consecutive sites per routing group; 1 = per-call routing).

    Raises (on construction):
        ValueError: a site or recipe names an entry that does not exist yet, a recipe uses
            the stream where none is kept, an entry's value is not a plain sum, or group_size < 1.
    """

    layout: str
    granularity: str
    mode: str
    null_source: bool
    stream: bool
    sources: tuple[Source, ...]
    sites: tuple[Site, ...]
    blocks: tuple[Block, ...] = ()
    group_size: int = 1
    source_counts: tuple[int, ...] = field(init=False)
    """Sources read per site, the null source included (what `metrics` counts)."""
    source_rows: int = field(init=False)
    """(B, T, d) sources read per token by one forward over all sites, the (d,) null source not
    counted: the bytes model's rows per token (docs/DESIGN.md)."""
    last_use: tuple[int, ...] = field(init=False)
    """Per entry, the last site that reads it or builds a new entry from it (-1: none); after
    that site the forward drops its reference (block-delta partial sums are never routed over)."""
    groups: tuple[Group, ...] = field(init=False)
    """The routing groups of `group_size` consecutive sites (module docstring, "Groups")."""
    grouped_rows: int = field(init=False)
    """(B, T, d) sources read per token by one grouped forward, the null source not counted:
    each group's phase-1 reads once plus every site's in-group reads (= source_rows at g = 1)."""

    def __post_init__(self) -> None:
        _check(self)
        object.__setattr__(self, "source_counts", tuple(site.n_sources for site in self.sites))
        object.__setattr__(self, "source_rows", sum(
            sum(self.sources[j].kind != "null" for j in site.reads) for site in self.sites))
        last = [-1] * len(self.sources)
        for site in self.sites:
            used = list(site.reads) + [op for new in site.creates for _, op in new.recipe if isinstance(op, int)]
            for j in used:
                last[j] = site.index
        object.__setattr__(self, "last_use", tuple(last))
        object.__setattr__(self, "groups", _groups(self))
        object.__setattr__(self, "grouped_rows", sum(
            self._rows(group.reads) + sum(self._rows(late) for late in group.late) for group in self.groups))

    @classmethod
    def from_args(cls, args, layout: str | None = None) -> "RoutingPlan":
        """The plan of `ModelArgs` `args` (residual, n_layers, routing_granularity,
        routing_block_layers, routing_mode, routing_null_source and routing_layout are read);
        `layout` overrides args.routing_layout.

        Raises:
            ValueError: unknown layout; the paper layout without delta mode and null sources.
        """
        layout = layout or getattr(args, "routing_layout", "clean")
        if layout not in LAYOUTS:
            raise ValueError(f"unknown routing layout {layout!r}; choose one of {LAYOUTS}")
        if args.residual != "attn_res":  # the other connections have no routing sites (connections/)
            return cls(layout, "sublayer", "replace", False, stream=True, sources=(), sites=())
        plan = _paper(args) if layout == "paper" else _clean(args)
        g = getattr(args, "routing_group_size", 1)
        return replace(plan, group_size=best_group_size(plan) if g == "auto" else g)

    # -- what the model and the accountants read ------------------------------------------------
    @property
    def n_sites(self) -> int:
        return len(self.sites)

    @property
    def initial(self) -> tuple[Source, ...]:
        """Entries that exist before the first site (null source, embedding)."""
        return tuple(s for s in self.sources if s.site is None)

    @property
    def final(self) -> Site | None:
        """The final routing site (None for the standard residual and the paper layout)."""
        return self.sites[-1] if self.sites and self.sites[-1].sublayer == "final" else None

    @property
    def n_nulls(self) -> int:
        """Number of null sources (0, 1, or 2L in the paper layout): rows of the null parameter."""
        return sum(s.kind == "null" for s in self.sources)

    def group_of(self, site: int) -> tuple[Group, int]:
        """(the group holding site `site`, the site's position in it)."""
        group = self.groups[site // self.group_size]
        return group, site - group.sites[0]

    def routing_rows(self, state_rows: int = STATE_ROWS) -> tuple[int, int]:
        """Rows of the storage dtype read per token by the routing of one step, (forward, backward),
        the null source not counted; the cost `routing_group_size="auto"` minimises.

        Per-call site over N sources: forward reads N; backward reads N, the upstream gradient
        and the saved output (N + 2). Grouped (a group of more than one site): phase 1 reads its
        `reads` once forward and once backward, plus each site's state gradient backward
        (`state_rows` each: fp32 against bf16 sources); each site's merge reads its state
        forward, its in-group sources, and backward also the upstream gradient and saved output.
        """
        forward = backward = 0
        for group in self.groups:
            if group.size == 1:
                n = self._rows(group.reads)
                forward, backward = forward + n, backward + n + 2
                continue
            n0 = self._rows(group.reads)
            forward += n0 + group.size * state_rows + sum(self._rows(late) for late in group.late)
            backward += n0 + group.size * state_rows + sum(self._rows(late) + 2 for late in group.late)
        return forward, backward

    def _rows(self, entries: tuple[int, ...]) -> int:
        """(B, T, d) rows among `entries` (the (d,) null source is not a row)."""
        return sum(self.sources[j].kind != "null" for j in entries)

    def layer_sites(self, layer: int) -> tuple[Site | None, Site | None]:
        """(attention site, MLP site) of `layer`; (None, None) for the standard residual."""
        if not self.sites:
            return None, None
        return self.sites[2 * layer], self.sites[2 * layer + 1]


def best_group_size(plan: RoutingPlan, state_rows: int = STATE_ROWS) -> int:
    """The group size g in 1..n_sites with the fewest routing rows read per step (forward +
    backward, `RoutingPlan.routing_rows`); the smallest such g on ties. Logs the choice once per
    plan shape (`routing_group_size="auto"`)."""
    if not plan.sites:
        return 1
    costs = {g: sum(replace(plan, group_size=g).routing_rows(state_rows)) for g in range(1, plan.n_sites + 1)}
    best = min(costs, key=lambda g: (costs[g], g))
    key = (plan.layout, plan.granularity, plan.mode, plan.null_source, plan.n_sites, len(plan.sources))
    if key not in _LOGGED:
        _LOGGED.add(key)
        log.info("routing_group_size='auto': g=%d for %d sites (%s, %s): %d routing rows read per token and step, "
                 "%d per call", best, plan.n_sites, plan.granularity, plan.mode, costs[best], costs[1])
    return best


_LOGGED: set = set()


def _groups(plan: RoutingPlan) -> tuple[Group, ...]:
    """Cut the sites into groups of `plan.group_size` (module docstring, "Groups")."""
    g = plan.group_size
    if not isinstance(g, int) or isinstance(g, bool) or g < 1:
        raise ValueError(f"group_size must be a positive integer, got {g!r}")
    groups, exists = [], len(plan.initial)
    for start in range(0, len(plan.sites), g):
        sites = plan.sites[start:start + g]
        early = tuple(tuple(j for j in site.reads if j < exists) for site in sites)
        late = tuple(tuple(j for j in site.reads if j >= exists) for site in sites)
        groups.append(Group(len(groups), tuple(s.index for s in sites), tuple(sorted(set().union(*early))),
                            early, late))
        exists += sum(len(site.creates) for site in sites)
    return tuple(groups)


def _clean(args) -> RoutingPlan:
    """The clean layout (module docstring table)."""
    L, by_block, delta = args.n_layers, args.routing_granularity == "block", args.routing_mode == "delta"
    sources: list[Source] = []
    if args.routing_null_source:
        sources.append(Source(0, "null"))
    sources.append(Source(len(sources), "embedding", embedding=True))
    completed = [s.index for s in sources]  # read by every later site
    open_partial: int | None = None  # latest partial sum of the open block (block granularity)
    sites, blocks, n_block, first_layer = [], [], 0, 0

    def close_block(stop_layer: int) -> None:
        nonlocal open_partial
        if open_partial is not None:
            completed.append(open_partial)
            blocks.append(Block(n_block, first_layer, stop_layer, open_partial))
            open_partial = None

    for index in range(2 * L):
        layer, sublayer = divmod(index, 2)
        opens = by_block and sublayer == 0 and layer % args.routing_block_layers == 0
        if opens:
            close_block(layer)
            n_block, first_layer = n_block + 1, layer
        reads = completed + ([open_partial] if open_partial is not None and not delta else [])
        if by_block:
            base = () if open_partial is None else ((1, open_partial),)
            new = _source(len(sources), "partial", index, (*base, (1, OUTPUT)), sources)
            open_partial = new.index
        else:
            new = _source(len(sources), "output", index, ((1, OUTPUT),), sources)
            completed.append(new.index)
        sources.append(new)
        sites.append(Site(index, layer, ("attention", "mlp")[sublayer], tuple(reads), (new,), delta, opens,
                          n_block if by_block else None))
    close_block(L)
    sites.append(Site(2 * L, None, "final", tuple(completed), (), delta))
    return RoutingPlan("clean", args.routing_granularity, args.routing_mode, args.routing_null_source,
                       stream=delta, sources=tuple(sources), sites=tuple(sites), blocks=tuple(blocks))


def _paper(args) -> RoutingPlan:
    """The paper layout (module docstring, points 1-4; point 5 is ModelArgs' check)."""
    if args.routing_mode != "delta" or not args.routing_null_source:
        raise ValueError(
            "routing_layout='paper' is the authors' delta bookkeeping: it needs routing_mode='delta' and "
            f"routing_null_source=true (got routing_mode={args.routing_mode!r}, "
            f"routing_null_source={args.routing_null_source})"
        )
    L, by_block, k = args.n_layers, args.routing_granularity == "block", args.routing_block_layers
    sources: list[Source] = [Source(i, "null") for i in range(2 * L)]
    embedding = len(sources)
    sources.append(Source(embedding, "embedding", embedding=True))
    visible: list[int] = []  # entries every later site reads after its own null
    pending = embedding  # the entry the next block boundary makes visible
    sites = []
    for index in range(2 * L):
        layer, sublayer = divmod(index, 2)
        opens = by_block and sublayer == 0 and layer % k == 0
        reads = (index, *visible)
        created: tuple[Source, ...] = ()
        if not by_block:
            created = (_source(len(sources), "output", index, ((1, OUTPUT),), sources),)
            visible += ([embedding] if index == 0 else []) + [created[0].index]
        elif opens:  # the entry for this boundary joins after this attention routing
            visible.append(pending)
        elif sublayer == 1 and (layer + 1) % k == 0 and layer + 1 < L:  # made before the next boundary
            created = (_source(len(sources), "block", index, ((1, STREAM), (-1, visible[-1])), sources),)
            pending = created[0].index
        sources.extend(created)
        sites.append(Site(index, layer, ("attention", "mlp")[sublayer], reads, created, True, opens,
                          layer // k + 1 if by_block else None))
    return RoutingPlan("paper", args.routing_granularity, "delta", True, stream=True, sources=tuple(sources),
                       sites=tuple(sites))


def _source(index: int, kind: str, site: int, recipe: tuple, earlier: list[Source]) -> Source:
    """A created entry with its value (embedding flag, sublayers) derived from its recipe.

    The stream after sublayer j holds the embedding and the outputs of sublayers 0..j.
    Raises ValueError when the value is not a plain sum (a coefficient other than 0 or 1).
    """
    value: Counter = Counter()
    for coefficient, operand in recipe:
        if operand == OUTPUT:
            terms = Counter([site])
        elif operand == STREAM:
            terms = Counter(["embedding", *range(site + 1)])
        else:
            entry = earlier[operand]
            terms = Counter((["embedding"] if entry.embedding else []) + list(entry.sublayers))
        for term, n in terms.items():
            value[term] += coefficient * n
    if any(n not in (0, 1) for n in value.values()):
        raise ValueError(f"source {index} recipe {recipe} is not a plain sum of the embedding and sublayer outputs")
    return Source(index, kind, site, recipe, value["embedding"] == 1,
                  tuple(sorted(t for t, n in value.items() if n == 1 and t != "embedding")))


def _check(plan: RoutingPlan) -> None:
    """Every index names an entry that exists when it is used (ValueError otherwise)."""
    for position, source in enumerate(plan.sources):
        if source.index != position or source.kind not in SOURCE_KINDS:
            raise ValueError(f"source {position} is {source}; indices must follow list order and kinds be "
                             f"one of {SOURCE_KINDS}")
    exists = len(plan.initial)
    for site in plan.sites:
        if not site.reads or max(site.reads) >= exists:
            raise ValueError(f"site {site.index} reads {site.reads} but only entries 0..{exists - 1} exist then")
        for source in site.creates:
            if source.index != exists or source.site != site.index:
                raise ValueError(f"site {site.index} creates {source}, expected entry {exists} made by this site")
            for coefficient, operand in source.recipe:
                if operand == STREAM and not plan.stream:
                    raise ValueError(f"source {source.index} reads the residual stream, which {plan.mode} mode "
                                     "does not keep")
                if operand not in (OUTPUT, STREAM) and not 0 <= operand < exists:
                    raise ValueError(f"source {source.index} recipe names entry {operand}, not created yet")
            if not source.recipe or source.recipe[0][0] != 1:
                raise ValueError(f"source {source.index} recipe {source.recipe} must start with a +1 term")
            exists += 1
    if exists != len(plan.sources):
        raise ValueError(f"{len(plan.sources) - exists} sources are created by no site")
