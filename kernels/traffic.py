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
    reduce             the host sums the (P, d) partials (P = programs of the backward launch)

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

    site: routing site index (None for the accumulation total); kind: "forward", "backward",
    "reduce" or "accumulate"; read / written: bytes."""

    site: Optional[int]
    kind: str
    read: int
    written: int

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
    reduce = Launch(site, "reduce", read=partial_sums, written=dim * FP32 * (2 + int(null_source)) + int(delta) * FP32)
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
