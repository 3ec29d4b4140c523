"""Optimizer step time, Muon with AdamW against AdamW alone, and Muon's modelled communication.

Measured: ``optimizer.step()`` of ``mhar_titan.optim.build_optimizer`` on one process without FSDP
(plain tensors: no all-gather) for a flavor's model on CPU in fp32, with random gradients; the
median of ``--reps`` steps after one warm-up step (which allocates the state). Modelled: the bytes
Muon's all-gathers receive per rank per step (``optim.muon_comm_bytes``) at ``--comm-flavor`` on
``--comm-world`` FSDP ranks in bf16 (its CUDA arithmetic), beside one bf16 all-gather of the whole
model (what FSDP2 gathers once per forward, for scale).

    python bench/optimizer.py --flavor 100m --reps 1            # prints a table for docs/benchmarks-log.md
    python bench/optimizer.py --flavor debug --reps 2            # toy size (the test runs this)

State the load (``uptime``) beside the numbers: step times on a shared machine move with it.
"""
from __future__ import annotations

import argparse
import math
import os
import pathlib
import statistics
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mhar_titan.config import Optimizer, load_config  # noqa: E402
from mhar_titan.dryrun import build_meta_model, build_model_args  # noqa: E402
from mhar_titan.models.model import Transformer  # noqa: E402
from mhar_titan.optim import build_optimizer, muon_comm_bytes, optimizer_split  # noqa: E402

CONFIGS = {"debug": "debug_mhar.toml", "100m": "mhar_100m.toml", "350m": "mhar_350m.toml", "1b": "mhar_1b.toml"}


def model_args(flavor: str):
    return build_model_args(load_config(str(ROOT / "train_configs" / CONFIGS[flavor])))


def step_seconds(model: torch.nn.Module, settings: Optimizer, reps: int) -> tuple[list[float], list[float]]:
    """(wall seconds, CPU seconds of this process) of each of ``reps`` optimizer steps (after a warm-up
    step) with fixed random gradients. On a shared machine the CPU seconds move less with the load."""
    gen = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen) * 1e-3
    opt = build_optimizer(model, settings)
    opt.step()
    times, cpu = [], []
    for _ in range(reps):
        start, start_cpu = time.perf_counter(), time.process_time()
        opt.step()
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return times, cpu


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="100m", choices=sorted(CONFIGS))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--ns-dtypes", default="float32",
                        help="Newton-Schulz dtypes to time, comma-separated (float32, bfloat16: slow on most CPUs)")
    parser.add_argument("--comm-flavor", default="1b", choices=sorted(CONFIGS))
    parser.add_argument("--comm-world", type=int, default=8)
    a = parser.parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = Transformer(model_args(a.flavor))
    n = sum(p.numel() for p in model.parameters())
    rows = []
    settings_list = [("AdamW (foreach)", Optimizer(name="AdamW"))]
    settings_list += [(f"Muon ({dtype} Newton-Schulz) + AdamW", Optimizer(name="Muon", muon_ns_dtype=dtype))
                      for dtype in a.ns_dtypes.split(",")]
    for label, settings in settings_list:
        split = optimizer_split(model, settings)
        times, cpu = step_seconds(model, settings, a.reps)
        rows.append((label, len(split["Muon"]), statistics.median(times), min(times), max(times),
                     statistics.median(cpu)))
    load = os.getloadavg()
    print(f"optimizer step, {a.flavor} ({n / 1e6:.1f} M parameters), one process, CPU fp32, {a.threads} thread(s), "
          f"median of {a.reps} (min-max); load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}")
    print("| optimizer | Muon matrices | step, wall (s) | min-max (s) | step, CPU (s) | CPU vs AdamW |")
    print("|---|---|---|---|---|---|")
    for label, k, med, lo, hi, cpu in rows:
        print(f"| {label} | {k} | {med:.3f} | {lo:.3f}-{hi:.3f} | {cpu:.3f} | {cpu / rows[0][5]:.1f}x |")
    meta = build_meta_model(model_args(a.comm_flavor))
    shapes = [s for _, s in optimizer_split(meta, Optimizer(name="Muon"))["Muon"]]
    comm = muon_comm_bytes(shapes, a.comm_world, "bfloat16")
    total = sum(p.numel() for p in meta.parameters())
    gather = total * (a.comm_world - 1) * 2 // a.comm_world
    print(f"\nMuon all-gather at {a.comm_flavor} on {a.comm_world} FSDP ranks (modelled, bf16): {len(shapes)} matrices, "
          f"{sum(math.prod(s) for s in shapes) / 1e6:.1f} M elements, {comm / 2**30:.2f} GiB received per rank per "
          f"step; one bf16 all-gather of all {total / 1e6:.0f} M parameters: {gather / 2**30:.2f} GiB")
    return 0


if __name__ == "__main__":
    from mhar_titan.cli_args import run_command

    run_command(main)
