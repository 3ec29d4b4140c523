"""Tokenize text files once into memory-mapped token shards that later runs read directly.

Usage::

    python -m mhar_titan.data.pretokenize --files "data/shakespeare/train-*.parquet" \\
        --out data/shakespeare-gpt2/train [--tokenizer gpt2] [--text-field text] [--tokenizer-cache-dir DIR]

Each source file (parquet or jsonl) becomes ``shard-NNNNN.bin`` (the token ids of all
its rows back to back, uint16 when the vocabulary fits, else uint32) and
``shard-NNNNN.idx.npy`` (int64 row offsets, length rows + 1; an empty or invalid
document is a zero-length row, so row numbers match the source). ``manifest.json``
holds the format, the tokenizer name, vocabulary size and EOS id, and per shard its
files, token/row counts, source path and source SHA-256.

Train with ``data.source = "pretokenized"`` and ``data.files = ["data/shakespeare-gpt2/train"]``;
the stream (shuffling, packing, sharding) is the same as on the fly, so the token
batches are identical. A manifest made with another tokenizer is refused.
"""
import argparse
import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

FORMAT = "mhar-titan-tokens/1"
MANIFEST = "manifest.json"


class ManifestError(ValueError):
    """A pretokenized directory that is missing, incomplete or made with another tokenizer."""


class PretokenizedShard:
    """One token shard: row i is ``tokens[offsets[i]:offsets[i+1]]`` of a memory-mapped file."""

    def __init__(self, origin: Path, tokens: Path, offsets: Path, dtype: str, n_tokens: int, name: str):
        self.origin, self.tokens_path, self.offsets_path = origin, tokens, offsets
        self.dtype, self.n_tokens, self.name = dtype, n_tokens, name

    def check(self) -> None:
        size = self.tokens_path.stat().st_size if self.tokens_path.exists() else -1
        if size != self.n_tokens * np.dtype(self.dtype).itemsize:
            raise ManifestError(f"token file {self.tokens_path} has {size} bytes, the manifest says "
                                f"{self.n_tokens} {self.dtype} tokens; re-run python -m mhar_titan.data.pretokenize")

    def rows(self, start: int = 0) -> Iterator[np.ndarray]:
        offsets = np.load(self.offsets_path)
        tokens = np.memmap(self.tokens_path, dtype=self.dtype, mode="r", shape=(self.n_tokens,))
        for i in range(start, len(offsets) - 1):
            yield np.asarray(tokens[offsets[i]:offsets[i + 1]], dtype=np.int64)


@dataclass
class Pretokenized:
    """A loaded manifest: tokenizer identity and shards in order."""

    tokenizer: str
    n_vocab: int
    eos_id: int
    shards: list


def load_pretokenized(directory: Path) -> Pretokenized:
    """Read ``directory/manifest.json``. Raises ManifestError for a missing or malformed manifest."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise ManifestError(f"{directory} is not a pretokenized directory: no {MANIFEST}; create it with "
                            f"python -m mhar_titan.data.pretokenize --files ... --out {directory}")
    m = json.loads(path.read_text())
    if m.get("format") != FORMAT:
        raise ManifestError(f"{path}: format {m.get('format')!r}, expected {FORMAT!r}; re-run pretokenize")
    d = Path(directory).resolve()
    shards = [PretokenizedShard(d, d / s["tokens"], d / s["offsets"], m["dtype"], s["n_tokens"],
                                f"{d / s['tokens']} (from {s['source']})") for s in m["shards"]]
    return Pretokenized(m["tokenizer"], m["n_vocab"], m["eos_id"], shards)


def check_tokenizer(directory: Path, tokenizer) -> None:
    """Refuse pretokenized data made with another tokenizer than ``tokenizer``."""
    p = load_pretokenized(directory)
    if (p.tokenizer, p.n_vocab, p.eos_id) != (tokenizer.name, tokenizer.n_vocab, tokenizer.eos_id):
        raise ManifestError(
            f"pretokenized data {directory} was made with tokenizer {p.tokenizer!r} (n_vocab {p.n_vocab}, eos "
            f"{p.eos_id}) but this run uses {tokenizer.name!r} (n_vocab {tokenizer.n_vocab}, eos "
            f"{tokenizer.eos_id}); set data.tokenizer = {p.tokenizer!r} or re-run python -m "
            f"mhar_titan.data.pretokenize --tokenizer {tokenizer.name} into a new folder")


def write_pretokenized(out: Path, shards: Iterable[tuple[str, str, Iterable[np.ndarray]]], tokenizer) -> dict:
    """Write token shards and the manifest.

    Args:
        out: output folder (created).
        shards: per shard ``(source path, source sha256, rows)``, rows being 1-D int arrays.
        tokenizer: anything with ``name``, ``n_vocab``, ``eos_id``.
    Returns the manifest dict.
    """
    out.mkdir(parents=True, exist_ok=True)
    dtype = "uint16" if tokenizer.n_vocab <= 2 ** 16 else "uint32"
    entries = []
    for k, (source, digest, rows) in enumerate(shards):
        tokens_name, offsets_name = f"shard-{k:05d}.bin", f"shard-{k:05d}.idx.npy"
        offsets = [0]
        with open(out / tokens_name, "wb") as f:
            for row in rows:
                arr = np.asarray(row, dtype=dtype)
                f.write(arr.tobytes())
                offsets.append(offsets[-1] + len(arr))
        np.save(out / offsets_name, np.asarray(offsets, dtype=np.int64))
        entries.append({"tokens": tokens_name, "offsets": offsets_name, "source": source, "source_sha256": digest,
                        "n_docs": len(offsets) - 1, "n_tokens": offsets[-1]})
    manifest = {"format": FORMAT, "tokenizer": tokenizer.name, "n_vocab": tokenizer.n_vocab,
                "eos_id": tokenizer.eos_id, "dtype": dtype, "shards": entries}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def tokenize_rows(shard, tokenizer) -> Iterator[np.ndarray]:
    """Token ids of every row of a text shard; empty or invalid documents become empty rows."""
    from mhar_titan.data.stream import clean_document

    for row, value in enumerate(shard.rows(0)):
        text = clean_document(value, shard.name, row, {})
        yield np.asarray(tokenizer.encode(text) if text is not None else [], dtype=np.int64)


def main(argv=None) -> None:
    from mhar_titan.data.config import DataConfig
    from mhar_titan.data.sources import _local_shards
    from mhar_titan.data.tokenizer import build_tokenizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", nargs="+", required=True, help="parquet/jsonl paths or globs")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokenizer", default="gpt2")
    parser.add_argument("--text-field", default="text")
    parser.add_argument("--tokenizer-cache-dir", default=None)
    args = parser.parse_args(argv)
    tok = build_tokenizer(DataConfig(tokenizer=args.tokenizer, tokenizer_cache_dir=args.tokenizer_cache_dir))
    shards = _local_shards(args.files, args.text_field, "--files")
    t0 = time.perf_counter()

    def each():
        for i, shard in enumerate(shards):
            print(f"[{i + 1}/{len(shards)}] {shard.name}", flush=True)
            yield shard.name, _file_sha256(shard.path), tokenize_rows(shard, tok)

    m = write_pretokenized(args.out, each(), tok)
    n = sum(s["n_tokens"] for s in m["shards"])
    dt = time.perf_counter() - t0
    print(f"wrote {args.out}: {len(m['shards'])} shards, {sum(s['n_docs'] for s in m['shards'])} docs, "
          f"{n:,} {tok.name} tokens ({m['dtype']}) in {dt:.1f} s ({n / dt / 1e6:.2f} M tok/s)")


if __name__ == "__main__":
    main()
