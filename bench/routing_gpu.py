"""Routing forward+backward timed on the device: eager vs torch.compile vs the fused Triton kernels
per call and per step (`bench`), and one step per call vs grouped with `triton.testing.do_bench`
(`isolated`), each beside the measured copy bandwidth. Run through `bench/routing.py`.
"""
from __future__ import annotations

import datetime
import time
import traceback

import os
import pathlib
import sys

import torch

if not torch.cuda.is_available():  # Triton runs on CPU only through its interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from routing_bytes import grouped_moved_bytes, moved_bytes  # noqa: E402
from routing_harness import auto_group, make_inputs, median_ms, one_call, one_grouped_step, one_step  # noqa: E402


def copy_bandwidth(device: torch.device, dtype: torch.dtype, time_ms=None) -> float:
    """Measured device copy bandwidth in GB/s (read + write of a 1 GiB tensor; 64 MiB on CPU);
    time_ms(fn) -> milliseconds of one fn() (default: `median_ms`, 2 warm-ups, 10 runs)."""
    numel = (2**30 if device.type == "cuda" else 2**26) // torch.finfo(dtype).bits * 8
    src = torch.empty(numel, dtype=dtype, device=device).uniform_()
    dst = torch.empty_like(src)
    ms = (time_ms or (lambda fn: median_ms(fn, device, warmup=2, iters=10)))(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e9

def bench(shapes: dict, impls, heads: int, dtype, device, warmup: int, iters: int, step: bool,
          budget_s: float | None = None, progress=None, group: int | str = 0) -> tuple[list[dict], float, list[str]]:
    """Time every (shape, scope, impl); returns (rows, copy bandwidth GB/s, names not run or failed).
    group > 1 adds the scope "step g=<group>" (`one_grouped_step`, eager and triton only); group
    "auto": g = `auto_group` of each shape.

    With budget_s, no new measurement starts after that many seconds; a failing implementation
    (for example a compile error) is reported and the others still run. progress(rows, bandwidth)
    is called after every row."""
    start = time.perf_counter()
    bandwidth = copy_bandwidth(device, dtype)
    rows, missing = [], []
    if progress is not None:
        progress(rows, bandwidth)  # the table exists (header only) before the first measurement
    for name, (b, t, d, n) in shapes.items():
        sources, query, norm_weight = make_inputs(b, t, d, n, dtype, device)
        scopes = ("call", "step") if step else ("call",)
        g = auto_group(name) if group == "auto" else int(group)
        for scope in scopes + ((f"step g={g}",) if step and g > 1 else ()):
            grouped_scope = scope.startswith("step g=")
            if grouped_scope:
                moved = grouped_moved_bytes(b, t, d, n, heads, dtype, device, g)
            else:
                moved = moved_bytes(scope, b, t, d, n, heads, dtype, device)
            for impl in impls:
                label = f"{name}/{scope}/{impl}"
                if grouped_scope and impl == "compile":
                    continue  # grouped routing has no compiled routing body (models/args.py)
                if budget_s is not None and time.perf_counter() - start > budget_s:
                    missing.append(f"{label} (time budget spent)")
                    continue
                if grouped_scope:
                    run = one_grouped_step(impl, sources, query, norm_weight, heads, g)
                else:
                    run = (one_call if scope == "call" else one_step)(impl, sources, query, norm_weight, heads)
                try:
                    ms = median_ms(run, device, warmup, iters)
                except Exception:  # e.g. an inductor failure: keep the other rows
                    traceback.print_exc()
                    missing.append(f"{label} (failed, see the log)")
                    continue
                gbps = moved / (ms * 1e-3) / 1e9
                rows.append(dict(shape=name, scope=scope, impl=impl, B=b, T=t, d=d, N=n, ms=ms,
                                 gb=moved / 1e9, gbps=gbps, frac=gbps / bandwidth))
                if progress is not None:
                    progress(rows, bandwidth)
    return rows, bandwidth, missing


def bench_ms(fn, device: torch.device, iters: int) -> tuple[float, str]:
    """Median milliseconds of fn() and how they were taken: `triton.testing.do_bench` on a GPU
    (the L2 cache emptied before every run), the host clock (`median_ms`, 1 warm-up) on CPU."""
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"), "triton.testing.do_bench"
    return median_ms(fn, device, warmup=1, iters=iters), "host clock (no GPU: not a bandwidth measurement)"


def isolated(shapes: dict, heads: int, dtype, device, group: str, iters: int, progress=None) -> tuple[list[dict], float, str]:
    """One whole step of per-call and of grouped routing (Triton, forward + backward; group:
    sites per group, an int or "auto" for `auto_group` of the shape) per shape, timed in
    isolation by `bench_ms`, beside the copy bandwidth timed the same way in the same process.
    Returns (rows, copy bandwidth GB/s, how the times were taken); progress(rows, bandwidth, how)
    after every row."""
    how = bench_ms(lambda: None, device, 1)[1]
    bandwidth = copy_bandwidth(device, dtype, lambda fn: bench_ms(fn, device, iters)[0])
    rows: list[dict] = []
    if progress is not None:
        progress(rows, bandwidth, how)
    for name, (b, t, d, n) in shapes.items():
        g = auto_group(name) if group == "auto" else int(group)
        sources, query, norm_weight = make_inputs(b, t, d, n, dtype, device)
        for family, run, moved in (
                ("mhar", one_step("triton", sources, query, norm_weight, heads),
                 moved_bytes("step", b, t, d, n, heads, dtype, device)),
                ("mhar-grouped", one_grouped_step("triton", sources, query, norm_weight, heads, g),
                 grouped_moved_bytes(b, t, d, n, heads, dtype, device, g))):
            ms, how = bench_ms(run, device, iters)
            gbps = moved / (ms * 1e-3) / 1e9
            rows.append(dict(shape=name, family=family, g=g if family == "mhar-grouped" else 1, B=b, T=t, d=d, N=n,
                             ms=ms, gb=moved / 1e9, gbps=gbps, frac=gbps / bandwidth))
            if progress is not None:
                progress(rows, bandwidth, how)
    return rows, bandwidth, how


def isolated_table(rows: list[dict], bandwidth: float, how: str, heads: int, dtype, device) -> str:
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (Triton interpreter)"
    import triton

    lines = [
        f"One step's routing in isolation (every site, forward + backward, Triton kernels), timed by {how}; "
        f"{where}; torch {torch.__version__}, triton {triton.__version__}; "
        f"{datetime.date.today().isoformat()}; {dtype}, H = {heads}; copy bandwidth timed the same way in this "
        f"run: {bandwidth:.0f} GB/s. GB: `mhar_kernels.traffic`'s model of the kernels' bytes; for per-call "
        "and grouped routing (fused phase 1 and merge) it equals the complete count within 1% (`--bytes "
        "--measure`, counted on CPU); repeated reads inside one launch (phase 1's site chunks) are counted once, "
        "as cache hits.",
        "",
        "| shape | family | g | B | T | d | N | ms | GB (model) | GB/s | of copy BW |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['family']} | {r['g']} | {r['B']} | {r['T']} | {r['d']} | {r['N']} | "
                     f"{r['ms']:.3f} | {r['gb']:.4g} | {r['gbps']:.4g} | {100 * r['frac']:.3g}% |")
    return "\n".join(lines)


def table(rows: list[dict], bandwidth: float, heads: int, dtype, device, missing=()) -> str:
    if device.type == "cuda":
        where = torch.cuda.get_device_name(device)
    else:
        where = "CPU (Triton through TRITON_INTERPRET=1: a correctness run, not a speed measurement)"
    import triton

    lines = [
        f"Device: {where}; torch {torch.__version__}, triton {triton.__version__}; "
        f"{datetime.date.today().isoformat()}; {dtype}, H = {heads}; measured copy bandwidth "
        f"{bandwidth:.0f} GB/s.",
        "",
        "| shape | scope | B | T | d | N | impl | ms | GB moved (counted) | GB/s | of copy BW | vs compile |",
        "|---|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ref = next((x["ms"] for x in rows if x["shape"] == r["shape"] and x["scope"] == r["scope"]
                    and x["impl"] == "compile"), None)
        speedup = f"{ref / r['ms']:.2f}x" if ref else "-"
        lines.append(
            f"| {r['shape']} | {r['scope']} | {r['B']} | {r['T']} | {r['d']} | {r['N']} | {r['impl']} | "
            f"{r['ms']:.3f} | {r['gb']:.4g} | {r['gbps']:.4g} | {100 * r['frac']:.3g}% | {speedup} |"
        )
    if missing:
        lines += ["", f"Not measured: {', '.join(missing)}."]
    return "\n".join(lines)

