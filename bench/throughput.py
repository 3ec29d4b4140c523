"""End-to-end training throughput: baseline vs AttnRes (H = 1) vs MHAR (H = 8) on one device.

Families: baseline, attnres, mhar (per-call routing) and mhar-grouped (MHAR with
routing_group_size="auto": 5 / 7 / 11 at 100m / 350m / 1b; the table's "routing g" column), and
the other depth connections, dense (DenseFormer), mudd (MUDDFormer with the pre/post DA norm),
hyper (dynamic Hyper-Connections) and mhc (mHC, learned exit), n = 4 streams each, whose mixing runs
as eager torch code (the routing kernel is depth routing's only).

Trains each model for a few steps on synthetic tokens (bf16 parameters and compute, AdamW, the
paper's micro-batches: 100m 8x2048, 350m 4x1024, 1b 2x1024), with activation checkpointing
off and on (the trainer's `apply_ac`), and reports tokens/s, MFU (model FLOPs, routing FLOPs
not counted, mhar_titan.metrics), peak memory and the ratio to the baseline of the same scale
and AC mode. Routing uses `routing_kernel` (default "auto": Triton on CUDA, eager on CPU).

Every family runs with the same settings of the options the trainer has: --mask
(`model.attn_mask_type`; "block_causal" packs synthetic documents of --doc-len tokens on average,
with --rope-per-document restarting positions), --loss (`training.loss_path`, chunked by default,
--loss-chunk tokens per chunk) and --compile (`[compile] components`: none, "blocks" = "model",
"whole" = "whole_model"), so the baseline is measured in its best configuration beside MHAR:

    python bench/throughput.py --mask block_causal --compile whole    # CUDA: the best baseline vs MHAR

    python bench/throughput.py                         # CUDA: 100m, 350m, 1b
    python bench/throughput.py --append docs/benchmarks-log.md
    python bench/throughput.py --scales debug --batch 1 --seq 16 --steps 2 --warmup 1   # CPU
    python bench/throughput.py --out OUT/throughput.md --budget-s 80   # the GPU suite

Imports only the model, metrics and parallel pieces it needs (never the config or the data
stack), so it runs on a machine with torch and triton only. Runs go AC mode by AC mode, scale by
scale; with --out the table is rewritten after every run, and --budget-s starts no new run once
that many seconds have passed (the rows not run are listed as skipped).
"""
from __future__ import annotations

import datetime
import os
import pathlib
import sys
import time
import traceback
from types import SimpleNamespace

import torch

if not torch.cuda.is_available():  # Triton runs on CPU only through its interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mhar_titan.cli_args import (ArgumentParser, non_negative_int, positive_float, positive_int,  # noqa: E402
                                 run_command)
from mhar_titan.metrics import flops_per_token, mfu, peak_flops, peak_memory_gib  # noqa: E402
from mhar_titan.models.args import FAMILIES as MODEL_FAMILIES, ModelArgs  # noqa: E402
from mhar_titan.models.cross_entropy import chunked_linear_cross_entropy, plain_linear_cross_entropy  # noqa: E402
from mhar_titan.models.model import Transformer  # noqa: E402
from mhar_titan.parallel import apply_ac, apply_compile, compile_whole_model  # noqa: E402

from routing_harness import MICRO_BATCH  # noqa: E402  (bench/ is on sys.path as a script)
from tables import append_section, write_table  # noqa: E402

# The paper's three families (models/args.py FAMILIES) under the short names of the tables, and
# MHAR with grouped routing at the group size "auto" picks per flavor (docs/DESIGN.md "Grouped routing").
FAMILIES = {short: MODEL_FAMILIES[name] for short, name in
            (("baseline", "baseline"), ("attnres", "attn_res H=1"), ("mhar", "mhar H=8"))}
FAMILIES["mhar-grouped"] = dict(FAMILIES["mhar"], routing_group_size="auto")
# The other depth connections (eager code: DenseFormer's averages, MUDDFormer with the pre/post DA norm,
# Hyper-Connections and mHC with n = 4 streams).
FAMILIES.update(dense=MODEL_FAMILIES["dense"], mudd=MODEL_FAMILIES["mudd"], hyper=MODEL_FAMILIES["hyper"],
                mhc=MODEL_FAMILIES["mhc"])


EOS = 0
"""The synthetic documents' EOS id under --mask block_causal."""


def build(scale: str, family: str, kernel: str, ac: str, seq: int, vocab: int | None, device, compile_mode: str,
          mask: str = "causal", rope_per_document: bool = False):
    overrides = dict(FAMILIES[family], max_seq_len=max(seq, 64), attn_mask_type=mask,
                     rope_per_document=rope_per_document, eos_id=EOS if mask == "block_causal" else None)
    if overrides["residual"] == "attn_res":  # the routing kernel is depth routing's
        overrides["routing_kernel"] = kernel
    if vocab:
        overrides["vocab_size"] = vocab
    args = ModelArgs.from_flavor(scale, **overrides)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device=device)
    torch.manual_seed(0)
    model.init_weights(buffer_device=device)
    model.to(torch.bfloat16)
    # The [activation_checkpoint] fields apply_ac reads (the config module is not imported here).
    apply_ac(model, SimpleNamespace(mode=ac, selective_ac_option="1", preserve_rng_state=False))
    if compile_mode == "blocks":
        apply_compile(model, SimpleNamespace(backend="inductor"))
    elif compile_mode == "whole":
        compile_whole_model(model, "inductor")
    return model, args


def synthetic_tokens(batch: int, seq: int, vocab: int, doc_len: int | None, device) -> torch.Tensor:
    """(batch, seq + 1) random ids in [1, vocab); with `doc_len`, an EOS (id 0) ends each token's
    document with probability 1 / doc_len (documents of doc_len tokens on average)."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    tokens = torch.randint(1, vocab, (batch, seq + 1), generator=gen)
    if doc_len:
        tokens[torch.rand(batch, seq + 1, generator=gen) < 1 / doc_len] = EOS
    return tokens.to(device)


def run_one(scale, family, kernel, ac, batch, seq, steps, warmup, vocab, device, compile_mode="none",
            mask="causal", rope_per_document=False, doc_len=512, loss="chunked", loss_chunk=1024) -> dict:
    model, args = build(scale, family, kernel, ac, seq, vocab, device, compile_mode, mask, rope_per_document)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    tokens = synthetic_tokens(batch, seq, args.vocab_size, doc_len if mask == "block_causal" else None, device)
    if loss == "plain":
        def loss_fn(h, weight, labels):
            return plain_linear_cross_entropy(h, weight, labels)
    else:
        def loss_fn(h, weight, labels):
            return chunked_linear_cross_entropy(h, weight, labels, chunk=loss_chunk)

    def step():
        loss = model(tokens[:, :-1], tokens[:, 1:], loss_fn=loss_fn) / tokens[:, 1:].numel()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for _ in range(warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step()
    loss.item()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    tps = batch * seq * steps / seconds
    fpt = flops_per_token(args, seq)
    result = dict(scale=scale, family=family, ac=ac, batch=batch, seq=seq, tokens_per_s=tps,
                  group=model.plan.group_size if model.plan.sites else None,
                  mfu=mfu(fpt.model, tps, peak_flops(device)), peak_gib=peak_memory_gib(device),
                  loss=loss.item())
    del model, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def _rate(tokens_per_s: float) -> str:
    """tokens/s for the table: whole numbers, three significant digits below 100 (a CPU smoke run
    on a loaded machine can be below 1)."""
    return f"{tokens_per_s:,.0f}" if tokens_per_s >= 100 else f"{tokens_per_s:.3g}"


def table(rows: list[dict], device, kernel: str, settings: str, skipped=(), failed=()) -> str:
    import triton

    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (debug flavor; a smoke run)"
    lines = [
        f"Device: {where}; torch {torch.__version__}, triton {triton.__version__}; "
        f"{datetime.date.today().isoformat()}; bf16 params and compute, AdamW, synthetic tokens; "
        f"routing_kernel={kernel}; every family with {settings}.",
        "",
        "| scale | AC | family | routing g | micro-batch | tokens/s | vs baseline | MFU (model FLOPs) | peak GiB |",
        "|---|---|---|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        base = next((x for x in rows if x["scale"] == r["scale"] and x["ac"] == r["ac"]
                     and x["family"] == "baseline"), None)
        ratio = "-" if base is None else f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}"
        m = "-" if r["mfu"] is None else f"{r['mfu']:.1f}%"
        lines.append(
            f"| {r['scale']} | {r['ac']} | {r['family']} | {r['group'] if r['group'] is not None else '-'} | "
            f"{r['batch']}x{r['seq']} | {_rate(r['tokens_per_s'])} | "
            f"{ratio} | {m} | {r['peak_gib']:.2f} |"
        )
    if failed:
        lines += ["", f"Failed (see the log): {', '.join(failed)}."]
    if skipped:
        lines += ["", f"Not run (time budget spent): {', '.join(skipped)}."]
    return "\n".join(lines)


def main(argv=None) -> None:
    cuda = torch.cuda.is_available()
    p = ArgumentParser(prog="python bench/throughput.py", description=__doc__.splitlines()[0])
    p.add_argument("--scales", default="100m,350m,1b" if cuda else "debug")
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--ac", default="none,full", help="comma list of AC modes (none, full)")
    p.add_argument("--kernel", default="auto", choices=["eager", "compile", "triton", "auto"])
    p.add_argument("--compile", default="none", choices=["none", "blocks", "whole"],
                   help="torch.compile (inductor): none, every block ([compile] components=['model']) or the "
                        "whole model, embedding to loss (components=['whole_model'])")
    p.add_argument("--mask", default="causal", choices=["causal", "block_causal"], help="model.attn_mask_type")
    p.add_argument("--rope-per-document", action="store_true", help="model.rope_per_document (block_causal)")
    p.add_argument("--doc-len", type=positive_int, default=512, help="mean synthetic document length under block_causal")
    p.add_argument("--loss", default="chunked", choices=["chunked", "plain"], help="training.loss_path")
    p.add_argument("--loss-chunk", type=positive_int, default=1024, help="training.loss_chunk_tokens")
    p.add_argument("--batch", type=positive_int, help="override the micro-batch size")
    p.add_argument("--seq", type=positive_int, help="override the sequence length")
    p.add_argument("--vocab", type=positive_int, help="override the vocabulary size (CPU smoke runs)")
    p.add_argument("--steps", type=positive_int, default=10)
    p.add_argument("--warmup", type=non_negative_int, default=3)
    p.add_argument("--append", type=pathlib.Path, help="append the table to this notebook (docs/benchmarks-log.md)")
    p.add_argument("--out", type=pathlib.Path, help="write the table to this file after every run")
    p.add_argument("--budget-s", type=positive_float, help="start no new run after this many seconds")
    a = p.parse_args(argv)
    if a.rope_per_document and a.mask != "block_causal":
        p.error("--rope-per-document needs --mask block_causal")
    settings = (f"attn_mask_type={a.mask}" + (f" (documents of {a.doc_len} tokens on average"
                                              f"{', RoPE per document' if a.rope_per_document else ''})"
                                              if a.mask == "block_causal" else "")
                + f", loss_path={a.loss}" + (f" ({a.loss_chunk}-token chunks)" if a.loss == "chunked" else "")
                + f", compile {a.compile}")
    device = torch.device("cuda" if cuda else "cpu")
    scales = a.scales.split(",")
    for scale in scales:
        if scale not in MICRO_BATCH:
            p.error(f"unknown scale {scale!r}; choose from {sorted(MICRO_BATCH)}")
    families = a.families.split(",")
    if "baseline" not in families:
        families = ["baseline", *families]
    plan = [(ac, scale, family) for ac in a.ac.split(",") for scale in scales for family in families]
    start, rows, skipped, failed = time.perf_counter(), [], [], []
    if a.out:
        write_table(a.out, table(rows, device, a.kernel, settings))  # header only, before the first run
    for ac, scale, family in plan:
        name = f"{scale}/{ac}/{family}"
        if a.budget_s is not None and time.perf_counter() - start > a.budget_s:
            skipped.append(name)
            continue
        batch, seq = a.batch or MICRO_BATCH[scale][0], a.seq or MICRO_BATCH[scale][1]
        try:
            r = run_one(scale, family, a.kernel, ac, batch, seq, a.steps, a.warmup, a.vocab, device, a.compile,
                        a.mask, a.rope_per_document, a.doc_len, a.loss, a.loss_chunk)
        except Exception:  # one failing run (e.g. out of memory) must not lose the others
            traceback.print_exc()
            failed.append(name)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        print(r, flush=True)
        rows.append(r)
        if a.out:
            write_table(a.out, table(rows, device, a.kernel, settings, failed=failed))
    text = table(rows, device, a.kernel, settings, skipped, failed)
    print(text)
    if a.out:
        write_table(a.out, text)
    if a.append:
        append_section(a.append, text, "Training throughput (one device)")
    if failed:
        raise SystemExit(f"{len(failed)} run(s) failed: {', '.join(failed)}")


if __name__ == "__main__":
    run_command(main)
