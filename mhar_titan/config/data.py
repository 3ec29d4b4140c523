"""``DataConfig``: the ``[data]`` section of a training TOML.

Plain types only (str, int, float, bool, list[str], Optional[...]): the job
config parser type-checks TOML values against these annotations. Value checks
that the parser cannot do (choices, ranges) run in ``__post_init__`` and raise
``ValueError`` naming the field.
"""
import json
from dataclasses import dataclass, field
from typing import Optional

SOURCES = ("hub", "local", "pretokenized")
SHARDINGS = ("window", "document")


@dataclass
class DataConfig:
    """Where the training text comes from, how it is tokenized, sharded and loaded."""

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

    hub_retries: int = 5
    """Attempts for each hub request (opening the stream, reopening a shard) before giving up."""

    hub_retry_backoff_s: float = 2.0
    """First wait between attempts in seconds; doubles after each failure (capped at 60 s)."""

    hub_retry_max_s: float = 120.0
    """Seconds after which opening the hub stream starts no further attempt: the run then stops
    (exit 2) naming the dataset and the local-files settings (one attempt may take longer:
    ``huggingface_hub`` retries a connection on its own)."""

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

    tokenizer: str = "gpt2"
    """tiktoken encoding name: "gpt2" (small runs), "cl100k_base" (paper flavors), "o200k_base"; or
    "bytes" (UTF-8 bytes as ids 0-255, EOS 256: a 257-id vocabulary for small CPU studies)."""

    tokenizer_file: Optional[str] = None
    """Local encoding file(s) to use instead of the cache: a ``.tiktoken`` (or ``.tiktoken.gz``)
    rank file, or for "gpt2" a directory holding ``encoder.json`` and ``vocab.bpe``.
    Checked against tiktoken's published SHA-256."""

    tokenizer_cache_dir: Optional[str] = None
    """tiktoken cache folder; None = $TIKTOKEN_CACHE_DIR, else <repo>/.cache/tiktoken.
    Fill it with ``python -m mhar_titan.data.prepare_tokenizer``."""

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
        for name in ("files", "validation_files", "hub_data_files"):
            value = getattr(self, name)
            if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
                example = json.dumps([value]) if isinstance(value, str) else '["data/train-*.parquet"]'
                raise ValueError(f"data.{name} must be a list of strings (paths or globs), got "
                                 f"{type(value).__name__} {value!r}; write data.{name} = {example}")
            setattr(self, name, list(value))
        if self.source not in SOURCES:
            raise ValueError(f"data.source must be one of {SOURCES}, got {self.source!r}")
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
