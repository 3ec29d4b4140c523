"""Document sources: ordered shards whose rows can be read from any row index.

A *shard* is one unit of the file/shard order (a local parquet or jsonl file, one
shard of a hub stream, or one pretokenized token file). ``shard.rows(start)``
yields the raw value of every row from ``start`` on: ``str`` (text), ``bytes``
(text that may not be valid UTF-8), ``None`` (missing), or a 1-D integer array
(pretokenized). Cleaning (empty documents, invalid UTF-8) happens in the stream.

Resuming re-opens a shard at the saved row: parquet skips whole row groups from
the footer, jsonl and hub streams read and discard the earlier rows.
"""
import fnmatch
import glob
import json
import logging
import re
import time
from pathlib import Path
from typing import Callable, Iterator, Optional, TypeVar

from mhar_titan.config.data import DataConfig
from mhar_titan.data.manifest import load_pretokenized
from mhar_titan.errors import UserError

logger = logging.getLogger(__name__)
T = TypeVar("T")


class DataError(UserError, RuntimeError):
    """Bad input data or a data source that cannot be read; the message names the file or source."""


def expand_files(patterns: list[str], what: str) -> list[Path]:
    """Paths or globs -> sorted unique paths. Raises DataError for a pattern that matches nothing."""
    out: list[Path] = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern] if Path(pattern).exists() else []
        if not matches:
            raise DataError(f"{what} entry {pattern!r} matches no file (working directory {Path.cwd()})")
        out.extend(Path(m).resolve() for m in matches)
    return list(dict.fromkeys(out))


class ParquetShard:
    """One parquet file; rows of column ``field`` (string or binary)."""

    def __init__(self, path: Path, field: str):
        self.path, self.field, self.name = Path(path), field, str(path)

    def _open(self):
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(self.path)
        except Exception as e:  # ArrowInvalid, OSError: not parquet, truncated, unreadable
            raise DataError(f"cannot read parquet file {self.path}: {str(e).rstrip('. ')}. The file is corrupt or not parquet; "
                            f"re-download it or remove it from the data files.") from e
        names = pf.schema_arrow.names
        if self.field not in names:
            raise DataError(f"parquet file {self.path} has no column {self.field!r} (columns: {names}); "
                            f"set data.text_field")
        return pf

    def check(self) -> None:
        """Read the footer now (in the main process) so a corrupt file fails before any worker starts."""
        self._open()

    def rows(self, start: int = 0) -> Iterator[object]:
        pf = self._open()
        for rg in range(pf.num_row_groups):
            n = pf.metadata.row_group(rg).num_rows
            if start >= n:
                start -= n
                continue
            try:
                values = pf.read_row_group(rg, columns=[self.field]).column(0).to_pylist()
            except Exception as e:
                raise DataError(f"cannot read row group {rg} of parquet file {self.path}: {e}. "
                                f"The file is corrupt; re-download it or remove it from the data files.") from e
            yield from values[start:]
            start = 0


class JsonlShard:
    """One JSON-lines file; rows are lines, each an object with key ``field``."""

    def __init__(self, path: Path, field: str):
        self.path, self.field, self.name = Path(path), field, str(path)

    def check(self) -> None:
        if not self.path.is_file():
            raise DataError(f"jsonl file {self.path} is not a readable file")

    def rows(self, start: int = 0) -> Iterator[object]:
        with open(self.path, "rb") as f:
            for lineno, line in enumerate(f):
                if lineno < start:
                    continue
                if not line.strip():
                    yield None
                    continue
                try:
                    obj = json.loads(line)
                except UnicodeDecodeError:
                    yield line  # not valid UTF-8: the stream counts and skips it
                    continue
                except json.JSONDecodeError as e:
                    raise DataError(f"{self.path}:{lineno + 1}: not valid JSON ({e}); fix or remove the line") from e
                if not isinstance(obj, dict) or self.field not in obj:
                    raise DataError(f"{self.path}:{lineno + 1}: no key {self.field!r}; set data.text_field")
                yield obj[self.field]


def is_transient(e: BaseException) -> bool:
    """Network errors worth retrying: connection resets, timeouts, HTTP 408/429/5xx. Offline mode is not."""
    if "offline" in str(e).lower():
        return False
    names = {c.__name__ for c in type(e).__mro__}
    if isinstance(e, (ConnectionError, TimeoutError)) or names & {
            "Timeout", "ReadTimeout", "ConnectTimeout", "ChunkedEncodingError", "ProtocolError",
            "RemoteDisconnected", "IncompleteRead", "ClientConnectionError", "ServerDisconnectedError"}:
        return True
    status = getattr(getattr(e, "response", None), "status_code", None)
    return status in (408, 429, 500, 502, 503, 504)


def with_retries(fn: Callable[[], T], what: str, attempts: int, backoff_s: float,
                 sleep: Callable[[float], None] = time.sleep, *, max_s: Optional[float] = None,
                 clock: Callable[[], float] = time.monotonic, hint: str = "") -> T:
    """Call ``fn``; on a transient error wait ``backoff_s * 2**k`` (max 60 s) and retry.

    At most ``attempts`` calls, and no retry whose wait would end more than ``max_s`` seconds
    (``clock``) after the first call began: a hub that never answers ends in bounded time (one
    call can itself take long: ``huggingface_hub`` retries a refused connection on its own).

    Raises:
        DataError: naming ``what``, the attempts and the time spent, then ``hint`` (how to go on
            without the hub), after the last attempt, or at once for a non-transient error.
    """
    started = clock()
    suffix = f" {hint}" if hint else (" Check the network and the Hugging Face hub status, or download the files "
                                      "and use data.source = 'local'.")
    for k in range(attempts):
        try:
            return fn()
        except Exception as e:
            if not is_transient(e):
                raise DataError(f"{what} failed: {type(e).__name__}: {e}.{suffix}") from e
            wait = min(60.0, backoff_s * 2 ** k)
            spent = clock() - started
            if k == attempts - 1 or (max_s is not None and spent + wait > max_s):
                raise DataError(f"{what} failed after {k + 1} attempt(s) in {spent:.0f} s (last error "
                                f"{type(e).__name__}: {e}).{suffix}") from e
            # one line per retry, counted: a hub error's message can run to many lines
            first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
            logger.warning("%s: transient error %s: %s; retry %d/%d in %.1f s",
                           what, type(e).__name__, first, k + 1, attempts - 1, wait)
            sleep(wait)
    raise AssertionError("unreachable")


def hub_hint(cfg: DataConfig) -> str:
    """How to train without the hub: the local-files settings, naming the dataset."""
    name = f" (configuration {cfg.hub_name!r})" if cfg.hub_name else ""
    return (f"The Hugging Face hub is not reachable from here: download {cfg.hub_path!r}{name} where it is and "
            f"train on the local copy with data.source = \"local\" and data.files = [\"<folder>/*.parquet\"] "
            f"(held-out files in data.validation_files), or raise data.hub_retry_max_s if the hub is only slow.")


class HubShard:
    """One shard of a ``datasets`` streaming ``IterableDataset`` (one file of the hub repository)."""

    def __init__(self, dataset, name: str, field: str, attempts: int, backoff_s: float):
        self.dataset, self.name, self.field = dataset, name, field
        self.attempts, self.backoff_s = attempts, backoff_s

    def check(self) -> None:
        pass

    def rows(self, start: int = 0) -> Iterator[object]:
        row, failures = start, 0
        while True:
            try:
                # .iter() rather than iter(): datasets would otherwise split a shard across DataLoader workers
                for batch in (self.dataset.skip(row) if row else self.dataset).iter(batch_size=256):
                    if self.field not in batch:
                        raise DataError(f"{self.name}: no field {self.field!r} (fields: {sorted(batch)}); "
                                        f"set data.text_field")
                    for value in batch[self.field]:
                        yield value
                        row += 1
                return
            except DataError:
                raise
            except Exception as e:  # a stream that broke mid-shard is reopened at the current row
                failures += 1
                if not is_transient(e) or failures >= self.attempts:
                    raise DataError(f"streaming {self.name} failed at row {row} after {failures} attempt(s): "
                                    f"{type(e).__name__}: {e}") from e
                wait = min(60.0, self.backoff_s * 2 ** (failures - 1))
                logger.warning("%s: transient error at row %d (%s); reopening in %.1f s", self.name, row, e, wait)
                time.sleep(wait)


def _load_hub(cfg: DataConfig, data_files: Optional[list[str]], name: Optional[str], role: str = "training"):
    import datasets

    what = (f"opening the {role} data: datasets.load_dataset({cfg.hub_path!r}, name={name!r}, "
            f"split={cfg.hub_split!r}, data_files={data_files or None!r}, streaming=True)")
    return with_retries(
        lambda: datasets.load_dataset(cfg.hub_path, name, split=cfg.hub_split, streaming=True,
                                      revision=cfg.hub_revision, data_files=data_files or None),
        what, cfg.hub_retries, cfg.hub_retry_backoff_s, max_s=cfg.hub_retry_max_s, hint=hub_hint(cfg))


def _shard_files(dataset) -> Optional[list[str]]:
    """The file behind each shard of a streaming dataset, or None if ``datasets`` does not say.

    ``datasets`` (tested with 5.2) keeps them in the private ``_ex_iterable.kwargs["files"]``,
    one file per shard for parquet/json builders.
    """
    files = getattr(getattr(dataset, "_ex_iterable", None), "kwargs", {}).get("files")
    if not isinstance(files, (list, tuple)) or len(files) != dataset.num_shards:
        return None
    return [str(f) for f in files]


def _hub_shards(cfg: DataConfig, dataset) -> list[HubShard]:
    n, files = dataset.num_shards, _shard_files(dataset)
    names = [files[i] if files else f"{cfg.hub_path}[shard {i}/{n}]" for i in range(n)]
    return [HubShard(dataset.shard(num_shards=n, index=i), names[i], cfg.text_field,
                     cfg.hub_retries, cfg.hub_retry_backoff_s) for i in range(n)]


def _unknown_files_error(cfg: DataConfig, role: str) -> DataError:
    import datasets

    return DataError(
        f"cannot tell which {role} shards of {cfg.hub_path!r} are the data.validation_files {cfg.validation_files}: "
        f"datasets {datasets.__version__} does not expose the file of each streaming shard (tested with 5.2), so "
        f"held-out files could leak into training. Download the files and use data.source = 'local', or install "
        f"a datasets version that exposes them.")


def _repo_path(file: str) -> str:
    """``hf://datasets/<repo>@<revision>/<path>`` -> ``<path>``; local paths unchanged."""
    m = re.match(r"^hf://datasets/[^@]+@[^/]+/(.*)$", file)
    return m.group(1) if m else file


def _exclude_hub_validation(cfg: DataConfig, dataset, shards: list[HubShard]) -> list[HubShard]:
    """The training ``shards`` of ``dataset`` minus every file of ``cfg.validation_files``.

    The validation patterns are resolved by ``datasets`` itself (a pattern matching no file
    raises DataError) and compared with the training files, so a held-out file is either
    excluded or verifiably absent from the training files. Raises DataError when the files
    behind the shards are unknown.
    """
    train_files = _shard_files(dataset)
    if train_files is None:
        raise _unknown_files_error(cfg, "training")
    val_files = _shard_files(_load_hub(cfg, cfg.validation_files, None, role="validation"))
    if val_files is None:
        raise _unknown_files_error(cfg, "validation")
    held_out = {_repo_path(f) for f in val_files}
    kept = [s for s, f in zip(shards, train_files)
            if _repo_path(f) not in held_out and not _matches_any(f, cfg.validation_files)]
    logger.info("data: %d hub validation file(s); %d of them were in the training files and are excluded",
                len(val_files), len(shards) - len(kept))
    return kept


def _matches_any(name: str, patterns: list[str]) -> bool:
    return any(name == p or fnmatch.fnmatch(name, p) or fnmatch.fnmatch(name, "*/" + p.lstrip("/"))
               for p in patterns)


def _text_shard(path: Path, field: str):
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return ParquetShard(path, field)
    if suffix in (".jsonl", ".json"):
        return JsonlShard(path, field)
    raise DataError(f"data file {path} has an unsupported type {suffix!r}: use .parquet, .jsonl or .json")


def _local_shards(patterns: list[str], field: str, what: str) -> list:
    shards = []
    for path in expand_files(patterns, what):
        shards.extend(load_pretokenized(path).shards if path.is_dir() else [_text_shard(path, field)])
    for shard in shards:
        shard.check()
    return shards


def train_shards(cfg: DataConfig) -> list:
    """The training shards in their canonical (unshuffled) order, validation files left out."""
    if cfg.source == "hub":
        dataset = _load_hub(cfg, cfg.hub_data_files, cfg.hub_name)
        shards = _hub_shards(cfg, dataset)
        kept = _exclude_hub_validation(cfg, dataset, shards) if cfg.validation_files else shards
    else:
        if not cfg.files:
            raise DataError(f"data.files is empty: list the training {'files' if cfg.source == 'local' else 'pretokenized directories'}")
        held_out = set(expand_files(cfg.validation_files, "data.validation_files")) if cfg.validation_files else set()
        shards = _local_shards(cfg.files, cfg.text_field, "data.files")
        kept = [s for s in shards if Path(getattr(s, "origin", s.name)).resolve() not in held_out]
    if len(kept) < len(shards):
        logger.info("data: %d designated validation shard(s) excluded from training", len(shards) - len(kept))
    if not kept:
        raise DataError("no training shards left after excluding data.validation_files")
    return kept


def validation_shards(cfg: DataConfig) -> list:
    """The designated held-out shards, read in their listed order (never derived from the training files)."""
    if not cfg.validation_files:
        raise DataError("data.validation_files is empty: designate held-out files to evaluate on")
    if cfg.source == "hub":
        return _hub_shards(cfg, _load_hub(cfg, cfg.validation_files, None, role="validation"))
    return _local_shards(cfg.validation_files, cfg.text_field, "data.validation_files")


def sources_fingerprint(shards: list) -> list[str]:
    """Names of the shards, stored in loader state to detect a changed file list at resume."""
    return [s.name for s in shards]
