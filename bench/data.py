"""Data loader throughput: tokenize + pack + collate, in tokens/s, for 1 process and N workers.

Usage::

    python -m mhar_titan.data.prepare_shakespeare --out data/shakespeare   # once
    python bench/data.py [--data data/shakespeare] [--seq-len 2048] [--batch 8] [--tokens 3000000] [--workers 0 1 2]

Each row iterates the train loader until ``--tokens`` input tokens have been
delivered (the ~1.5 M-token Shakespeare training split wraps into new epochs) and
reports the rate including worker start-up. Rows: window sharding (every worker
tokenizes the whole stream), document sharding with 0..N workers, pretokenized
shards, and raw ``encode_ordinary`` for reference. Target: ~0.5 M tokens/s feeds a
100M-parameter model on one H200.
"""
import argparse
import os
import platform
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq

from mhar_titan.data import DataConfig, build_tokenizer, build_train_loader
from mhar_titan.data.pretokenize import main as pretokenize_main


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=Path("data/shakespeare"))
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=3_000_000)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()
    files = sorted(str(p) for p in args.data.glob("train-*.parquet"))
    if not files:
        raise SystemExit(f"no train-*.parquet in {args.data}: run python -m mhar_titan.data.prepare_shakespeare "
                         f"--out {args.data}")
    tok = build_tokenizer(DataConfig(tokenizer="gpt2"))
    texts = [t for f in files for t in pq.read_table(f, columns=["text"]).column(0).to_pylist()]
    t0 = time.perf_counter()
    n_raw = sum(len(tok.encode(t)) for t in texts)
    raw = n_raw / (time.perf_counter() - t0)

    rows = [("tiktoken encode_ordinary only (1 thread)", raw)]
    for w in args.workers:
        rows.append((f"window sharding, {w} workers", rate(DataConfig(files=files, sharding="window", num_workers=w), tok, args)))
    for w in args.workers:
        rows.append((f"document sharding, {w} workers",
                     rate(DataConfig(files=files, sharding="document", num_workers=w), tok, args)))
    with tempfile.TemporaryDirectory() as tmp:
        pretokenize_main(["--files", *files, "--out", tmp, "--tokenizer", "gpt2"])
        rows.append(("pretokenized, window sharding, 0 workers",
                     rate(DataConfig(source="pretokenized", files=[tmp], sharding="window"), tok, args)))

    print(f"\nmachine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores; corpus "
          f"{n_raw:,} gpt2 tokens; seq_len {args.seq_len}, local batch {args.batch}, {args.tokens:,} tokens per row")
    print("| loader | tokens/s |\n|---|---:|")
    for name, r in rows:
        print(f"| {name} | {r / 1e6:.2f} M |")


if __name__ == "__main__":
    main()
