"""``DataConfig``: the ``[data]`` section of a training TOML, and ``MixtureSource``, one entry of
its ``sources`` list (a data mixture).

Plain types only (str, int, float, bool, list[str], Optional[...], a list of ``MixtureSource``
tables): the job config parser type-checks TOML values against these annotations. Value checks
that the parser cannot do (choices, ranges, the mixture's weights and names) run in
``__post_init__`` and raise ``ValueError`` naming the field.

Two forms of ``[data]``:

- one source: ``source``, ``files`` / ``hub_*``, ``text_field`` and ``validation_files`` at the
  top of ``[data]``;
- a mixture: ``sources``, a list of tables (``[[data.sources]]``), each with a ``name``, a
  ``weight`` and the same source keys (``SourceFields``, with the same defaults); the rest of
  ``[data]`` (tokenizer, sharding, shuffling, seed, workers, hub retries) holds for every source.
  The top-level source keys are then left unset. ``DataConfig.mixture()`` resolves each entry
  to a single-source ``DataConfig`` that the single-source code reads as it is.
"""
import dataclasses
import json
import math
import re
from dataclasses import dataclass, field
from typing import Optional

SOURCES = ("hub", "local", "pretokenized")
SHARDINGS = ("window", "document")
SOURCE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
"""A mixture source's name: it appears in metric keys (``val_loss/<name>``, ``tokens_seen/<name>``)."""
MIN_SHARE = 2.0 ** -64
"""The smallest share of the windows a source with a weight > 0 may have: the mixture draws on a
64-bit grid (``mhar_titan.data.mixture``), so a smaller share is never drawn."""


@dataclass
class SourceFields:
    """What one source reads: the keys a mixture's source table and a single-source ``[data]`` share."""

    source: str = "local"
    """"hub": stream ``hub_path`` with ``datasets`` (FineWeb-Edu); "local": parquet/jsonl
    files in ``files``; "pretokenized": directories written by
    ``python -m mhar_titan.data.pretokenize`` (listed in ``files``)."""

    hub_path: str = "HuggingFaceFW/fineweb-edu"
    """Dataset repository (or a ``datasets`` builder such as "parquet") for source="hub"."""

    hub_name: Optional[str] = "sample-10BT"
    """Named configuration of ``hub_path`` (FineWeb-Edu: "sample-10BT", "sample-100BT", ...)."""

    hub_split: str = "train"
    """Split to stream for source="hub"."""

    hub_revision: Optional[str] = None
    """Git revision (commit, tag, branch) of ``hub_path``; None = the default branch."""

    hub_data_files: list[str] = field(default_factory=list)
    """Optional data files (paths or globs inside the repository) instead of the named
    configuration's files."""

    text_field: str = "text"
    """Column (parquet) or key (jsonl) holding a document's text."""

    files: list[str] = field(default_factory=list)
    """Training files for source="local" (parquet/jsonl paths or globs, e.g.
    "data/shakespeare/train-*.parquet") or pretokenized directories for
    source="pretokenized". Files also named in ``validation_files`` are left out."""

    validation_files: list[str] = field(default_factory=list)
    """Designated held-out files (paths/globs; for source="hub" paths inside the repository,
    which are then excluded from training). Local/pretokenized entries are local paths.
    Empty = no validation."""

    def _check_source_fields(self, where: str) -> None:
        for name in ("files", "validation_files", "hub_data_files"):
            value = getattr(self, name)
            if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
                example = json.dumps([value]) if isinstance(value, str) else '["data/train-*.parquet"]'
                raise ValueError(f"{where}.{name} must be a list of strings (paths or globs), got "
                                 f"{type(value).__name__} {value!r}; write {where}.{name} = {example}")
            setattr(self, name, list(value))
        if self.source not in SOURCES:
            raise ValueError(f"{where}.source must be one of {SOURCES}, got {self.source!r}")


SOURCE_KEYS = tuple(f.name for f in dataclasses.fields(SourceFields))
"""The per-source keys (set per source in a mixture, at the top of ``[data]`` otherwise)."""


@dataclass
class MixtureSource(SourceFields):
    """One source of a data mixture (an entry of ``data.sources``): its name, its weight and
    what it reads (``SourceFields``, same defaults as a single-source ``[data]``)."""

    name: str = ""
    """Letters, digits, "_", "-", "."; unique in the mixture (metric keys ``val_loss/<name>``,
    ``tokens_seen/<name>``; the checkpoint keeps each source's position under it)."""

    weight: Optional[float] = None
    """Share of the training windows drawn from this source, relative to the other weights
    (normalised by their sum; >= 0, finite; 0 keeps the source's position without drawing)."""

    tokenizer: Optional[str] = None
    """Unset = ``data.tokenizer``; a mixture has one tokenizer, so any other value is refused."""


@dataclass
class MixtureSpec:
    """A resolved mixture entry: name, normalised weight and the single-source ``DataConfig`` it reads."""

    name: str
    weight: float
    data: "DataConfig"


@dataclass
class DataConfig(SourceFields):
    """Where the training text comes from (one source, or a mixture in ``sources``), how it is
    tokenized, sharded and loaded."""

    sources: list[MixtureSource] = field(default_factory=list)
    """A data mixture: one table per source (``[[data.sources]]``: ``name``, ``weight`` and the
    source keys). Empty = the single source given by the top-level source keys. Each training
    window is drawn from one source (``mhar_titan.data.mixture``), so the token stream is a pure
    function of (seed, weights, sources, step); each source keeps its own position."""

    allow_weight_change: bool = False
    """Mixture only: resume a checkpoint saved with other ``weight``s (the next phase of an
    anneal): every source continues from its saved position and the new weights decide the
    windows from the resumed step on. Without it such a resume stops with an error."""

    hub_retries: int = 5
    """Attempts for each hub request (opening the stream, reopening a shard) before giving up."""

    hub_retry_backoff_s: float = 2.0
    """First wait between attempts in seconds; doubles after each failure (capped at 60 s)."""

    hub_retry_max_s: float = 120.0
    """Seconds after which opening the hub stream starts no further attempt: the run then stops
    (exit 2) naming the dataset and the local-files settings (one attempt may take longer:
    ``huggingface_hub`` retries a connection on its own)."""

    tokenizer: str = "gpt2"
    """tiktoken encoding name: "gpt2" (small runs), "cl100k_base" (paper flavors), "o200k_base"; or
    "bytes" (UTF-8 bytes as ids 0-255, EOS 256: a 257-id vocabulary for small CPU studies)."""

    tokenizer_file: Optional[str] = None
    """Local encoding file(s) to use instead of the cache: a ``.tiktoken`` (or ``.tiktoken.gz``)
    rank file, or for "gpt2" a directory holding ``encoder.json`` and ``vocab.bpe``.
    Checked against tiktoken's published SHA-256."""

    tokenizer_cache_dir: Optional[str] = None
    """tiktoken cache folder; None = $TIKTOKEN_CACHE_DIR, else <repo>/.cache/tiktoken in a source
    checkout and $XDG_CACHE_HOME/mhar-titan/tiktoken (~/.cache/mhar-titan/tiktoken) for an
    installed copy. Fill it with ``python -m mhar_titan.data.prepare_tokenizer``."""

    sharding: str = "window"
    """"window": one global window order independent of the world size (exact across world
    sizes; every rank tokenizes the whole stream). "document": each rank tokenizes only its
    own documents (scales; the global batch depends on the world size)."""

    allow_document_reshard: bool = False
    """sharding="document" only: when resuming at a different world size (or worker count),
    start the next epoch at the new layout instead of stopping with an error. The rest of
    the interrupted epoch is skipped (logged as a warning)."""

    seed: Optional[int] = None
    """Shuffle seed; None = the training seed passed to ``build_train_loader``."""

    shuffle: bool = True
    """Shuffle the file/shard order every epoch and documents through ``shuffle_buffer``."""

    shuffle_buffer: int = 512
    """Documents held in the shuffle buffer (0 or 1 = no document shuffling). The buffer is
    part of the loader state, so it costs checkpoint space (raw text of that many documents)."""

    infinite: bool = True
    """Start a new epoch (new shuffle seed, logged) when the data runs out; False = stop."""

    num_workers: int = 0
    """``StatefulDataLoader`` worker processes per rank (0 = load in the training process)."""

    pin_memory: bool = False
    """Pin batches in page-locked memory for faster host-to-GPU copies (CUDA only)."""

    prefetch_factor: Optional[int] = None
    """Batches prefetched per worker (None = the PyTorch default of 2; needs num_workers > 0)."""

    def __post_init__(self):
        self._check_source_fields("data")
        if self.sharding not in SHARDINGS:
            raise ValueError(f"data.sharding must be one of {SHARDINGS}, got {self.sharding!r}")
        for name in ("num_workers", "shuffle_buffer"):
            if getattr(self, name) < 0:
                raise ValueError(f"data.{name} must be >= 0, got {getattr(self, name)}")
        if not self.hub_retry_max_s > 0:
            raise ValueError(f"data.hub_retry_max_s must be > 0 seconds, got {self.hub_retry_max_s}")
        if self.hub_retries < 1:
            raise ValueError(f"data.hub_retries must be >= 1, got {self.hub_retries}")
        if self.prefetch_factor is not None and self.num_workers == 0:
            raise ValueError("data.prefetch_factor needs data.num_workers > 0 (set it to None for 0 workers)")
        self._check_mixture()

    # -- the mixture form --------------------------------------------------------
    @property
    def is_mixture(self) -> bool:
        """Whether ``[data]`` lists its sources in ``sources`` (even a single one)."""
        return bool(self.sources)

    def _check_mixture(self) -> None:
        """The mixture's names, weights and tokenizer, and that the top-level source keys are unset.

        Raises:
            ValueError: naming the source (``data.sources[i]``) and the fix.
        """
        if not isinstance(self.sources, (list, tuple)):
            raise ValueError(f"data.sources must be a list of source tables ([[data.sources]]), got "
                             f"{type(self.sources).__name__}")
        self.sources = [_as_source(entry, i) for i, entry in enumerate(self.sources)]
        if not self.sources:
            if self.allow_weight_change:
                raise ValueError("data.allow_weight_change is for a mixture (data.sources); remove it")
            return
        default = SourceFields()
        top = [k for k in SOURCE_KEYS if getattr(self, k) != getattr(default, k)]
        if top:
            raise ValueError(f"data.{top[0]} is set at the top of [data] beside data.sources: a mixture reads only "
                             f"its sources' tables; move data.{top[0]} into each [[data.sources]] table")
        seen: dict[str, int] = {}
        for i, src in enumerate(self.sources):
            where = f"data.sources[{i}]"
            if not isinstance(src.name, str) or not SOURCE_NAME.match(src.name):
                raise ValueError(f"{where}.name = {src.name!r}: give every source a name of letters, digits, "
                                 f"'_', '-' or '.' (it names the source's metrics and checkpoint position)")
            where = f"data.sources[{i}] ({src.name!r})"
            if src.name in seen:
                raise ValueError(f"{where}: the name is also data.sources[{seen[src.name]}]'s; names must be unique")
            seen[src.name] = i
            src._check_source_fields(f"data.sources[{i}]")
            w = src.weight
            if w is None:
                raise ValueError(f"{where} has no weight: set weight = <share of the windows>, e.g. 0.5")
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not _finite(w) or w < 0:
                raise ValueError(f"{where}.weight = {w!r}: weights must be finite numbers >= 0 (0 draws nothing "
                                 f"from the source but keeps its position)")
            if src.tokenizer is not None and src.tokenizer != self.tokenizer:
                raise ValueError(f"{where}.tokenizer = {src.tokenizer!r} differs from data.tokenizer = "
                                 f"{self.tokenizer!r}: a mixture has one tokenizer for all sources; set "
                                 f"data.tokenizer once and remove the per-source tokenizer")
            if src.source in ("local", "pretokenized") and not src.files:
                raise ValueError(f"{where} has no files (source = {src.source!r}, files = []): list its "
                                 f"training files, or remove the source")
        self.normalised_weights()

    def normalised_weights(self) -> list[float]:
        """The mixture's weights divided by their sum (shares of the windows, summing to 1), in
        the order of ``sources``; ``[]`` for the one-source form.

        Raises:
            ValueError: the weights sum to 0, or to a number a float cannot hold (two weights of
                1e308 overflow to infinity), or a weight > 0 has a share too small for the mixture
                to ever draw it (below ``MIN_SHARE`` = 2^-64, the resolution of its 64-bit draws;
                a subnormal share, or one that rounds to 0); the message names the sources.
        """
        if not self.sources:
            return []
        weights = [float(s.weight) for s in self.sources]
        listed = ", ".join(f"{s.name}={w:g}" for s, w in zip(self.sources, weights))
        total = sum(weights)
        if not math.isfinite(total):
            raise ValueError(f"the weights of data.sources sum to {total:g}, more than a float holds ({listed}): "
                             f"only the ratios of the data.sources[i].weight keys matter, so scale them down, "
                             f"e.g. to shares that sum to 1")
        if not total > 0:
            raise ValueError(f"the weights of data.sources sum to {total:g}: at least one source needs a weight "
                             f"> 0 ({listed})")
        shares = [w / total for w in weights]
        for i, (src, w, share) in enumerate(zip(self.sources, weights, shares)):
            if w > 0 and not (math.isfinite(share) and share >= MIN_SHARE):
                raise ValueError(f"data.sources[{i}] ({src.name!r}).weight = {w:g} is a share of {share:g} of the "
                                 f"weights' sum {total:g}, below the {MIN_SHARE:.2g} the mixture can draw (it would "
                                 f"never be drawn): set it to 0 to keep the source without drawing from it, or raise "
                                 f"it ({listed})")
        if not abs(math.fsum(shares) - 1.0) < 1e-9:  # cannot happen for finite weights >= 0; guards the kind
            raise ValueError(f"the weights of data.sources do not normalise to shares summing to 1 ({listed})")
        return shares

    def mixture(self) -> list[MixtureSpec]:
        """The sources, each as a single-source ``DataConfig`` (its own source keys, the shared
        keys of this ``[data]``) with its weight normalised to sum 1; ``[]`` for the one-source form."""
        if not self.sources:
            return []
        shares = self.normalised_weights()
        shared = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                  if f.name not in SOURCE_KEYS and f.name not in ("sources", "allow_weight_change")}
        return [MixtureSpec(s.name, share, DataConfig(**shared, **{k: getattr(s, k) for k in SOURCE_KEYS}))
                for s, share in zip(self.sources, shares)]

    def validation_configs(self) -> list[tuple[str, "DataConfig"]]:
        """(name, single-source config) of every source with validation files: ``[("", self)]``
        for the one-source form with validation files, the mixture's sources with some otherwise."""
        if not self.sources:
            return [("", self)] if self.validation_files else []
        return [(m.name, m.data) for m in self.mixture() if m.data.validation_files]


def _finite(x) -> bool:
    """Whether a number is finite as a float (an int too large for a float is not)."""
    try:
        return math.isfinite(x)
    except OverflowError:
        return False


def _as_source(entry, i: int) -> MixtureSource:
    """An entry of ``data.sources`` as a ``MixtureSource`` (a table from Python code is converted)."""
    if isinstance(entry, MixtureSource):
        return entry
    if not isinstance(entry, dict):
        raise ValueError(f"data.sources[{i}] must be a table (name = ..., weight = ..., files = [...]), got "
                         f"{type(entry).__name__} {entry!r}")
    valid = [f.name for f in dataclasses.fields(MixtureSource)]
    unknown = sorted(set(entry) - set(valid))
    if unknown:
        raise ValueError(f"data.sources[{i}] has unknown key {unknown[0]!r}; valid keys of a source: "
                         f"{', '.join(sorted(valid))}")
    return MixtureSource(**entry)
