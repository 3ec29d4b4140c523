"""Sharded safetensors folders: read one tensor at a time, write in size-capped shards.

Layout (the Hugging Face convention): either one ``model.safetensors``, or shards
``model-0000k-of-0000n.safetensors`` plus ``model.safetensors.index.json`` whose
``weight_map`` names the shard of every tensor. Reading is streamed: a shard is opened
(memory-mapped), its tensors are handed out one by one, and it is closed before the next
one is opened, so at most one shard is mapped at any time.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator

import torch

from .hf_config import ConversionError, read_json

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def _safetensors():
    try:
        import safetensors.torch  # noqa: F401
        from safetensors import safe_open
    except ImportError:
        raise ConversionError(
            "reading or writing Hugging Face checkpoints needs the safetensors package: "
            "pip install 'mhar-titan[hf]' (or pip install safetensors)"
        ) from None
    return safe_open


def shard_paths(folder: str | os.PathLike) -> list[Path]:
    """The safetensors files of a checkpoint folder, in shard order.

    Raises:
        ConversionError: no ``model.safetensors`` and no index (the message says what is there
            instead, e.g. ``pytorch_model.bin`` files, which are not read), or an index naming a
            shard that does not exist.
    """
    folder = Path(folder)
    if (folder / INDEX).is_file():
        weight_map = read_json(folder / INDEX).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ConversionError(f"{folder / INDEX} has no weight_map")
        paths = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [str(p) for p in paths if not p.is_file()]
        if missing:
            raise ConversionError(f"{folder / INDEX} names shard(s) that do not exist: {missing}")
        return paths
    if (folder / SINGLE).is_file():
        return [folder / SINGLE]
    found = sorted(p.name for p in folder.glob("*")) if folder.is_dir() else []
    hint = " (only safetensors checkpoints are read; re-save with safe_serialization=True)" if any(
        name.endswith(".bin") for name in found) else ""
    raise ConversionError(
        f"{folder} holds neither {SINGLE} nor {INDEX}{hint}; found: {found[:10] or 'nothing'}"
    )


def iter_tensors(folder: str | os.PathLike) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of the checkpoint, shard by shard.

    Each shard is closed before the next is opened; a yielded tensor is a CPU copy the caller
    may keep or drop. Where safetensors offers it (>= 0.7), tensors are read with ``pread``
    instead of mapping the shard, so only one tensor is in memory at a time."""
    safe_open = _safetensors()
    for path in shard_paths(folder):
        with _open_for_reading(safe_open, path) as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _open_for_reading(safe_open, path: Path):
    try:
        return safe_open(str(path), framework="pt", backend="pread")
    except TypeError:  # safetensors without the backend argument: memory-map the shard
        return safe_open(str(path), framework="pt")


def tensor_names(folder: str | os.PathLike) -> set[str]:
    """Names of every tensor in the checkpoint, read from the headers only."""
    safe_open = _safetensors()
    names: set[str] = set()
    for path in shard_paths(folder):
        with safe_open(str(path), framework="pt") as f:
            names.update(f.keys())
    return names


def _umask_mode() -> int:
    """The mode ``open`` gives a new file under the process umask (0o666 minus the umask)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


class ShardedWriter:
    """Write tensors into shards of at most ``max_shard_bytes`` (a larger tensor gets its own
    shard) plus the index; one shard is held in memory at a time.

    Use ``add(name, tensor)`` for each tensor, then ``close()``. A single shard is written as
    ``model.safetensors`` without an index.
    """

    def __init__(self, folder: str | os.PathLike, max_shard_bytes: int = 5 * 2**30):
        if max_shard_bytes <= 0:
            raise ConversionError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
        _safetensors()
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._written: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + size > self.max_shard_bytes:
            self._flush()
        self._pending[name] = tensor.detach().contiguous().cpu()
        self._pending_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        from safetensors.torch import save_file

        path = self.folder / f"shard-{len(self._written):05d}.tmp"
        save_file(self._pending, str(path), metadata={"format": "pt"})
        os.chmod(path, _umask_mode())  # safetensors creates its files 0600 whatever the umask
        self._written.append((path, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> list[Path]:
        """Write the last shard, name the shards ``model-0000k-of-0000n.safetensors`` and the index."""
        if self._pending or not self._written:
            self._flush()
        n = len(self._written)
        if n == 1:
            final = self.folder / SINGLE
            os.replace(self._written[0][0], final)
            return [final]
        weight_map, paths = {}, []
        for k, (tmp, names) in enumerate(self._written, start=1):
            final = self.folder / f"model-{k:05d}-of-{n:05d}.safetensors"
            os.replace(tmp, final)
            paths.append(final)
            weight_map.update({name: final.name for name in names})
        with open(self.folder / INDEX, "w") as f:
            json.dump({"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}, f, indent=2)
        return paths
