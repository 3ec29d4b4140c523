"""Host time of one whole training step (forward, backward, gradient clipping, AdamW step) beside
the modelled GPU time of the same step on an H200, and the verdict per micro-batch.

Each row builds the model of a scale with its real depth, heads and routing plan (100m: 12 layers,
1b: 36; so the same ops run in the same number) but tiny tensors (d = 8 per attention head, FFN
width d, vocabulary 256, 1 x 8 tokens, bf16, CPU), and stubs every routing kernel launch
(`routing_harness.stubbed_launches`; MHAR runs `routing_kernel="triton"`, the fused path's host
code). What is timed is the host work of the step plus the CPU kernels of tensors of a few
hundred elements: an upper bound on the host time the same step costs on a GPU less the CUDA
driver's own launch cost (a few us per kernel, not in this number). Torch runs on one CPU thread
(`--threads`), as a GPU step's host work does, and with Python's automatic garbage collection off
inside the timed steps, as in the trainer's loop (a full collection inside a step took about 200 ms
here, once every ten steps). The step is the trainer's:
`optim.build_optimizer` (AdamW, the [optimizer] defaults), `optim.clip_grad_norm_by_group`
(max norm 1), the chunked cross-entropy loss.

Beside it, `mhar_titan.components.performance.modelled_gpu_ms` at micro-batch 2 / 4 / 8 / 16
(sequence 1024 at 1b, 2048 at 100m): model FLOPs at a stated MFU and the counted routing bytes
at a stated bandwidth (a model, not a measurement), and the verdict: host-bound when the host
time exceeds the GPU time (the GPU waits), by the ratio of the two.

    python bench/step_host.py                        # 100m and 1b, three families, AC none and full
    python bench/step_host.py --scales 1b --repeats 40 --json
    python bench/step_host.py --append docs/benchmarks-log.md
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import pathlib
import statistics
import sys

import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # the stubbed fused path on CPU tensors

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from mhar_titan.components.performance import (MICRO_BATCHES, STEP_SEQ, host_family, modelled_gpu_ms,  # noqa: E402
                                               verdict)
from mhar_titan.config import Optimizer  # noqa: E402
from mhar_titan.models.args import FAMILIES as MODEL_FAMILIES, ModelArgs  # noqa: E402
from mhar_titan.models.cross_entropy import chunked_linear_cross_entropy  # noqa: E402
from mhar_titan.models.model import Transformer  # noqa: E402
from mhar_titan.optim import build_optimizer, clip_grad_norm_by_group  # noqa: E402
from mhar_titan.parallel import apply_ac  # noqa: E402
from routing_harness import host_timer, stubbed_launches  # noqa: E402
from tables import append_section, write_table  # noqa: E402

FAMILIES = {"baseline": MODEL_FAMILIES["baseline"], "mhar": dict(MODEL_FAMILIES["mhar H=8"], routing_kernel="triton"),
            "mhar-grouped": dict(MODEL_FAMILIES["mhar H=8"], routing_kernel="triton", routing_group_size="auto")}
HEAD_DIM = 8  # tiny tensors: d = 8 per attention head
TOKENS = (1, 8)  # batch, sequence of the timed step


def tiny_args(scale: str, family: str) -> ModelArgs:
    """`scale`'s flavor (depth, heads, routing plan) with tiny tensors (module docstring)."""
    heads = ModelArgs.from_flavor(scale).n_heads
    d = HEAD_DIM * heads
    return ModelArgs.from_flavor(scale, **FAMILIES[family], dim=d, ffn_dim=d, vocab_size=256, max_seq_len=64)


def training_step(scale: str, family: str, ac: str):
    """One whole training step of `scale` / `family` with activation checkpointing `ac` (module
    docstring), as a function of no arguments; the model, optimizer and tokens are built here."""
    args = tiny_args(scale, family)
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    model.to(torch.bfloat16)
    apply_ac(model, argparse.Namespace(mode=ac, selective_ac_option="1", preserve_rng_state=False))
    opt = build_optimizer(model, Optimizer())
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, args.vocab_size, (TOKENS[0], TOKENS[1] + 1), generator=gen)

    def step():
        loss = model(tokens[:, :-1], tokens[:, 1:], loss_fn=chunked_linear_cross_entropy) / tokens[:, 1:].numel()
        loss.backward()
        clip_grad_norm_by_group(model, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def host_step_ms(scale: str, families, ac: str, repeats: int = 20, warmup: int = 3) -> dict:
    """Host time (ms) of one whole training step of `scale` for each of `families` with
    activation checkpointing `ac`: {family: {'min', 'median'}} over `repeats` steps after
    `warmup`. The families' steps take turns (one step of each per repeat), so that a change of
    the machine's load falls on all of them alike."""
    steps = {family: training_step(scale, family, ac) for family in families}
    times = {family: [] for family in families}
    gc.collect()
    gc.disable()  # as the trainer's loop: no automatic collection inside a step (mhar_titan/train.py)
    try:
        with stubbed_launches():
            for _ in range(warmup):
                for step in steps.values():
                    step()
            for _ in range(repeats):
                for family, step in steps.items():
                    times[family].append(host_timer(step))
                gc.collect(1)  # between timed steps, as the trainer collects every training.gc_freq steps
    finally:
        gc.enable()
    return {family: dict(min=min(t), median=statistics.median(t)) for family, t in times.items()}


def rows(scales, families, acs, repeats: int) -> list[dict]:
    out = []
    for scale in scales:
        for ac in acs:
            host = host_step_ms(scale, families, ac, repeats)
            for family in families:
                real = ModelArgs.from_flavor(scale, **FAMILIES[family])
                gpu = {mb: modelled_gpu_ms(real, mb, STEP_SEQ[scale], ac) for mb in MICRO_BATCHES}
                out.append(dict(scale=scale, family=family, ac=ac, host_min=host[family]["min"],
                                host_median=host[family]["median"], gpu={mb: g["total_ms"] for mb, g in gpu.items()}))
    return out


def table(result: list[dict], repeats: int, threads: int = 1) -> str:
    load = os.getloadavg()
    first = modelled_gpu_ms(ModelArgs.from_flavor("1b"), 1, 1024, "none")
    lines = [
        f"Whole training step, host time measured (`python bench/step_host.py`, {repeats} steps, minimum and "
        f"median; real depth and routing plan, tiny tensors, routing kernel launches stubbed, CPU "
        f"{os.cpu_count()} cores, {threads} torch thread(s), load average {load[0]:.2f} / {load[1]:.2f}, torch {torch.__version__}, "
        f"{datetime.date.today().isoformat()}), beside the GPU time of the same step on one H200, modelled "
        f"(`performance.modelled_gpu_ms`: model FLOPs at {100 * first['mfu']:.0f}% of "
        f"{first['peak'] / 1e12:.0f} TFLOP/s, AC full recomputing the blocks' forward, plus the counted "
        f"routing bytes at {first['bandwidth'] / 1e12:.1f} TB/s; a model, not a measurement) at micro-batch "
        f"{' / '.join(map(str, MICRO_BATCHES))} (sequence {STEP_SEQ['100m']} at 100m, {STEP_SEQ['1b']} at 1b). "
        "Verdict per micro-batch: host-bound (the GPU waits) when host (minimum) > GPU, by host / GPU; "
        "else GPU-bound, by GPU / host.",
        "",
        "| scale | AC | family | host ms min | host ms median | vs baseline (min) | "
        + " | ".join(f"GPU ms mb {mb} (model)" for mb in MICRO_BATCHES) + " | "
        + " | ".join(f"verdict mb {mb}" for mb in MICRO_BATCHES) + " |",
        "|---|---|---|---:|---:|---:|" + "---:|" * len(MICRO_BATCHES) + "---|" * len(MICRO_BATCHES),
    ]
    for r in result:
        base = next((x for x in result if x["scale"] == r["scale"] and x["ac"] == r["ac"]
                     and x["family"] == "baseline"), None)
        ratio = f"{r['host_min'] / base['host_min']:.2f}x" if base else "-"
        verdicts = [verdict(r["host_min"], r["gpu"][mb]) for mb in MICRO_BATCHES]
        lines.append(f"| {r['scale']} | {r['ac']} | {r['family']} | {r['host_min']:.1f} | {r['host_median']:.1f} | "
                     f"{ratio} | " + " | ".join(f"{r['gpu'][mb]:.1f}" for mb in MICRO_BATCHES) + " | "
                     + " | ".join(f"{v['bound']} {v['by']:.2f}x" for v in verdicts) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scales", default="100m,1b")
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--ac", default="none,full")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--threads", type=int, default=1,
                   help="torch's CPU threads (default 1: a GPU step's host work runs on one thread, and on a "
                   "shared machine the tiny tensors' CPU kernels otherwise spin-wait for a descheduled worker "
                   "thread, which the host CPU time of the step's thread counts)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.add_argument("--append", type=pathlib.Path, help="append the table to this notebook (docs/benchmarks-log.md)")
    p.add_argument("--out", type=pathlib.Path, help="write the table to this file")
    a = p.parse_args(argv)
    for f in a.families.split(","):
        if f not in FAMILIES:
            p.error(f"unknown family {f!r}; choose from {', '.join(FAMILIES)}")
    if a.threads < 1:
        p.error(f"--threads must be at least 1, got {a.threads}")
    threads = torch.get_num_threads()
    torch.set_num_threads(a.threads)
    try:
        result = rows(a.scales.split(","), a.families.split(","), a.ac.split(","), a.repeats)
    finally:  # (a caller in the same process keeps its own setting)
        torch.set_num_threads(threads)
    for r in result:
        r["load"] = os.getloadavg()[0]
        r["host_family"] = host_family(ModelArgs.from_flavor(r["scale"], **FAMILIES[r["family"]]))
    text = json.dumps(result, indent=1) if a.json else table(result, a.repeats, a.threads)
    print(text)
    if a.out:
        write_table(a.out, text)
    if a.append and not a.json:
        append_section(a.append, text, "Whole-step host time and the host-bound verdict")


if __name__ == "__main__":
    from mhar_titan.cli_args import run_command

    run_command(main)
