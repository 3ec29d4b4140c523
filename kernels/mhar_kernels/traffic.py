"""Bytes the routing kernels move: per launch, per step, and the floor.

A row is one (B*T, d) tensor in the storage dtype: tokens * d * element bytes. For a routing
site over N (B, T, d) sources (a (d,) null source, when present, is one more source of the
depth softmax but not a row: it is d values, cache-resident), the kernels of this package move:

    forward launch     reads N rows (+ partial in delta mode), q, g;
                       writes out (+ the mix in delta mode), logits (N', T, H) and lse (T, H) fp32,
                       and for bf16 / fp16 the mix residual (one row: what rounding the mix lost)
    backward launch    reads grad_out, the saved mix (+ its residual), N rows once, logits, lse, q, g, and the
                       gradient row of every source a later site already wrote (A rows);
                       writes N gradient rows and (P, d) fp32 partial sums of dq, dg (dnull)
    reduce             the host sums the (P, d) partials (P = programs of the backward launch) into
                       fp32 (d,) vectors and, for bf16 / fp16, casts each to the storage dtype

The sources are rows of one depth buffer per micro-batch (`depth_buffer`, as the models run the
fused kernels): a source is copied into its slot once per forward (`DepthBuffer.write`: one row
read, one written; kind "write"; `writes` of them: the models compute a sublayer output that is
an entry as it is straight into its slot, `DepthBuffer.project`, and copy the others), and again
where activation checkpointing recomputes the block that copied it (`recomputed_writes`). The buffer has one gradient row per source: backward
runs the sites in reverse, so a source's last reader writes its row and every earlier reader adds
into it inside its backward launch (A counts those), and autograd adds nothing. Without the
buffer (separate source tensors), autograd would add the k gradients of a source read by k sites
(k - 1 additions of three rows each) and nothing would be copied into slots;
`routing_traffic(..., shared=False)` counts that as one "accumulate" entry.

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

    site: routing site index (None for the step's slot writes and the accumulation total; a
    group's first site for its phase 1); kind: "forward", "backward", "reduce", "write" (the
    step's copies of sources into their depth-buffer slots) or "accumulate"; read / written:
    bytes; phase: "call", or grouped routing's "phase1" / "merge" (`grouped_traffic`)."""

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
    gradient rows a later site already wrote (read back and added to). Bytes as in the
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


def slot_writes(writes: int, row: int) -> Launch:
    """The copies of `writes` (B, T, d) sources into their depth-buffer slots, `row` bytes each
    (`depth_buffer.DepthBuffer.write`: a row read, a row written), as one entry of kind "write"."""
    return Launch(None, "write", read=writes * row, written=writes * row)



def accumulated_reads(site_sources: Sequence[Sequence[int]]) -> list[int]:
    """Per site, how many of its sources' gradient rows a later site already wrote.

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
                    recomputed_sites: int = 0, writes: Optional[int] = None, recomputed_writes: int = 0,
                    shared: bool = True) -> Traffic:
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
        writes: sources copied into their slots per forward (None: every source, each once; the
            models compute a sublayer's output straight into its slot where the entry is that
            output as it is, and copy the others).
        recomputed_writes: slot copies that run a second time (the sources copied inside the
            recomputed part of a recomputed block).
        shared: the sources are rows of one depth buffer, copied into their slots (`writes` plus
            `recomputed_writes`), their gradient rows written or added into by the kernels (the
            models' fused path); False counts separate source tensors whose per-site gradients
            autograd sums instead (no slot writes).

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
    distinct = len({source for ids in site_sources for source in ids})
    if shared:
        launches.append(slot_writes((distinct if writes is None else writes) + recomputed_writes, row))
    else:
        additions = sum(counts) - distinct
        launches.append(Launch(None, "accumulate", read=2 * additions * row, written=additions * row))
    floor = sum((n + 1) + (2 * n + 1) for n in counts) * row
    return Traffic(tuple(launches), floor, row)


# ---------------------------------------------------------------------------- grouped routing
# Grouped routing (docs/DESIGN.md "Grouped routing"): a group of g > 1 sites runs one phase-1
# launch pair over its n start rows (triton_grouped) and, per site, a merge (triton_merge: the
# per-call kernels started from the site's phase-1 state) with its m in-group rows. Per group:
#
#     phase-1 forward    reads n rows, the g query and key-norm rows; writes g mixes (storage
#                        dtype rows) and lse (g, B*T, H) fp32, site-major (each site's state
#                        takes its lse as a view); the host makes g normalisers (B*T, H) fp32
#                        of ones
#     phase-1 backward   the host stacks the g normaliser gradients (g, B*T, H) and zeroes the
#                        (P, g, d) fp32 partial sums; the launch reads n rows, the g mix gradients
#                        (rows of one (g, B*T, d) tensor the merges write into,
#                        `triton_grouped.MixGradients`), the normaliser gradients, lse, the g query and key-norm rows and
#                        the gradient buffer of every source another reader already wrote (A
#                        rows; all n with C > 1 site chunks, whose chunk c > 0 adds into what
#                        chunk c - 1 of the same token tile stored) and, with C > 1, the partial
#                        sums it adds into; writes n gradient rows and the (P, g, d) (+ null
#                        (P, d)) partial sums
#     reduce             the host sums the partials over P, multiplies by the key-norm and query
#                        rows (cast to fp32) and casts dq, dg (+ dnull) to the storage dtype
#
#     merge forward      (m > 0 or delta) reads m rows, the state mix row, the state lse, q, g
#                        (+ partial); writes out, logits (m, B*T, H), lse (B*T, H) fp32, the
#                        mix residual (bf16 / fp16, m > 0) (+ the mix in delta mode). A site
#                        with m = 0 outside delta mode returns its state mix: no launch
#     merge backward     reads grad_out, the saved mix (+ residual), m rows, logits, lse, the
#                        state lse, q, g and the A rows a later reader wrote; writes m gradient
#                        rows, the state mix gradient (a row of the group's mix gradients; at
#                        m = 0 outside delta mode the host copies grad_out into that row
#                        instead: a row read, a row written), the state normaliser gradient
#                        (B*T, H) fp32 and (P, d) partial sums of dq, dg (+ dalpha); reduce as
#                        per call
#
# Every reader (per-call site, phase 1, merge) reads its sources as rows of the depth buffer and
# adds into their gradient rows, so autograd adds no source gradient; each source is copied into
# its slot once (plus the recomputed writes), as per call. Sources are counted once per launch: repeated reads
# within a launch (the forward's C chunk programs of one token tile, adjacent in launch order;
# the backward's chunks of one tile in one program) are counted as cache hits.


def phase1_launches(site: int, n_rows: int, sites: int, *, dim: int, tokens: int, dtype: torch.dtype, heads: int,
                    null_source: bool = False, programs: int = H200_PROGRAMS, chunks: int = 1,
                    recomputed: bool = False, accumulated: int = 0) -> list[Launch]:
    """The phase-1 forward, backward and reduce of a group of `sites` sites starting at site `site` over `n_rows` (B, T, d) start sources (the null
    source not counted); chunks: site chunks C of the backward launch; accumulated: how many of
    the sources' gradient rows another reader already wrote (A). Bytes as in the comment above
    (`phase="phase1"`)."""
    if n_rows < 1 or sites < 2:
        raise ValueError(f"group at site {site}: phase 1 reads at least one (B, T, d) source for at least two "
                         f"sites, got {n_rows} sources and {sites} sites")
    el = element_bytes(dtype)
    row = tokens * dim * el
    params = 2 * sites * dim * el + int(null_source) * dim * el
    stats = tokens * sites * heads * FP32  # lse (g, B*T, H), or the g normalisers
    forward = Launch(site, "forward", read=n_rows * row + params,
                     written=sites * row + 2 * stats, phase="phase1")  # mixes, lse, ones
    t_sums = programs * sites * dim * FP32
    partial_sums = t_sums + int(null_source) * programs * dim * FP32
    read_back = (n_rows if chunks > 1 else accumulated) * row
    chunked = t_sums if chunks > 1 else 0  # the partial sums the chunks add into
    backward = Launch(site, "backward",
                      read=(n_rows + sites) * row + read_back + params + 3 * stats + chunked,  # + the stack's read
                      written=n_rows * row + partial_sums + stats + t_sums,  # + the stack, the zeroed sums
                      phase="phase1")
    cast_read, cast_written = storage_cast(2 * sites + int(null_source), dim, dtype)
    vec = sites * dim
    to_fp32 = (vec * el, vec * FP32) if el < FP32 else (0, 0)  # a query / key-norm block cast to fp32
    reduce = Launch(site, "reduce",
                    read=partial_sums + 2 * (to_fp32[0] + 2 * vec * FP32) + cast_read,  # sums, T * rows
                    written=(vec + int(null_source) * dim) * FP32 + 2 * (to_fp32[1] + vec * FP32) + cast_written,
                    phase="phase1")
    return [forward, *([forward] if recomputed else []), backward, reduce]


def merge_launches(site: int, late_rows: int, *, dim: int, tokens: int, dtype: torch.dtype, heads: int,
                   delta: bool = False, programs: int = H200_PROGRAMS, recomputed: bool = False,
                   accumulated: int = 0) -> list[Launch]:
    """The fused merge (phase 2) of one grouped site with `late_rows` in-group (B, T, d) sources:
    forward, backward and reduce (comment above; `phase="merge"`). accumulated: how many of them
    have a gradient row another reader already wrote (A)."""
    if not 0 <= accumulated <= late_rows:
        raise ValueError(f"site {site}: accumulated={accumulated} must lie in [0, {late_rows}]")
    el = element_bytes(dtype)
    row = tokens * dim * el
    residual = int(el < FP32 and late_rows > 0)
    stat = tokens * heads * FP32  # one (B*T, H) fp32 tensor
    params = 2 * dim * el
    launches = []
    if late_rows or delta:
        forward = Launch(site, "forward", read=(late_rows + 1 + int(delta)) * row + stat + params,
                         written=(1 + int(delta) + residual) * row + (late_rows + 1) * stat, phase="merge")
        launches += [forward, *([forward] if recomputed else [])]
    partial_sums = 2 * programs * dim * FP32 + int(delta) * programs * FP32
    state_grad = int(late_rows > 0 or delta)
    copied = 1 - state_grad  # m = 0 outside delta mode: grad_out copied into the group's row
    stats_read = (late_rows + 2 if late_rows or delta else 1) * stat  # logits, lse, state lse (one tensor at m = 0)
    launches.append(Launch(site, "backward",
                           read=(late_rows + 2 + residual + accumulated + copied) * row + stats_read + params,
                           written=(late_rows + state_grad + copied) * row + stat + partial_sums, phase="merge"))
    cast_read, cast_written = storage_cast(2, dim, dtype)
    launches.append(Launch(site, "reduce", read=partial_sums + cast_read,
                           written=2 * dim * FP32 + int(delta) * FP32 + cast_written, phase="merge"))
    return launches


def grouped_traffic(groups: Sequence[tuple[Sequence[int], Sequence[Sequence[int]]]], *, dim: int, tokens: int,
                    dtype: torch.dtype, heads: int, delta: bool = False, null_source: bool = False,
                    programs: int = H200_PROGRAMS, backward_site_block: int = 0, recomputed_sites: int = 0,
                    writes: Optional[int] = None, recomputed_writes: int = 0, shared: bool = True) -> Traffic:
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
        writes, recomputed_writes: slot copies per forward and those run a second time, as
            `routing_traffic`'s.
        shared: the sources are rows of one depth buffer (as `routing_traffic`: each copied into
            its slot, every reader (per-call site, phase 1, merge) writing or adding into their
            gradient rows, the last reader writes, earlier ones add); False counts separate
            source tensors whose gradients autograd adds (c - 1 additions of three rows for c
            readers, "accumulate"; no slot writes).
        dim, tokens, dtype, heads, delta, null_source, programs: as `routing_traffic`.

    The floor is what the routing must move at the least: per group, n + sum(m + 1) rows
    forward (read the n start sources once, write each site's output) and 2 n + sum(2 m + 1)
    backward; at one site per group it is `routing_traffic`'s floor.

    Raises:
        ValueError: a group without sites or start sources.
    """
    el = element_bytes(dtype)
    row = tokens * dim * el
    readers = []  # every reader's source ids, in forward order
    for start, late in groups:
        readers.append(list(start))
        if len(late) > 1:
            readers += [list(ids) for ids in late]
    accumulated = iter(accumulated_reads(readers) if shared else [0] * len(readers))
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
                                           delta=delta, programs=programs, recomputed=site + i < recomputed_sites,
                                           accumulated=next(accumulated))
        m = [len(ids) for ids in late] if g > 1 else [0]
        floor_rows += (n + sum(k + 1 for k in m)) + (2 * n + sum(2 * k + 1 for k in m))
        site += g
    reads = [j for ids in readers for j in ids]
    if shared:
        launches.append(slot_writes((len(set(reads)) if writes is None else writes) + recomputed_writes, row))
    else:
        additions = len(reads) - len(set(reads))
        launches.append(Launch(None, "accumulate", read=2 * additions * row, written=additions * row))
    return Traffic(tuple(launches), floor_rows * row, row)
