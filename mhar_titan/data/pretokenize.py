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
batches are identical. A manifest made with another tokenizer is refused. Reading the
format at training time lives in ``mhar_titan.data.manifest`` (this module is only the command).
Bad input (a missing file, an already pretokenized folder, a missing tokenizer file) prints
the problem and exits with status 2.
"""
import hashlib
import json
import time
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from mhar_titan.cli_args import ArgumentParser, run_command
from mhar_titan.data.manifest import FORMAT, MANIFEST, ManifestError
from mhar_titan.files import WriteError, atomic_folder
from mhar_titan.progress import progress


def write_pretokenized(out: Path, shards: Iterable[tuple[str, str, Iterable[np.ndarray]]], tokenizer) -> dict:
    """Write token shards and the manifest.

    Args:
        out: output folder (created).
        shards: per shard ``(source path, source sha256, rows)``, rows being 1-D int arrays.
        tokenizer: anything with ``name``, ``n_vocab``, ``eos_id``.
    Returns the manifest dict.

    All or nothing: written into a temporary sibling folder renamed to ``out`` at the end
    (``mhar_titan.files.atomic_folder``); an earlier pretokenized ``out`` (with a manifest) is
    replaced only then, and an interrupted run leaves ``out`` as it was.

    Raises:
        WriteError: ``out`` is a non-empty folder without a manifest, or the disk is full.
    """
    with atomic_folder(out, replace=(out / MANIFEST).is_file()) as tmp:
        return _write_into(tmp, shards, tokenizer)


def _write_into(out: Path, shards, tokenizer) -> dict:
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


def _text_shards(patterns: list[str], field: str) -> list:
    """Text shards of ``--files``; a pretokenized directory (or any directory) is refused with ManifestError."""
    from mhar_titan.data.sources import _text_shard, expand_files

    paths = expand_files(patterns, "--files")
    for path in paths:
        if (path / MANIFEST).is_file():
            raise ManifestError(f"--files entry {path} is already pretokenized (it holds {MANIFEST}); train from it "
                                f'directly with data.source = "pretokenized" and data.files = ["{path}"], or pass '
                                f"the original parquet/jsonl files to re-tokenize them")
        if path.is_dir():
            raise ManifestError(f"--files entry {path} is a directory; pass parquet/jsonl files or globs such as "
                                f"'{path}/*.parquet'")
    shards = [_text_shard(path, field) for path in paths]
    for shard in shards:
        shard.check()
    return shards


def main(argv=None) -> None:
    """The command line (usage in the module docstring). Bad input: message on stderr, exit status 2."""
    from mhar_titan.config.data import DataConfig
    from mhar_titan.data.sources import DataError
    from mhar_titan.data.tokenizer import TokenizerFileError, build_tokenizer

    parser = ArgumentParser(prog="python -m mhar_titan.data.pretokenize", description=__doc__.splitlines()[0])
    parser.add_argument("--files", nargs="+", required=True,
                        help="source parquet/jsonl files or globs (quote globs); one token shard per file")
    parser.add_argument("--out", type=Path, required=True,
                        help="output folder for shard-NNNNN.bin/.idx.npy and manifest.json (created)")
    parser.add_argument("--tokenizer", default="gpt2", help="tiktoken encoding: gpt2, cl100k_base or o200k_base")
    parser.add_argument("--text-field", default="text", help="column (parquet) or key (jsonl) holding the text")
    parser.add_argument("--tokenizer-cache-dir", default=None,
                        help="tiktoken cache folder (default: $TIKTOKEN_CACHE_DIR; else .cache/tiktoken "
                             "in a checkout, ~/.cache/mhar-titan/tiktoken for an installed copy)")
    args = parser.parse_args(argv)
    try:
        tok = build_tokenizer(DataConfig(tokenizer=args.tokenizer, tokenizer_cache_dir=args.tokenizer_cache_dir))
        shards = _text_shards(args.files, args.text_field)
    except (DataError, TokenizerFileError, ValueError) as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    t0 = time.perf_counter()

    def each():
        for i, shard in enumerate(bar := progress(shards, desc="pretokenize", unit="file")):
            bar.write(f"[{i + 1}/{len(shards)}] {shard.name}")
            yield shard.name, _file_sha256(shard.path), tokenize_rows(shard, tok)

    try:
        m = write_pretokenized(args.out, each(), tok)
    except (DataError, WriteError) as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    n = sum(s["n_tokens"] for s in m["shards"])
    dt = time.perf_counter() - t0
    print(f"wrote {args.out}: {len(m['shards'])} shards, {sum(s['n_docs'] for s in m['shards'])} docs, "
          f"{n:,} {tok.name} tokens ({m['dtype']}) in {dt:.1f} s ({n / dt / 1e6:.2f} M tok/s)")


if __name__ == "__main__":
    run_command(main)
