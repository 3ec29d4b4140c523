"""Finite ``document`` sharding: batches per rank in one epoch, and the number every rank reaches.

In ``document`` mode each rank packs only its own documents (``stream.split_parts``), so
with finite data (``data.infinite = false``) ranks run out after different numbers of
batches. A rank that stops while the others still train would leave them waiting in
their next collective, so the train loader stops every rank after the smallest count,
which every rank computes from the same shards without communicating.

Packing is contiguous, so a stream's window count does not depend on the document order:
a (rank, worker) stream holding ``T`` tokens (each kept document plus its EOS) gives
``T // (seq_len + 1)`` windows and ``T // (seq_len + 1) // B`` batches; a rank's batches
are the sum over its workers (the loader takes batches from its workers in turn).
"""
import numpy as np

from mhar_titan.data.stream import clean_document, epoch_parts


def row_tokens(shard, encode) -> np.ndarray:
    """Tokens each row of ``shard`` adds to a stream (document + EOS; 0 for a skipped row), int64 ``(rows,)``.

    Pretokenized shards read only their row offsets; text shards are tokenized (the cost of
    one pass over the shard).
    """
    if hasattr(shard, "row_lengths"):
        lengths = shard.row_lengths()
        return np.where(lengths > 0, lengths + 1, 0)
    out = []
    for row, value in enumerate(shard.rows(0)):
        doc = clean_document(value, shard.name, row, {}, warn=False)
        out.append(0 if doc is None else len(encode(doc) if isinstance(doc, str) else doc) + 1)
    return np.asarray(out, dtype=np.int64)


def epoch_batches_per_rank(shards: list, encode, *, dp_world: int, num_workers: int, local_batch_size: int,
                           seq_len: int, seed: int, shuffle: bool, epoch: int) -> list[int]:
    """Batches of ``local_batch_size`` windows of ``seq_len + 1`` tokens each rank yields in epoch ``epoch``.

    Returns a list of length ``dp_world`` (rank r at index r), for a stream that starts the
    epoch with an empty token buffer (finite mode).
    """
    lengths = [row_tokens(shard, encode) for shard in shards]
    window, workers = seq_len + 1, max(1, num_workers)
    out = []
    for rank in range(dp_world):
        total = 0
        for worker in range(workers):
            parts = epoch_parts(len(shards), seed, epoch, shuffle, [(dp_world, rank), (workers, worker)])
            tokens = sum(int(lengths[s][offset::stride].sum()) for s, stride, offset in parts)
            total += tokens // window // local_batch_size
        out.append(total)
    return out
