"""Data loader throughput: tokenize + pack + collate, in tokens/s, for 1 process and N workers.

Usage::

    python -m mhar_titan.data.prepare_shakespeare --out data/shakespeare   # once
    python bench/data.py [--data data/shakespeare] [--seq-len 2048] [--batch 8] [--tokens 3000000] [--workers 0 1 2] \\
        [--long-chars 8000000] [--append docs/benchmarks-log.md]

Each row iterates the train loader until ``--tokens`` input tokens have been
delivered (the ~1.5 M-token Shakespeare training split wraps into new epochs) and
reports the rate including worker start-up. Rows: window sharding (every worker
tokenizes the whole stream), document sharding with 0..N workers, pretokenized
shards, the pretokenize command itself, and raw ``encode_ordinary`` for reference.
Long-document rows: the same loaders on a parquet whose documents are each
``--long-chars`` characters long (the corpus repeated; one document per worker so
document sharding has one for each), with the ratio to the matching corpus row
(1.0 = document length does not matter; FineWeb-Edu holds documents of millions
of characters).
Target: ~0.5 M tokens/s feeds a 100M-parameter model on one H200. ``--append FILE``
adds the table, with the command, machine (CPU model, cores, load), library versions
and date, at the end of the "## Data loader" section of FILE (created if missing).
"""
import datetime
import os
import platform
import shlex
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from mhar_titan.data import DataConfig, build_tokenizer, build_train_loader
from mhar_titan.cli_args import ArgumentParser, non_negative_int, positive_int, run_command
from mhar_titan.data.pretokenize import main as pretokenize_main
from mhar_titan.files import write_text


def rate(cfg: DataConfig, tok, args) -> float:
    loader = build_train_loader(cfg, tok, dp_rank=0, dp_world=1, local_batch_size=args.batch,
                                seq_len=args.seq_len, seed=0)
    per_batch = args.batch * args.seq_len
    n = max(1, args.tokens // per_batch)
    t0 = time.perf_counter()
    for k, _ in enumerate(loader):
        if k + 1 == n:
            break
    return n * per_batch / (time.perf_counter() - t0)


def long_document_rows(texts: list[str], corpus: dict, folder: Path, tok, args) -> list[tuple]:
    """Rows for documents of ``args.long_chars`` characters: (name, tokens/s, ratio to the corpus row)."""
    text = "\n".join(texts)
    doc = (text * (args.long_chars // len(text) + 1))[:args.long_chars]
    n_docs = max([1, *args.workers])  # document sharding gives each worker whole documents
    path = folder / "long.parquet"
    pq.write_table(pa.table({"text": [doc] * n_docs}), path)
    rows = []
    for (sharding, w), base in corpus.items():
        r = rate(DataConfig(files=[str(path)], sharding=sharding, num_workers=w), tok, args)
        rows.append((f"{n_docs} document(s) of {args.long_chars / 1e6:g} M characters, {sharding} sharding, "
                     f"{w} workers", r, r / base))
    return rows


SECTION = "## Data loader"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe_run(argv: list[str], corpus_tokens: int, args) -> str:
    """Command, machine, versions and date of this run (markdown lines)."""
    libs = ", ".join(f"{name} {version(name)}" for name in ("torch", "torchdata", "tiktoken", "datasets", "pyarrow"))
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    return (f"Command: `python bench/data.py {shlex.join(argv)}`  \n"
            f"Machine: {cpu_model()}, {os.cpu_count()} CPU cores (load average {load} at the end), "
            f"{platform.system()} {platform.release()}  \n"
            f"Versions: Python {platform.python_version()}, {libs}  \n"
            f"Date: {datetime.datetime.now().isoformat(timespec='minutes')}. Corpus {args.data}: "
            f"{corpus_tokens:,} gpt2 tokens; seq_len {args.seq_len}, local batch {args.batch}, {args.tokens:,} "
            f"delivered input tokens per loader row (rates include worker start-up).")


def append_section(path: Path, text: str, title: str) -> None:
    """Append ``### title`` + ``text`` at the end of the data-loader section of ``path`` (other sections untouched)."""
    content = path.read_text() if path.exists() else "# Benchmarks\n"
    if SECTION not in content:
        content = content.rstrip("\n") + f"\n\n{SECTION}\n\nWritten by `bench/data.py --append`.\n"
    start = content.index(SECTION)
    nxt = content.find("\n## ", start + len(SECTION))
    end = len(content) if nxt == -1 else nxt
    content = content[:end].rstrip("\n") + f"\n\n### {title}\n\n{text}\n" + content[end:]
    write_text(path, content)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = ArgumentParser(prog="python bench/data.py", description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=Path("data/shakespeare"),
                        help="folder with train-*.parquet (python -m mhar_titan.data.prepare_shakespeare --out DIR)")
    parser.add_argument("--seq-len", type=positive_int, default=2048, help="tokens per training sequence")
    parser.add_argument("--batch", type=positive_int, default=8, help="local batch size (sequences per batch)")
    parser.add_argument("--tokens", type=positive_int, default=3_000_000, help="input tokens delivered per loader row")
    parser.add_argument("--workers", type=non_negative_int, nargs="+", default=[0, 1, 2], help="loader worker counts to measure")
    parser.add_argument("--long-chars", type=positive_int, default=8_000_000,
                        help="characters per document of the long-document rows (0 = no such rows)")
    parser.add_argument("--append", type=Path, default=None,
                        help="append the table with command, machine, versions and date to this notebook "
                             "(docs/benchmarks-log.md)")
    args = parser.parse_args(argv)
    files = sorted(str(p) for p in args.data.glob("train-*.parquet"))
    if not files:
        raise SystemExit(f"no train-*.parquet in {args.data}: run python -m mhar_titan.data.prepare_shakespeare "
                         f"--out {args.data}")
    tok = build_tokenizer(DataConfig(tokenizer="gpt2"))
    texts = [t for f in files for t in pq.read_table(f, columns=["text"]).column(0).to_pylist()]
    t0 = time.perf_counter()
    n_raw = sum(len(tok.encode(t)) for t in texts)
    raw = n_raw / (time.perf_counter() - t0)

    rows = [("tiktoken `encode_ordinary` only (1 thread)", raw)]
    corpus = {}
    for sharding in ("window", "document"):
        for w in args.workers:
            corpus[sharding, w] = rate(DataConfig(files=files, sharding=sharding, num_workers=w), tok, args)
            rows.append((f"{sharding} sharding, {w} workers", corpus[sharding, w]))
    with tempfile.TemporaryDirectory() as tmp:
        if args.long_chars > 0:
            rows += long_document_rows(texts, corpus, Path(tmp), tok, args)
        t0 = time.perf_counter()
        tokens = str(Path(tmp) / "pretokenized")  # its own folder: pretokenize writes it whole or not at all
        pretokenize_main(["--files", *files, "--out", tokens, "--tokenizer", "gpt2"])
        pretokenize_rate = n_raw / (time.perf_counter() - t0)
        rows.append(("pretokenized (`python -m mhar_titan.data.pretokenize`), window sharding, 0 workers",
                     rate(DataConfig(source="pretokenized", files=[tokens], sharding="window"), tok, args)))
        rows.append(("`pretokenize` command itself (tokenize + write)", pretokenize_rate))

    table = "\n".join(["| loader | tokens/s | vs corpus |", "|---|---:|---:|"] + [
        f"| {row[0]} | {row[1] / 1e6:.3g} M | {f'{row[2]:.2f}' if len(row) > 2 else ''} |" for row in rows])
    text = describe_run(argv, n_raw, args) + "\n\n" + table
    print("\n" + text)
    if args.append:
        append_section(args.append, text, f"Run of {datetime.date.today().isoformat()} ({os.cpu_count()} cores)")
        print(f"appended to {args.append}")


if __name__ == "__main__":
    run_command(main)
