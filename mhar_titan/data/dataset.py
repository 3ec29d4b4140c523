"""``PackedBatches``: the stateful ``IterableDataset`` behind the train loader.

It yields whole local batches ``(inputs, labels)``, each an int64 tensor of shape
``(local_batch_size, seq_len)`` with ``labels[:, t] == inputs[:, t + 1]`` inside a
window, so the ``StatefulDataLoader`` runs with ``batch_size=None``.

``window`` sharding: every (rank, worker) runs the *global* stream. Global step
``k`` (counted from the loader's start) is the round of ``R = dp_world *
local_batch_size`` windows starting at global window ``start_window + k * R``;
rank ``r`` takes windows ``[r * B, (r + 1) * B)`` of the round. Worker ``w`` of
``W`` produces steps ``w, w + W, ...``, which the loader returns in step order.
Every worker tokenizes the whole stream, so extra workers overlap loading with
training but do not raise the tokenization rate.

``document`` sharding: (rank, worker) pairs split the epoch's shard order with
``stream.split_parts`` (first over ranks, then over workers) and each packs only
its own documents into batches of B consecutive windows.

A mixture (``mixture = (names, weights)``, ``shards`` then one list per source) runs a
``mixture.MixtureStream`` wherever one source runs a ``TokenStream``, and yields
``(inputs, labels, sources)``: ``sources`` int64 ``(local_batch_size,)``, the source index of
each row (the train loader counts and removes it).
"""
from typing import Optional

import torch
from torch.utils.data import IterableDataset, get_worker_info

from mhar_titan.data.mixture import MixtureStream
from mhar_titan.data.sources import DataError
from mhar_titan.data.stream import TokenStream


class DataFault:
    """Yielded instead of a batch when the stream raises ``DataError`` (in a loader worker, whose
    exceptions reach the training process wrapped in a traceback): the train loader raises
    ``DataError(message)`` with the original one-line message naming the file and row."""

    def __init__(self, message: str):
        self.message = message


class PackedBatches(IterableDataset):
    """Local batches of packed windows for one data-parallel rank (see module docstring)."""

    def __init__(self, shards: list, tokenizer, *, sharding: str, dp_rank: int, dp_world: int,
                 local_batch_size: int, seq_len: int, seed: int, shuffle: bool, shuffle_buffer: int,
                 infinite: bool, start_stream: Optional[dict] = None, start_epoch=0,
                 mixture: Optional[tuple[list[str], list[float]]] = None):
        self.shards, self.encode, self.eos_id = shards, tokenizer.encode, tokenizer.eos_id
        self.mixture = mixture
        self.sharding, self.dp_rank, self.dp_world = sharding, dp_rank, dp_world
        self.batch, self.seq_len, self.seed = local_batch_size, seq_len, seed
        self.shuffle, self.shuffle_buffer, self.infinite = shuffle, shuffle_buffer, infinite
        self.start_stream, self.start_epoch = start_stream, start_epoch
        self.start_window = start_stream["window"] if start_stream else 0
        self._stream: Optional[TokenStream] = None
        self._next_step = None
        self._loaded: Optional[dict] = None

    def _new_stream(self, worker: int, workers: int) -> TokenStream:
        consumer = [] if self.sharding == "window" else [(self.dp_world, self.dp_rank), (workers, worker)]

        def token_stream(shards, start_epoch, source=""):
            return TokenStream(shards, self.encode, self.eos_id, self.seq_len + 1, seed=self.seed,
                               shuffle=self.shuffle, shuffle_buffer=self.shuffle_buffer, infinite=self.infinite,
                               consumer=consumer, start_epoch=start_epoch, source=source)

        if self.mixture is None:
            stream = token_stream(self.shards, self.start_epoch)
        else:  # start_epoch: one for every source, or a list (a document-mode reshard)
            names, weights = self.mixture
            epochs = self.start_epoch if isinstance(self.start_epoch, (list, tuple)) else [self.start_epoch] * len(names)
            stream = MixtureStream([token_stream(s, e, n) for s, e, n in zip(self.shards, epochs, names)], names,
                                   weights, seed=self.seed)
        if self.start_stream is not None and self.sharding == "window":
            stream.load_state_dict(self.start_stream)
        return stream

    def _to_batch(self, windows: list[list[int]], sources: Optional[list[int]] = None) -> tuple:
        x = torch.tensor(windows, dtype=torch.int64)
        batch = x[:, :-1].contiguous(), x[:, 1:].contiguous()
        return batch if self.mixture is None else (*batch, torch.tensor(sources, dtype=torch.int64))

    def _take(self, n: int) -> tuple[list, list]:
        """The stream's next ``n`` windows (None at the end of finite data) and, for a mixture, their sources."""
        s, windows, sources = self._stream, [], []
        for _ in range(n):
            windows.append(s.next_window())
            sources.append(getattr(s, "last_source", None))
        return windows, sources

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        self._stream = self._new_stream(worker, workers)
        self._next_step = worker
        if self._loaded is not None:
            self._stream.load_state_dict(self._loaded["stream"])
            self._next_step = self._loaded["next_step"]
            self.start_window = self._loaded["start_window"]
            self._loaded = None
        try:
            if self.sharding == "window":
                yield from self._iter_window(workers)
            else:
                yield from self._iter_document(workers)
        except DataError as e:
            yield DataFault(str(e))

    def _iter_window(self, workers: int):
        s, rounds = self._stream, self.dp_world * self.batch
        while True:
            k = self._next_step
            if not s.skip_windows(self.start_window + k * rounds - s.window):
                return
            windows, sources = self._take(rounds)
            if windows[-1] is None:
                return
            self._next_step = k + workers  # before the yield: state_dict() is taken at the yield
            mine = slice(self.dp_rank * self.batch, (self.dp_rank + 1) * self.batch)
            yield self._to_batch(windows[mine], sources[mine])

    def _iter_document(self, workers: int):
        while True:
            windows, sources = self._take(self.batch)
            if windows[-1] is None:
                return
            self._next_step += workers
            yield self._to_batch(windows, sources)

    def state_dict(self) -> dict:
        if self._stream is None:  # not started yet: the (possibly loaded) start position
            return self._loaded or {"stream": None, "next_step": None, "start_window": self.start_window}
        return {"stream": self._stream.state_dict(), "next_step": self._next_step, "start_window": self.start_window}

    def load_state_dict(self, sd: dict) -> None:
        self._stream = None
        self._loaded = sd if sd.get("stream") is not None else None
