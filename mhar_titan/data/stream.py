"""A resumable stream of packed token windows for one consumer.

Per epoch ``e``: the shard order is shuffled with ``seed`` and ``e``; the consumer
takes its *parts* of that order (``assign_parts``); rows are read in order,
cleaned (empty and invalid-UTF-8 documents are skipped and counted), passed
through a shuffle buffer, tokenized, and packed: every document is followed by
exactly one ``eos_id`` and the token sequence is cut into non-overlapping
windows of ``window_len = seq_len + 1`` tokens (inputs ``w[:-1]``, labels ``w[1:]``).

The whole position is in ``state_dict()``: epoch, part, row, the shuffle buffer
and its RNG state, the partial token buffer and counters, so a restored stream
continues with exactly the same windows. In infinite mode a new epoch (new
shard order and buffer seed, logged) continues the same token buffer; otherwise
the stream ends and the last partial window is dropped (at most ``window_len - 1``
tokens).
"""
import logging
import random
from typing import Callable, Optional

import numpy as np

from mhar_titan.data.sources import DataError

logger = logging.getLogger(__name__)

Part = tuple[int, int, int]  # (shard index, stride, offset): the rows j with j % stride == offset


def split_parts(parts: list[Part], n: int, i: int) -> list[Part]:
    """Consumer ``i`` of ``n``'s share of ``parts``; the ``n`` shares are disjoint and cover all rows.

    Whole parts go round-robin while every consumer can get one; each of the
    ``len(parts) % n`` remaining parts is split by row striding (all consumers read
    it, each keeps every n-th of its rows), so no row is dropped or duplicated when
    the number of shards is not divisible by ``n``.
    """
    full = len(parts) // n * n
    mine = [p for k, p in enumerate(parts[:full]) if k % n == i]
    mine += [(shard, stride * n, offset + i * stride) for shard, stride, offset in parts[full:]]
    return mine


def epoch_shard_order(n_shards: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    order = list(range(n_shards))
    if shuffle:
        random.Random(f"{seed}/shards/{epoch}").shuffle(order)
    return order


def epoch_parts(n_shards: int, seed: int, epoch: int, shuffle: bool, consumer: list[tuple[int, int]]) -> list[Part]:
    """The parts of epoch ``epoch``'s shard order that ``consumer`` (see ``TokenStream``) reads, in order."""
    parts = [(s, 1, 0) for s in epoch_shard_order(n_shards, seed, epoch, shuffle)]
    for n, i in consumer:
        parts = split_parts(parts, n, i)
    return parts


def clean_document(value, shard_name: str, row: int, counts: dict, warn: bool = True) -> Optional[object]:
    """A row's document (str or token array), or None if it is empty or not valid UTF-8 (counted, warned)."""
    kind = None
    if value is None or (isinstance(value, (str, bytes, np.ndarray)) and len(value) == 0):
        kind = "empty"
    elif isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            kind = "invalid_utf8"
    elif isinstance(value, (str, np.ndarray)):
        return value
    else:
        raise DataError(f"{shard_name} row {row}: the text field holds a {type(value).__name__}, not text; "
                        f"check data.text_field")
    counts[kind] = counts.get(kind, 0) + 1
    n = counts[kind]
    if warn and n & (n - 1) == 0:  # warn at 1, 2, 4, 8, ... occurrences
        logger.warning("data: skipped %s document (%s row %d); %d %s document(s) skipped so far",
                       kind.replace("_", " "), shard_name, row, n, kind)
    return None


class TokenStream:
    """Packed windows of ``window_len`` tokens from the parts of ``shards`` that one consumer owns.

    Args:
        shards: the shards in canonical order (see ``sources``).
        encode: text -> token ids (ordinary encoding, no special tokens).
        eos_id: id appended after every document.
        window_len: tokens per window (seq_len + 1).
        seed, shuffle, shuffle_buffer, infinite: see ``DataConfig``.
        consumer: ``[(n, i), ...]`` splits applied to the epoch's shard order, e.g.
            ``[(dp_world, dp_rank), (num_workers, worker_id)]``; ``[]`` = the whole stream.
    """

    def __init__(self, shards: list, encode: Callable[[str], list[int]], eos_id: int, window_len: int, *,
                 seed: int, shuffle: bool, shuffle_buffer: int, infinite: bool,
                 consumer: list[tuple[int, int]], start_epoch: int = 0):
        self.shards, self.encode, self.eos_id, self.window_len = shards, encode, eos_id, window_len
        self.seed, self.shuffle, self.buffer_size, self.infinite = seed, shuffle, shuffle_buffer, infinite
        self.consumer = consumer
        self.label = "/".join(f"{i}of{n}" for n, i in consumer) or "global"
        self.tokens: list[int] = []   # pending tokens not yet emitted in a window
        self.window = 0               # windows emitted so far (absolute)
        self.docs = 0                 # documents packed so far
        self.skipped: dict = {}       # "empty" / "invalid_utf8" -> count
        self.exhausted = False
        self._start_epoch(start_epoch)

    # -- epochs and parts ------------------------------------------------------
    def _start_epoch(self, epoch: int) -> None:
        self.epoch, self.part, self.row = epoch, 0, 0
        self.buffer: list = []
        self.rng = random.Random(f"{self.seed}/buffer/{epoch}/{self.label}")
        self._epoch_docs = 0
        self._parts = self._parts_of(epoch)
        self._rows = None
        if epoch > 0:
            logger.info("data: stream %s starts epoch %d (shard order and shuffle seeded by seed=%d, epoch=%d)",
                        self.label, epoch, self.seed, epoch)

    def _parts_of(self, epoch: int) -> list[Part]:
        return epoch_parts(len(self.shards), self.seed, epoch, self.shuffle, self.consumer)

    # -- documents -------------------------------------------------------------
    def _read_doc(self):
        while self.part < len(self._parts):
            shard, stride, offset = self._parts[self.part]
            if self._rows is None:
                self._rows = self.shards[shard].rows(self.row)
            for value in self._rows:
                row = self.row
                self.row += 1
                if row % stride != offset:
                    continue
                doc = clean_document(value, self.shards[shard].name, row, self.skipped)
                if doc is not None:
                    return doc
            self._rows, self.part, self.row = None, self.part + 1, 0
        return None

    def _next_doc(self):
        if self.buffer_size <= 1 or not self.shuffle:
            return self._read_doc()
        while len(self.buffer) < self.buffer_size:
            doc = self._read_doc()
            if doc is None:
                break
            self.buffer.append(doc)
        if not self.buffer:
            return None
        i = self.rng.randrange(len(self.buffer))
        self.buffer[i], self.buffer[-1] = self.buffer[-1], self.buffer[i]
        return self.buffer.pop()

    # -- windows ---------------------------------------------------------------
    def _fill(self, n_tokens: int) -> bool:
        """Pack documents until ``n_tokens`` are pending; False at the end of a finite stream."""
        while len(self.tokens) < n_tokens:
            doc = self._next_doc()
            if doc is None:
                if self._epoch_docs == 0:
                    raise DataError(f"data stream {self.label} got no documents in epoch {self.epoch}: "
                                    f"{len(self.shards)} shard(s) give this rank/worker nothing (too few shards or "
                                    f"rows for the number of ranks x workers, or all documents empty)")
                if not self.infinite:
                    self.exhausted = True
                    return False
                self._start_epoch(self.epoch + 1)
                continue
            ids = self.encode(doc) if isinstance(doc, str) else doc.tolist()
            self.tokens.extend(ids)
            self.tokens.append(self.eos_id)
            self.docs += 1
            self._epoch_docs += 1
        return True

    def next_window(self) -> Optional[list[int]]:
        """The next ``window_len`` tokens, or None when a finite stream has no full window left."""
        if self.exhausted or not self._fill(self.window_len):
            return None
        w = self.tokens[:self.window_len]
        del self.tokens[:self.window_len]
        self.window += 1
        return w

    def skip_windows(self, n: int) -> bool:
        """Advance ``n`` windows without returning them; False if a finite stream ends first."""
        for _ in range(n):
            if self.next_window() is None:
                return False
        return True

    # -- state -----------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "part": self.part, "row": self.row, "buffer": list(self.buffer),
                "rng": self.rng.getstate(), "tokens": list(self.tokens), "window": self.window,
                "docs": self.docs, "epoch_docs": self._epoch_docs, "skipped": dict(self.skipped),
                "exhausted": self.exhausted}

    def load_state_dict(self, sd: dict) -> None:
        self._start_epoch(sd["epoch"])
        self.part, self.row, self.buffer = sd["part"], sd["row"], list(sd["buffer"])
        self.rng.setstate(_as_rng_state(sd["rng"]))
        self.tokens, self.window, self.docs = list(sd["tokens"]), sd["window"], sd["docs"]
        self._epoch_docs, self.skipped, self.exhausted = sd["epoch_docs"], dict(sd["skipped"]), sd["exhausted"]


def _as_rng_state(state):
    """random.Random state from a saved copy (lists after a round trip through some serialisers)."""
    version, internal, gauss = state
    return version, tuple(internal), gauss
