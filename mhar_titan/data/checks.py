"""Checks of the data that need only the config and the files, run before a model is built.

``check_data_files(cfg, dp_world=..., num_workers=...)`` opens every local training and
validation file (parquet footers, the first record of a jsonl file, pretokenized manifests)
and raises ``DataError`` in one line naming the file for:

- a path or glob that matches nothing, an unsupported file type, an unreadable file;
- a missing text column (``data.text_field``) or one that does not hold text (an int or list
  column: Arrow types other than string/binary, their views and dictionaries of them (``is_text_type``);
  a jsonl value that is not a string);
- an empty shard (no rows) and a parquet text column whose every value is null (from the
  row-group statistics, when the file has them);
- too few documents for the readers: in ``document`` sharding every (rank, worker) pair
  reads its own rows (``stream.epoch_parts``) and one with no row would fail in the middle of
  training, so rows are counted per reader for the first epochs' shard orders.

A data mixture (``data.sources``) is checked source by source (each message names the source)
and as a whole (``check_mixture``): a training file of two sources, a validation file of one
source that is a training file of another (within one source, validation files are left out
of its training files, as for one source), pretokenized sources made with different
tokenizers, and a finite mixture in document sharding on several ranks. Its weights, names,
per-source tokenizers and empty file lists are refused earlier, by the config
(``DataConfig``).

Hub sources are not opened here (that needs the network); their errors come when the loader
starts, naming the shard and row. Problems that only reading every row can find (an invalid
row in the middle of a file) are reported when met, by the stream, with the file and row.
"""

import numpy as np

from pathlib import Path

from mhar_titan.config.data import DataConfig
from mhar_titan.data.manifest import load_pretokenized
from mhar_titan.data.mixture import FINITE_DOCUMENT_MIXTURE, NO_VALIDATION_SOURCE
from mhar_titan.data.sources import DataError, JsonlShard, ParquetShard, expand_files, train_shards, validation_shards
from mhar_titan.data.stream import epoch_parts

EPOCHS_CHECKED = 4
"""Shard orders (epochs 0..3) for which the rows of every document-sharding reader are counted."""


def is_text_type(kind) -> bool:
    """Whether an Arrow type holds text: every string-like type (string, large_string, string_view),
    every binary one (bytes decoded as UTF-8 by the stream), and a dictionary of either (how
    parquet writers often encode a column of repeated strings)."""
    import pyarrow as pa

    if pa.types.is_dictionary(kind):
        return is_text_type(kind.value_type)
    return (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)
            or pa.types.is_binary(kind) or pa.types.is_large_binary(kind) or pa.types.is_binary_view(kind))


def _parquet_rows(shard: ParquetShard) -> int:
    pf = shard._open()  # unreadable file / missing column: DataError naming the file
    kind = pf.schema_arrow.field(shard.field).type
    if not is_text_type(kind):
        raise DataError(f"parquet file {shard.path}: column {shard.field!r} has type {kind}, not text (string); "
                        f"set data.text_field to the column holding the documents")
    rows = pf.metadata.num_rows
    if rows == 0:
        raise DataError(f"parquet file {shard.path} has no rows (an empty shard): remove it from the data files")
    column = pf.schema_arrow.get_field_index(shard.field)
    nulls = []
    for rg in range(pf.num_row_groups):
        stats = pf.metadata.row_group(rg).column(column).statistics
        nulls.append(stats.null_count if stats is not None and stats.has_null_count else None)
    if None not in nulls and sum(nulls) == rows:
        raise DataError(f"parquet file {shard.path}: all {rows} values of column {shard.field!r} are null (no "
                        f"document): remove the file from the data files or set data.text_field")
    return rows


def _jsonl_rows(shard: JsonlShard, count: bool) -> int:
    shard.check()
    with open(shard.path, "rb") as f:
        rows = sum(1 for _ in f) if count else len(f.readline()[:1])  # without count: 1 if not empty
    if rows == 0:
        raise DataError(f"jsonl file {shard.path} is empty (an empty shard): remove it from the data files")
    first = next(shard.rows(0))  # DataError naming the line for bad JSON or a missing key
    if first is not None and not isinstance(first, (str, bytes)):
        raise DataError(f"{shard.path}:1: key {shard.field!r} holds a {type(first).__name__}, not text; set "
                        f"data.text_field to the key holding the documents")
    return rows


def shard_rows(shard, count: bool = True) -> int:
    """Rows of one local shard after checking its readability, text column and emptiness (DataError).

    ``count = False``: a jsonl file is not read to its end (the result is then 1 for a non-empty file).
    """
    if isinstance(shard, ParquetShard):
        return _parquet_rows(shard)
    if isinstance(shard, JsonlShard):
        return _jsonl_rows(shard, count)
    rows = shard.n_docs  # pretokenized: files checked against the manifest when loaded
    if rows == 0:
        raise DataError(f"pretokenized shard {shard.name} has no rows (an empty shard): remove it")
    return rows


def check_readers(shards: list, rows: list[int], cfg: DataConfig, *, dp_world: int, num_workers: int,
                  seed: int) -> None:
    """In document sharding, every (rank, worker) reader must own at least one row in each checked epoch."""
    if cfg.sharding != "document":
        return
    workers = max(1, num_workers)
    counts = np.asarray(rows)
    for epoch in range(EPOCHS_CHECKED if cfg.shuffle else 1):
        for rank in range(dp_world):
            for worker in range(workers):
                parts = epoch_parts(len(shards), seed, epoch, cfg.shuffle, [(dp_world, rank), (workers, worker)])
                owned = sum(max(0, -(-(int(counts[s]) - offset) // stride)) for s, stride, offset in parts)
                if owned == 0:
                    raise DataError(
                        f"data.files give {int(counts.sum())} documents in {len(shards)} shard(s), too few for "
                        f"data.sharding = 'document' with {dp_world} rank(s) x {workers} loader worker(s): rank "
                        f"{rank} worker {worker} would read nothing (epoch {epoch}). Use data.sharding = 'window', "
                        f"fewer data.num_workers, or more files")


def check_data_files(cfg: DataConfig, *, dp_world: int, seed: int, validation: bool) -> None:
    """Run every data check that needs only ``cfg`` and the files (module docstring); DataError if one fails.

    ``seed`` is the training seed (used when ``cfg.seed`` is None); ``validation``: check
    ``cfg.validation_files`` (a mixture: every source's) too. Costs one footer read per parquet
    file and, in document sharding, one pass over the lines of each jsonl file (else its first
    line); no tokenization.
    """
    if cfg.is_mixture:
        check_mixture(cfg, dp_world=dp_world)
        if validation and not cfg.validation_configs():
            raise DataError(NO_VALIDATION_SOURCE)
        for m in cfg.mixture():
            try:
                check_data_files(m.data, dp_world=dp_world, seed=seed,
                                 validation=validation and bool(m.data.validation_files))
            except DataError as e:
                raise DataError(f"data.sources {m.name!r}: {e}") from e
        return
    if cfg.source == "hub":
        return
    shards = train_shards(cfg)
    rows = [shard_rows(s, count=cfg.sharding == "document") for s in shards]
    check_readers(shards, rows, cfg, dp_world=dp_world, num_workers=cfg.num_workers,
                  seed=cfg.seed if cfg.seed is not None else seed)
    if validation:
        for shard in validation_shards(cfg):
            shard_rows(shard, count=False)


def _local_paths(patterns: list[str], what: str) -> set[Path]:
    return set(expand_files(patterns, what)) if patterns else set()


def check_mixture(cfg: DataConfig, *, dp_world: int) -> None:
    """The checks of a mixture as a whole (module docstring); DataError naming the sources and the file.

    Local and pretokenized sources only (a hub source's files are known when its stream opens).
    """
    if cfg.sharding == "document" and not cfg.infinite and dp_world > 1:
        raise DataError(FINITE_DOCUMENT_MIXTURE)
    local = [m for m in cfg.mixture() if m.data.source != "hub"]
    train, held_out = {}, {}
    for m in local:
        try:
            files = _local_paths(m.data.files, "data.files")
            held_out[m.name] = _local_paths(m.data.validation_files, "data.validation_files")
        except DataError as e:
            raise DataError(f"data.sources {m.name!r}: {e}") from e
        train[m.name] = files - held_out[m.name]  # a source's own validation files are left out of its training
        if not train[m.name]:
            raise DataError(f"data.sources {m.name!r}: no training file left: every file of its files is also one of "
                            f"its validation_files; list training files apart from the held-out ones")
    names = list(train)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            both = sorted(train[a] & train[b])
            if both:
                raise DataError(f"data.sources {a!r} and {b!r} both train on {both[0]}"
                                f"{f' (and {len(both) - 1} more)' if len(both) > 1 else ''}: a file belongs to one "
                                f"source (its weight would count twice); list it in one source only")
    for a in names:
        for b in names:
            leak = sorted(held_out[a] & train[b]) if a != b else []
            if leak:
                raise DataError(f"data.sources {a!r} holds out {leak[0]} (validation_files), which is a training file "
                                f"of source {b!r}: its validation loss would be measured on trained-on text; remove "
                                f"it from {b!r}'s files or pick another validation file")
    made_with = {}
    for m in local:
        if m.data.source == "pretokenized":
            for path in sorted(train[m.name] | held_out[m.name]):
                if path.is_dir():
                    p = load_pretokenized(path)
                    made_with.setdefault((p.tokenizer, p.n_vocab, p.eos_id), (m.name, path))
    if len(made_with) > 1:
        (ta, (na, pa)), (tb, (nb, pb)) = list(made_with.items())[:2]
        raise DataError(f"the mixture's pretokenized sources were made with different tokenizers: {na!r} ({pa}) "
                        f"with {ta[0]!r} (n_vocab {ta[1]}), {nb!r} ({pb}) with {tb[0]!r} (n_vocab {tb[1]}); a "
                        f"mixture has one tokenizer: re-run python -m mhar_titan.data.pretokenize with "
                        f"--tokenizer {cfg.tokenizer} for the others")
