"""Bytes the routing kernels move: per launch, per step, and the floor.

A row is one (B*T, d) tensor in the storage dtype: tokens * d * element bytes. For a routing
site over N (B, T, d) sources (a (d,) null source, when present, is one more source of the
depth softmax but not a row: it is d values, cache-resident), the kernels of this package move:

    forward launch     reads N rows (+ partial in delta mode), q, g;
                       writes out (+ the mix in delta mode), logits (N', T, H) and lse (T, H) fp32,
                       and for bf16 / fp16 the mix residual (one row: what rounding the mix lost)
    backward launch    reads grad_out, the saved mix (+ its residual), N rows once, logits, lse, q, g, and the
                       gradient buffer of every source a later site already wrote (A rows);
                       writes N gradient rows and (P, d) fp32 partial sums of dq, dg (dnull)
    reduce             the host sums the (P, d) partials (P = programs of the backward launch) into
                       fp32 (d,) vectors and, for bf16 / fp16, casts each to the storage dtype

Sources shared between sites (`op.share_gradient`, as the models pass them) have one gradient
buffer: backward runs the sites in reverse, so a source's last reader writes it and every
earlier reader adds into it inside its backward launch (A counts those), and autograd adds
nothing. Without sharing, autograd would add the k gradients of a source read by k sites
(k - 1 additions of three rows each); `routing_traffic(..., shared=False)` counts that as one
"accumulate" entry.

The floor per site is N + 1 rows forward (read N sources, write the output) and 2N + 1 rows
backward (read N sources and the upstream gradient, write N gradients), as in docs/DESIGN.md.
The per-site sources come from the model's routing plan; this module takes plain ints (it
imports nothing of the models) and no GPU.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

FP32 = 4  # bytes of the logits, lse and partial sums
# Backward programs on one H200 (132 SMs x PROGRAMS_PER_SM in triton_routing): the default P.
H200_PROGRAMS = 264


@dataclass(frozen=True)
class Launch:
    """One kernel launch (or, for kind "accumulate", all autograd additions of a step without
    shared gradients).

    site: routing site index (None for the accumulation total; a group's first site for its
    phase 1); kind: "forward", "backward", "reduce" or "accumulate"; read / written: bytes;
    phase: "call", or grouped routing's "phase1" / "merge" (`grouped_traffic`)."""

    site: Optional[int]
    kind: str
    read: int
    written: int
    phase: str = "call"  # "call" (per-call site), or grouped routing's "phase1" / "merge"

    @property
    def bytes(self) -> int:
        return self.read + self.written


@dataclass(frozen=True)
class Traffic:
    """Routing traffic of one training step (forward + backward), in bytes."""

    launches: tuple[Launch, ...]
    floor: int
    row_bytes: int

    @property
    def total(self) -> int:
        return sum(launch.bytes for launch in self.launches)

    @property
    def ratio(self) -> float:
        """Counted traffic over the floor (1.0 = at the floor)."""
        return self.total / self.floor

    def by_kind(self) -> dict[str, int]:
        kinds: dict[str, int] = {}
        for launch in self.launches:
            kinds[launch.kind] = kinds.get(launch.kind, 0) + launch.bytes
        return kinds


def element_bytes(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits // 8


def storage_cast(vectors: int, dim: int, dtype: torch.dtype) -> tuple[int, int]:
    """(read, written) bytes of casting `vectors` fp32 (dim,) gradient sums to the storage dtype
    (nothing for fp32 / fp64 storage: no cast runs)."""
    el = element_bytes(dtype)
    return (vectors * dim * FP32, vectors * dim * el) if el < FP32 else (0, 0)


def site_launches(site: int, n_sources: int, *, dim: int, tokens: int, dtype: torch.dtype, heads: int,
                  delta: bool = False, null_source: bool = False, programs: int = H200_PROGRAMS,
                  recomputed: bool = False, accumulated: int = 0) -> list[Launch]:
    """The forward, backward and reduce launches of one routing site over `n_sources` (B, T, d)
    sources (the null source not counted in n_sources). recomputed: activation checkpointing
    runs the forward launch a second time in backward. accumulated: how many of the sources'
    shared gradient buffers a later site already wrote (read back and added to). Bytes as in the
    module docstring.

    Raises:
        ValueError: no source, or accumulated outside [0, n_sources]."""
    if n_sources < 1:
        raise ValueError(f"site {site}: a routing site reads at least one (B, T, d) source, got {n_sources}")
    if not 0 <= accumulated <= n_sources:
        raise ValueError(f"site {site}: accumulated={accumulated} must lie in [0, {n_sources}]")
    el = element_bytes(dtype)
    row = tokens * dim * el
    residual = int(el < FP32)  # bf16 / fp16: the saved mix's rounding residual, one row
    n_all = n_sources + int(null_source)
    params = 2 * dim * el + int(null_source) * dim * el  # q, g (and the null source)
    stats = tokens * heads * FP32 * (n_all + 1)  # logits + lse
    forward = Launch(site, "forward", read=n_sources * row + int(delta) * row + params,
                     written=(1 + int(delta) + residual) * row + stats)
    partial_sums = programs * dim * FP32 * (2 + int(null_source)) + int(delta) * programs * FP32
    backward = Launch(site, "backward", read=(n_sources + 2 + residual + accumulated) * row + stats + params,
                      written=n_sources * row + partial_sums)
    cast_read, cast_written = storage_cast(2 + int(null_source), dim, dtype)
    reduce = Launch(site, "reduce", read=partial_sums + cast_read,
                    written=dim * FP32 * (2 + int(null_source)) + int(delta) * FP32 + cast_written)
    return [forward, *([forward] if recomputed else []), backward, reduce]


def accumulated_reads(site_sources: Sequence[Sequence[int]]) -> list[int]:
    """Per site, how many of its sources' shared gradient buffers a later site already wrote.

    site_sources: for each routing site in forward order, the ids of the (B, T, d) sources it
    reads. Backward runs the sites in reverse, so each source's last reader writes its buffer
    and every earlier reader adds into it."""
    last_reader: dict[int, int] = {}
    for site, ids in enumerate(site_sources):
        for source in ids:
            last_reader[source] = site
    return [sum(last_reader[source] != site for source in ids) for site, ids in enumerate(site_sources)]


def routing_traffic(site_sources: Sequence[Sequence[int]], *, dim: int, tokens: int, dtype: torch.dtype,
                    heads: int, delta: bool = False, null_source: bool = False, programs: int = H200_PROGRAMS,
                    recomputed_sites: int = 0, shared: bool = True) -> Traffic:
    """Traffic of every routing launch of one step and the floor.

    Args:
        site_sources: for each routing site in order, the ids of the (B, T, d) sources it reads
            (null source excluded); sites reading the same id read the same tensor.
        dim, tokens, heads: d, B*T of the micro-batch, routing heads H.
        dtype: storage dtype of the sources.
        delta, null_source: delta routing (partial and mix rows), a (d,) null source.
        programs: backward programs P (partial sums are (P, d) fp32); 264 on one H200.
        recomputed_sites: the first this-many sites run their forward twice (activation
            checkpointing recomputes the blocks; the final routing is outside them).
        shared: the sources' gradients are shared buffers the kernels add into (the models'
            fused path); False counts separate gradients summed by autograd instead.

    Raises:
        ValueError: a site without sources.
    """
    el = element_bytes(dtype)
    row = tokens * dim * el
    counts = [len(ids) for ids in site_sources]
    accumulated = accumulated_reads(site_sources) if shared else [0] * len(counts)
    launches = []
    for site, n in enumerate(counts):
        launches += site_launches(site, n, dim=dim, tokens=tokens, dtype=dtype, heads=heads, delta=delta,
                                  null_source=null_source, programs=programs, recomputed=site < recomputed_sites,
                                  accumulated=accumulated[site])
    if not shared:
        additions = sum(counts) - len({source for ids in site_sources for source in ids})
        launches.append(Launch(None, "accumulate", read=2 * additions * row, written=additions * row))
    floor = sum((n + 1) + (2 * n + 1) for n in counts) * row
    return Traffic(tuple(launches), floor, row)


# ---------------------------------------------------------------------------- grouped routing
# Grouped routing (docs/DESIGN.md "Grouped routing"): a group of g > 1 sites runs one phase-1
# launch pair over its n start rows (triton_grouped) and, per site, a merge with its m in-group
# rows. Phase 1 reads and writes, per launch:
#
#     phase-1 forward    reads n rows, the g query and key-norm rows; writes g mixes (B*T, d)
#                        fp32 and lse (B*T, g, H) fp32
#     phase-1 backward   reads n rows, the g mix gradients (fp32) and normaliser gradients,
#                        lse, the g query and key-norm rows, and with one site chunk the shared
#                        gradient buffer of every source another reader already wrote (A rows);
#                        writes C gradient rows per source (C = site chunks of the backward
#                        launch) and (P, g, d) (+ null: (C P, d)) fp32 partial sums
#     reduce             the host sums the partials and, for C > 1, each source's C chunk
#                        gradients (reads C rows, writes one) and adds the A sums into their
#                        shared buffers (two rows read, one written each); casts the g query
#                        and key-norm gradient rows (+ null) to the storage dtype
#
# Sources are counted once per launch: the C forward chunk programs of one token tile are
# adjacent, so their repeated reads come from L2. The merge runs eagerly (`grouped_reference.py`);
# it is counted as one fused pass over what it receives and returns (a fused merge's bytes; the
# eager ops move more): forward reads m rows, the state (mix fp32, normaliser and lse), q, g and
# writes the output row; backward reads the upstream gradient, the saved output and m rows and
# writes the mix (fp32) and normaliser gradients, m gradient rows and dq, dg. Delta mode adds the
# partial row read and the mix row written, as per call. Per-token statistics the eager merge
# saves (in-group weights and inverse RMS) are not counted.


def phase1_launches(site: int, n_rows: int, sites: int, *, dim: int, tokens: int, dtype: torch.dtype, heads: int,
                    null_source: bool = False, programs: int = H200_PROGRAMS, chunks: int = 1,
                    recomputed: bool = False, accumulated: int = 0) -> list[Launch]:
    """The phase-1 forward, backward and reduce launches of a group of `sites` sites starting at
    site `site` over `n_rows` (B, T, d) start sources (the null source not counted); chunks: site
    chunks C of the backward launch; accumulated: how many of the sources' shared gradient
    buffers another reader already wrote (A). Bytes as in the comment above (`phase="phase1"`)."""
    if n_rows < 1 or sites < 2:
        raise ValueError(f"group at site {site}: phase 1 reads at least one (B, T, d) source for at least two "
                         f"sites, got {n_rows} sources and {sites} sites")
    el = element_bytes(dtype)
    row, state = tokens * dim * el, tokens * dim * FP32
    params = 2 * sites * dim * el + int(null_source) * dim * el
    lse = tokens * sites * heads * FP32
    forward = Launch(site, "forward", read=n_rows * row + params, written=sites * state + lse, phase="phase1")
    partial_sums = programs * sites * dim * FP32 + int(null_source) * chunks * programs * dim * FP32
    read_back = accumulated * row if chunks == 1 else 0  # added into in the kernel
    backward = Launch(site, "backward", read=n_rows * row + params + sites * state + 2 * lse + read_back,
                      written=chunks * n_rows * row + partial_sums, phase="phase1")
    summed = n_rows * row if chunks > 1 else 0  # the chunk gradients of each source, summed over C
    added = accumulated * row if chunks > 1 else 0  # ... then added into the shared buffers on the host
    cast_read, cast_written = storage_cast(2 * sites + int(null_source), dim, dtype)
    reduce = Launch(site, "reduce", read=partial_sums + chunks * summed + 2 * added + cast_read,
                    written=(sites + int(null_source)) * dim * FP32 + summed + added + cast_written, phase="phase1")
    return [forward, *([forward] if recomputed else []), backward, reduce]


def merge_launches(site: int, late_rows: int, *, dim: int, tokens: int, dtype: torch.dtype, heads: int,
                   delta: bool = False, recomputed: bool = False) -> list[Launch]:
    """The merge (phase 2) of one grouped site with `late_rows` in-group (B, T, d) sources,
    forward and backward, counted as one fused pass each (comment above; `phase="merge"`)."""
    el = element_bytes(dtype)
    row, state = tokens * dim * el, tokens * dim * FP32
    stats = tokens * heads * FP32  # one (B*T, H) fp32 tensor
    params = 2 * dim * el
    forward = Launch(site, "forward", read=(late_rows + int(delta)) * row + state + 2 * stats + params,
                     written=(1 + int(delta)) * row, phase="merge")
    backward = Launch(site, "backward", read=(late_rows + 2) * row + params,
                      written=late_rows * row + state + stats + 2 * dim * el, phase="merge")
    return [forward, *([forward] if recomputed else []), backward]


def grouped_traffic(groups: Sequence[tuple[Sequence[int], Sequence[Sequence[int]]]], *, dim: int, tokens: int,
                    dtype: torch.dtype, heads: int, delta: bool = False, null_source: bool = False,
                    programs: int = H200_PROGRAMS, backward_site_block: int = 0, recomputed_sites: int = 0,
                    shared: bool = True) -> Traffic:
    """Traffic of one step with grouped routing, and its floor.

    Args:
        groups: per group, in site order, (start, late): the ids of the (B, T, d) sources that
            exist when the group starts and that its sites read (phase 1), and per site the ids
            of the in-group sources it merges (len(late) = the group's sites). A group of one
            site is a per-call site over its start sources (`site_launches`).
        backward_site_block: sites per program of the phase-1 backward (0 = the whole group);
            a group of g sites then runs ceil(g / block) site chunks.
        recomputed_sites: sites below this index run their forward launches twice (a group's
            phase 1 when its first site is below it).
        shared: the per-call sites and phase 1 add into shared gradient buffers (as
            `routing_traffic`: the last reader writes, earlier ones add); the merges return their
            source gradients to autograd either way.
        dim, tokens, dtype, heads, delta, null_source, programs: as `routing_traffic`.

    Autograd adds the gradients a source gets from several launches: one per merge read, plus
    one for all per-call and phase-1 reads with shared buffers (one per read without); c
    contributions cost c - 1 additions of three rows ("accumulate"). The floor is what the
    routing must move at the least: per group, n + sum(m + 1) rows forward (read the n start
    sources once, write each site's output) and 2 n + sum(2 m + 1) backward; at one site per
    group it is `routing_traffic`'s floor.

    Raises:
        ValueError: a group without sites or start sources.
    """
    el = element_bytes(dtype)
    row = tokens * dim * el
    # per-call sites and phase-1 launches use the shared gradient buffers (in forward order)
    users = [list(start) for start, _ in groups]
    accumulated = iter(accumulated_reads(users) if shared else [0] * len(users))
    contributions: dict[int, int] = {}
    launches, site, floor_rows = [], 0, 0
    for start, late in groups:
        g, n = len(late), len(start)
        if g == 0 or n == 0:
            raise ValueError(f"group at site {site} needs sites and start sources, got {g} sites, {n} sources")
        if g == 1:
            launches += site_launches(site, n, dim=dim, tokens=tokens, dtype=dtype, heads=heads, delta=delta,
                                      null_source=null_source, programs=programs, recomputed=site < recomputed_sites,
                                      accumulated=next(accumulated))
        else:
            chunks = -(-g // backward_site_block) if backward_site_block else 1
            launches += phase1_launches(site, n, g, dim=dim, tokens=tokens, dtype=dtype, heads=heads,
                                        null_source=null_source, programs=programs, chunks=chunks,
                                        recomputed=site < recomputed_sites, accumulated=next(accumulated))
            for i, ids in enumerate(late):
                launches += merge_launches(site + i, len(ids), dim=dim, tokens=tokens, dtype=dtype, heads=heads,
                                           delta=delta, recomputed=site + i < recomputed_sites)
                for source in ids:  # merges return their gradients to autograd
                    contributions[source] = contributions.get(source, 0) + 1
        for source in start:  # shared: one contribution (the buffer) for all; else one per read
            if not shared or (source, "buffer") not in contributions:
                contributions[source] = contributions.get(source, 0) + 1
                contributions[source, "buffer"] = 1
        m = [len(ids) for ids in late] if g > 1 else [0]
        floor_rows += (n + sum(k + 1 for k in m)) + (2 * n + sum(2 * k + 1 for k in m))
        site += g
    additions = sum(c - 1 for key, c in contributions.items() if not isinstance(key, tuple))
    launches.append(Launch(None, "accumulate", read=2 * additions * row, written=additions * row))
    return Traffic(tuple(launches), floor_rows * row, row)
