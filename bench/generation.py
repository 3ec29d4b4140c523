"""Generation speed: seconds for N new greedy tokens with the KV cache and without it.

Builds a freshly initialised model of a flavor and family (no checkpoint is read: model load
is not timed), feeds a fixed random prompt of --prompt tokens and times `generate` for --tokens
new tokens with the cache and with `use_cache=False` (each step re-runs the prefix), after one
untimed warm-up call of each, and prints a markdown table row per family with the speed-up.
Both paths produce the same greedy tokens (checked here; tests/test_kv_cache.py checks logits).

    python bench/generation.py                              # debug flavor, MHAR H=8, CPU
    python bench/generation.py --families baseline,"mhar H=8" --threads 1 --append docs/benchmarks-log.md
"""
from __future__ import annotations

import datetime
import os
import pathlib
import platform
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mhar_titan.eval.generation import generate  # noqa: E402
from mhar_titan.cli_args import ArgumentParser, device, positive_int, run_command  # noqa: E402
from mhar_titan.files import write_text  # noqa: E402
from mhar_titan.models.args import FAMILIES, ModelArgs  # noqa: E402
from mhar_titan.models.model import Transformer  # noqa: E402

SECTION = "## Generation"


def seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(flavor: str, family: str, prompt_len: int, new: int, device: str) -> dict:
    torch.manual_seed(0)
    model = Transformer(ModelArgs.from_flavor(flavor, **FAMILIES[family])).to(device)
    model.init_weights()
    model.eval()
    prompt = torch.randint(0, 50_000, (prompt_len,), generator=torch.Generator().manual_seed(1)).tolist()
    run = {cache: (lambda cache=cache: generate(model, prompt, new, use_cache=cache)) for cache in (True, False)}
    tokens = {cache: f().tolist() for cache, f in run.items()}  # warm-up, and the tokens to compare
    if tokens[True] != tokens[False]:
        raise SystemExit(f"{family}: greedy tokens differ with and without the cache")
    timed = {cache: seconds(f) for cache, f in run.items()}
    return dict(family=family, cached=timed[True], uncached=timed[False])


def table(rows: list[dict], flavor: str, prompt_len: int, new: int) -> str:
    head = (f"Seconds for {new} new greedy tokens after a {prompt_len}-token prompt, `{flavor}` flavor "
            f"(`bench/generation.py`; {datetime.date.today()}, {platform.processor() or platform.machine()}, "
            f"{os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads).\n\n"
            "| family | KV cache, s | no cache, s | speed-up |\n|---|---:|---:|---:|")
    lines = [f"| {r['family']} | {r['cached']:.2f} | {r['uncached']:.2f} | {r['uncached'] / r['cached']:.1f}x |"
             for r in rows]
    return "\n".join([head, *lines])


def append(path: pathlib.Path, text: str) -> None:
    """Append `text` under the generation section of the lab notebook (docs/benchmarks-log.md; created at
    the end if absent)."""
    content = path.read_text()
    if SECTION not in content:
        content = content.rstrip("\n") + f"\n\n{SECTION}\n\nWritten by `bench/generation.py`.\n"
    start = content.index(SECTION)
    nxt = content.find("\n## ", start + len(SECTION))
    end = len(content) if nxt == -1 else nxt
    title = f"\n### Run of {datetime.date.today()}\n\n"
    write_text(path, content[:end].rstrip("\n") + "\n" + title + text + "\n" + content[end:])


def main(argv=None) -> None:
    p = ArgumentParser(prog="python bench/generation.py", description=__doc__.splitlines()[0])
    p.add_argument("--flavor", default="debug")
    p.add_argument("--families", default="mhar H=8", help=f"comma list of {', '.join(FAMILIES)}")
    p.add_argument("--prompt", type=positive_int, default=256, help="prompt tokens")
    p.add_argument("--tokens", type=positive_int, default=40, help="new tokens")
    p.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--device", type=device, default="cpu", help="cpu, cuda, cuda:N or mps")
    p.add_argument("--append", type=pathlib.Path, default=None,
                   help="append the table to this notebook (docs/benchmarks-log.md)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        raise SystemExit(f"unknown families {unknown}; choose from {list(FAMILIES)}")
    rows = [measure(args.flavor, f, args.prompt, args.tokens, args.device) for f in families]
    text = table(rows, args.flavor, args.prompt, args.tokens)
    print(text)
    if args.append:
        append(args.append, text)


if __name__ == "__main__":
    run_command(main)
