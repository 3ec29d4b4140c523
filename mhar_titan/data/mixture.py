"""Data mixtures: which source each training window comes from, and the mixed stream.

A mixture of sources ``0..n-1`` with weights ``w_i`` (normalised to sum 1) draws every window
(``seq_len + 1`` tokens) from one source. Window ``k`` of a stream (its ``k``-th window, counted
from the start of the run) comes from the source whose interval of ``[0, 1)`` holds

    x_k = frac(u + k * g),   g = (sqrt(5) - 1) / 2 (the golden-ratio rotation),

where source ``i`` owns ``[c_{i-1}, c_i)`` with ``c_i = w_0 + ... + w_i``, and ``u`` is a uniform
offset drawn from the seed and the stream's label (``"global"`` in window sharding, the
(rank, worker) label in document sharding). This is the Kronecker low-discrepancy sequence, the
deterministic counterpart of drawing each window's source at random with probabilities
``w_i``: every run of ``N`` consecutive windows holds ``N w_i + O(log N)`` windows of source
``i``. Measured (2026-12-01, weights 0.5 / 0.3 / 0.2, 400 (seed, label) pairs): over 2,000
windows every source is within 2 windows (0.1 percentage points) of its share, and every
prefix of them within 3, where independent draws stray by ``sqrt(N w_i (1 - w_i))`` (22
windows, 1.1 points, for w = 0.5) and miss 2 points one time in eight. All
arithmetic is on 64-bit integers (``x_k 2^64 = (U + k G) mod 2^64``), so the choice is a pure
function of (seed, label, weights, k), the same on every machine, and needs no state.

Each source is its own ``TokenStream`` (its shard order, shuffle buffer and token buffer, all
from the same seed), read only when one of its windows is drawn; its position is its own.
``MixtureStream`` has the ``TokenStream`` interface (``next_window``, ``skip_windows``,
``window``, ``state_dict``), so the loader shards, skips and resumes it as it does one source:
its state holds every source's stream state, so a resume continues each source where it
stopped. A mixture of one source draws every window from it: its windows are the source's
``TokenStream``'s, bitwise. A resume with other weights (``data.allow_weight_change``) keeps
the window counter ``k`` and every source's position; the new weights choose from there on.
A finite mixture (``data.infinite = false``) ends when a window is drawn from a source that
has run out.
"""
from __future__ import annotations

import hashlib
import math
from typing import Optional

import numpy as np

from mhar_titan.data.stream import TokenStream, stream_label

GOLDEN = 0x9E3779B97F4A7C15
"""round(2^64 (sqrt(5) - 1) / 2), odd: the rotation step of the window sequence (in 2^-64 units)."""
MASK = (1 << 64) - 1
MIXTURE_FORMAT = 1
FINITE_DOCUMENT_MIXTURE = (
    "a finite data mixture (data.infinite = false) in data.sharding = 'document' on several ranks is not "
    "supported (ranks would run out of different sources at different steps): set data.infinite = true, or "
    "data.sharding = 'window'")
NO_VALIDATION_SOURCE = ("no source of data.sources has validation_files: designate held-out files in at least one "
                        "source, or set validation.enable = false")


def mixture_offset(seed: int, label: str) -> int:
    """The sequence's offset ``u * 2^64`` for ``seed`` and a stream ``label`` (BLAKE2b of both)."""
    digest = hashlib.blake2b(f"{seed}/mixture/{label}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def thresholds(weights: list[float]) -> list[int]:
    """The upper ends ``c_i 2^64`` of sources ``0..n-2``' intervals (source n-1 takes the rest).

    ``weights``: finite, >= 0, summing to a finite number > 0 (normalised here). A zero weight
    gives an empty interval: that source is never drawn. The job config refuses other weights
    (``DataConfig.normalised_weights``); this guard names them for a caller from Python.

    Raises:
        ValueError: a weight that is negative or not finite, or a sum that is 0 or overflows.
    """
    total = float(sum(weights))
    if not all(math.isfinite(w) and w >= 0 for w in weights) or not (math.isfinite(total) and total > 0):
        raise ValueError(f"mixture weights {list(weights)} must be finite numbers >= 0 whose sum is finite and > 0 "
                         f"(sum {total:g}); scale them, e.g. to shares that sum to 1")
    out, acc = [], 0.0
    for w in weights[:-1]:
        acc += float(w) / total
        out.append(min(MASK, max(0, int(round(acc * 2.0 ** 64)))))
    return out


def window_sources(seed: int, label: str, weights: list[float], start: int, stop: int) -> np.ndarray:
    """The source index of windows ``start .. stop - 1`` of the stream ``label``: int64 ``(stop - start,)``."""
    if stop <= start:
        return np.zeros(0, dtype=np.int64)
    k = np.arange(start, stop, dtype=np.uint64)
    with np.errstate(over="ignore"):
        x = np.uint64(mixture_offset(seed, label)) + k * np.uint64(GOLDEN)  # wraps mod 2^64
    return np.searchsorted(np.asarray(thresholds(weights), dtype=np.uint64), x, side="right").astype(np.int64)


def source_counts(seed: int, label: str, weights: list[float], start: int, stop: int,
                  chunk: int = 1 << 20) -> np.ndarray:
    """Windows drawn from each source among windows ``start .. stop - 1``: int64 ``(n_sources,)``."""
    counts = np.zeros(len(weights), dtype=np.int64)
    for lo in range(start, stop, chunk):
        counts += np.bincount(window_sources(seed, label, weights, lo, min(stop, lo + chunk)),
                              minlength=len(weights))
    return counts


def planned_source_windows(weights: list[float], *, seed: int, sharding: str, dp_world: int, num_workers: int,
                           local_batch_size: int, batches: int) -> np.ndarray:
    """Windows each source gives a run of ``batches`` loader batches per rank from the start
    (infinite data): int64 ``(n_sources,)``, all ranks together; times ``seq_len`` = its tokens.

    Window sharding: the global stream's first ``batches * dp_world * local_batch_size``
    windows. Document sharding: each (rank, worker) stream's own windows, worker ``w`` of ``W``
    yielding its rank's batches ``w, w + W, ...`` of ``local_batch_size`` windows each.
    """
    if sharding == "window":
        return source_counts(seed, "global", weights, 0, batches * dp_world * local_batch_size)
    workers = max(1, num_workers)
    total = np.zeros(len(weights), dtype=np.int64)
    for rank in range(dp_world):
        for worker in range(workers):
            own = len(range(worker, batches, workers))  # batches this worker yields
            label = stream_label([(dp_world, rank), (workers, worker)])
            total += source_counts(seed, label, weights, 0, own * local_batch_size)
    return total


class MixtureStream:
    """Packed windows drawn from several ``TokenStream``s by weight (module docstring).

    Args:
        streams: one ``TokenStream`` per source, in the mixture's order (same consumer label).
        names: the sources' names (keys of the state).
        weights: their weights (>= 0, finite, sum > 0).
        seed: the data seed (the same one the streams use).
    """

    def __init__(self, streams: list[TokenStream], names: list[str], weights: list[float], *, seed: int):
        self.streams, self.names, self.weights, self.seed = streams, list(names), list(weights), seed
        self.label = streams[0].label
        self._upper = thresholds(self.weights)
        self._offset = mixture_offset(seed, self.label)
        self.window = 0          # windows drawn so far (absolute: k of the next window)
        self.exhausted = False
        self.last_source: Optional[int] = None  # source of the window next_window returned last

    def source_of(self, k: int) -> int:
        """The source index of window ``k``."""
        x = (self._offset + k * GOLDEN) & MASK
        return sum(1 for t in self._upper if t <= x)

    @property
    def epoch(self) -> int:
        """The highest epoch any source has reached."""
        return max(s.epoch for s in self.streams)

    def next_window(self) -> Optional[list[int]]:
        """The next window (from the source ``source_of(window)``), or None when a finite source ran out."""
        if self.exhausted:
            return None
        i = self.source_of(self.window)
        w = self.streams[i].next_window()
        if w is None:
            self.exhausted = True
            return None
        self.window += 1
        self.last_source = i
        return w

    def skip_windows(self, n: int) -> bool:
        """Advance ``n`` windows: each source skips the windows drawn from it. False if a finite source runs out."""
        if n <= 0:
            return True
        counts = source_counts(self.seed, self.label, self.weights, self.window, self.window + n)
        for stream, c in zip(self.streams, counts):
            if c and not stream.skip_windows(int(c)):
                self.exhausted = True
                return False
        self.window += n
        return True

    def source_windows(self) -> dict[str, int]:
        """Windows each source has given this stream (its position in windows)."""
        return {name: s.window for name, s in zip(self.names, self.streams)}

    def state_dict(self) -> dict:
        """The position: the window counter, the weights it was drawn with and every source's
        ``TokenStream`` state under its name. ``epoch`` is the highest source epoch (what the
        loader reports), ``epochs`` each source's."""
        return {"mixture": MIXTURE_FORMAT, "window": self.window, "exhausted": self.exhausted,
                "weights": dict(zip(self.names, self.weights)), "epoch": self.epoch,
                "epochs": {name: s.epoch for name, s in zip(self.names, self.streams)},
                "streams": {name: s.state_dict() for name, s in zip(self.names, self.streams)}}

    def load_state_dict(self, sd: dict) -> None:
        """Continue from ``sd``; the weights stay this stream's (the train loader decides whether
        other saved weights may continue). Raises KeyError naming a source the state lacks."""
        missing = [n for n in self.names if n not in sd["streams"]]
        if missing:
            raise KeyError(f"the saved mixture state has no source {missing[0]!r} (it has {sorted(sd['streams'])})")
        for name, stream in zip(self.names, self.streams):
            stream.load_state_dict(sd["streams"][name])
        self.window, self.exhausted = sd["window"], sd["exhausted"]
