"""A resumable stream of packed token windows for one consumer.

Per epoch ``e``: the shard order is shuffled with ``seed`` and ``e``; the consumer
takes its *parts* of that order (``assign_parts``); rows are read in order,
cleaned (empty and invalid-UTF-8 documents are skipped and counted), passed
through a shuffle buffer, tokenized, and packed: every document is followed by
exactly one ``eos_id`` and the token sequence is cut into non-overlapping
windows of ``window_len = seq_len + 1`` tokens (inputs ``w[:-1]``, labels ``w[1:]``).

The whole position is in ``state_dict()``: epoch, part, row, the shuffle buffer
and its RNG state, the pending tokens and counters, so a restored stream
continues with exactly the same windows. In infinite mode a new epoch (new
shard order and buffer seed, logged) continues the same token buffer; otherwise
the stream ends and the last partial window is dropped (at most ``window_len - 1``
tokens).

Cost per window and per state snapshot is independent of document length. The
pending tokens are kept per document (one immutable int32 ``bytes`` block each,
plus a read offset into the first), so cutting a window copies only
``window_len`` tokens, whatever the document's size. The state keeps every
pending document and every shuffle-buffer document as its own entry of a dict
keyed by a sequence number: ``StatefulDataLoader`` workers send the state after
every batch as a *delta* of its leaves (compared with ``==``, which is O(1) for
the same ``bytes``/``str`` object), so each document crosses from a worker to the
main process once, not once per batch while it is being packed.
"""
import logging
import random
import re
from typing import Callable, Optional

import numpy as np

from mhar_titan.data.sources import DataError

logger = logging.getLogger(__name__)

Part = tuple[int, int, int]  # (shard index, stride, offset): the rows j with j % stride == offset

TEXT_CHUNK_CHARS = 1 << 16
"""Text documents longer than this are tokenized in chunks of about this many characters."""

# A space between a non-space character and a letter: the gpt2, cl100k_base and o200k_base
# pre-tokenizers all end a piece before such a space (it starts the next word's piece), and BPE
# never merges across pieces, so encoding text cut there equals encoding it whole.
_CHUNK_CUT = re.compile(r"(?<=\S) (?=[^\W\d_])")


def chunk_end(text: str, start: int, size: int = TEXT_CHUNK_CHARS) -> int:
    """End of the chunk of ``text`` that starts at ``start``: the first cut point at least ``size``
    characters on, or ``len(text)`` when there is none."""
    m = _CHUNK_CUT.search(text, start + size)
    return m.start() if m else len(text)


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


def stream_label(consumer: list[tuple[int, int]]) -> str:
    """A stream's label from its consumer splits: "global", or e.g. "1of2/0of1" for rank 1 of 2,
    worker 0 of 1 (in log lines and the seeds of its shuffle buffer and mixture draws)."""
    return "/".join(f"{i}of{n}" for n, i in consumer) or "global"


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
        source: the data-mixture source this stream reads ("" for one source): named in its
            log lines and errors only (the seeds do not depend on it).
    """

    def __init__(self, shards: list, encode: Callable[[str], list[int]], eos_id: int, window_len: int, *,
                 seed: int, shuffle: bool, shuffle_buffer: int, infinite: bool,
                 consumer: list[tuple[int, int]], start_epoch: int = 0, source: str = ""):
        self.shards, self.encode, self.eos_id, self.window_len = shards, encode, eos_id, window_len
        self.seed, self.shuffle, self.buffer_size, self.infinite = seed, shuffle, shuffle_buffer, infinite
        self.consumer = consumer
        self.label = stream_label(consumer)
        self.what = f"{self.label} of source {source!r}" if source else self.label  # in log lines and errors
        self._pending: dict[int, bytes] = {}  # document sequence number -> its int32 tokens + EOS
        self._views: dict[int, np.ndarray] = {}  # the same blocks as arrays (not in the state)
        self._head = 0                # tokens of the first pending block already emitted
        self._n_pending = 0           # pending tokens not yet emitted in a window
        self._seq = 0                 # sequence numbers handed out (pending blocks and buffered docs)
        self._text: dict[int, str] = {}  # a long text document being tokenized chunk by chunk (0 or 1)
        self._text_pos = 0               # its characters already tokenized
        self.window = 0               # windows emitted so far (absolute)
        self.docs = 0                 # documents packed so far
        self.skipped: dict = {}       # "empty" / "invalid_utf8" -> count
        self.exhausted = False
        self._start_epoch(start_epoch)

    # -- epochs and parts ------------------------------------------------------
    def _start_epoch(self, epoch: int) -> None:
        self.epoch, self.part, self.row = epoch, 0, 0
        self._buffer: dict[int, object] = {}  # shuffle buffer: sequence number -> document
        self._order: list[int] = []           # its slots, in the order the shuffle indexes them
        self.rng = random.Random(f"{self.seed}/buffer/{epoch}/{self.label}")
        self._epoch_docs = 0
        self._parts = self._parts_of(epoch)
        self._rows = None
        if epoch > 0:
            logger.info("data: stream %s starts epoch %d (shard order and shuffle seeded by seed=%d, epoch=%d)",
                        self.what, epoch, self.seed, epoch)

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
        while len(self._order) < self.buffer_size:
            doc = self._read_doc()
            if doc is None:
                break
            self._seq += 1
            self._buffer[self._seq] = doc
            self._order.append(self._seq)
        if not self._order:
            return None
        i = self.rng.randrange(len(self._order))  # swap the chosen slot to the end and pop it
        self._order[i], self._order[-1] = self._order[-1], self._order[i]
        return self._buffer.pop(self._order.pop())

    # -- windows ---------------------------------------------------------------
    def _fill(self, n_tokens: int) -> bool:
        """Pack documents until ``n_tokens`` are pending; False at the end of a finite stream."""
        while self._n_pending < n_tokens:
            if self._text:
                self._tokenize_chunk()
                continue
            doc = self._next_doc()
            if doc is None:
                if self._epoch_docs == 0:
                    names = ", ".join(self.shards[s].name for s, _, _ in self._parts[:3]) or "none"
                    raise DataError(f"data stream {self.what} got no documents in epoch {self.epoch} from its "
                                    f"{len(self._parts)} part(s) of {len(self.shards)} shard(s) (files: {names}): "
                                    f"too few shards or rows for the number of ranks x workers, or every "
                                    f"document empty or null ({self.skipped or 'none'} skipped)")
                if not self.infinite:
                    self.exhausted = True
                    return False
                self._start_epoch(self.epoch + 1)
                continue
            self.docs += 1
            self._epoch_docs += 1
            if isinstance(doc, str) and len(doc) > TEXT_CHUNK_CHARS:
                self._seq += 1
                self._text, self._text_pos = {self._seq: doc}, 0
                continue
            ids = np.asarray(self.encode(doc) if isinstance(doc, str) else doc, dtype=np.int32)
            self._push(np.append(ids, np.int32(self.eos_id)).tobytes())
        return True

    def _tokenize_chunk(self) -> None:
        """Pack the next chunk of the long text document (its EOS after the last chunk)."""
        (text,) = self._text.values()
        end = chunk_end(text, self._text_pos)
        ids = np.asarray(self.encode(text[self._text_pos:end]), dtype=np.int32)
        if end == len(text):
            ids = np.append(ids, np.int32(self.eos_id))
            self._text, self._text_pos = {}, 0
        else:
            self._text_pos = end
        self._push(ids.tobytes())

    def _push(self, block: bytes) -> None:
        self._seq += 1
        self._pending[self._seq] = block
        self._n_pending += len(block) // 4

    def _view(self, key: int) -> np.ndarray:
        if key not in self._views:
            self._views[key] = np.frombuffer(self._pending[key], dtype=np.int32)
        return self._views[key]

    def _take(self, n: int, out: Optional[list]) -> None:
        """Consume the first ``n`` pending tokens (``n <= self._n_pending``), appending them to ``out``
        as arrays unless it is None. Cost O(n + blocks touched), not O(pending tokens)."""
        self._n_pending -= n
        while n > 0:
            key = next(iter(self._pending))
            block = self._view(key)
            k = min(n, len(block) - self._head)
            if out is not None:
                out.append(block[self._head:self._head + k])
            self._head += k
            n -= k
            if self._head == len(block):
                del self._pending[key]
                self._views.pop(key, None)
                self._head = 0

    def next_window(self) -> Optional[list[int]]:
        """The next ``window_len`` tokens, or None when a finite stream has no full window left."""
        if self.exhausted or not self._fill(self.window_len):
            return None
        parts: list[np.ndarray] = []
        self._take(self.window_len, parts)
        self.window += 1
        return np.concatenate(parts).tolist() if len(parts) > 1 else parts[0].tolist()

    def skip_windows(self, n: int) -> bool:
        """Advance ``n`` windows without returning them; False if a finite stream ends first.

        Whole pending documents are skipped without reading their tokens one by one.
        """
        for _ in range(n):
            if self.exhausted or not self._fill(self.window_len):
                return False
            self._take(self.window_len, None)
            self.window += 1
        return True

    # -- state -----------------------------------------------------------------
    @property
    def pending_tokens(self) -> int:
        """Tokens packed from documents but not yet emitted in a window."""
        return self._n_pending

    def state_dict(self) -> dict:
        """The position (plain data). Documents are leaves keyed by sequence number (str keys):
        ``pending`` = int32 token blocks (``head`` tokens of the first already emitted), ``text`` = the
        long document being tokenized in chunks (``text_pos`` characters done), ``buffer`` =
        shuffle-buffer documents with ``buffer_order`` their slot order."""
        return {"epoch": self.epoch, "part": self.part, "row": self.row, "seq": self._seq,
                "buffer": {str(k): v for k, v in self._buffer.items()}, "buffer_order": list(self._order),
                "rng": self.rng.getstate(), "pending": {str(k): v for k, v in self._pending.items()},
                "head": self._head, "text": {str(k): v for k, v in self._text.items()}, "text_pos": self._text_pos,
                "window": self.window, "docs": self.docs, "epoch_docs": self._epoch_docs,
                "skipped": dict(self.skipped), "exhausted": self.exhausted}

    def load_state_dict(self, sd: dict) -> None:
        self._start_epoch(sd["epoch"])
        self.part, self.row, self._seq = sd["part"], sd["row"], sd["seq"]
        self._buffer = {int(k): v for k, v in sd["buffer"].items()}
        self._order = list(sd["buffer_order"])
        self.rng.setstate(_as_rng_state(sd["rng"]))
        # key order is not kept by every carrier of the state (worker deltas): sort by sequence number
        self._pending = {k: sd["pending"][str(k)] for k in sorted(int(k) for k in sd["pending"])}
        self._views, self._head = {}, sd["head"]
        self._text, self._text_pos = {int(k): v for k, v in sd["text"].items()}, sd["text_pos"]
        self._n_pending = sum(len(b) for b in self._pending.values()) // 4 - self._head
        self.window, self.docs = sd["window"], sd["docs"]
        self._epoch_docs, self.skipped, self.exhausted = sd["epoch_docs"], dict(sd["skipped"]), sd["exhausted"]


def _as_rng_state(state):
    """random.Random state from a saved copy (lists after a round trip through some serialisers)."""
    version, internal, gauss = state
    return version, tuple(internal), gauss
