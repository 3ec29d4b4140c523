"""Performance: the per-step throughput/MFU/memory metrics, what the end-of-run summary reports
of the whole run (`RunTotals`), the start line (with the routing kernel that runs), and
``[profiling]`` (torch.profiler traces and CUDA memory snapshots inside the run folder)."""
from __future__ import annotations

import collections
import contextlib
import math
import pathlib
import time
from typing import Callable, Optional

import torch

from mhar_kernels import dispatch
from mhar_titan.config import Profiling
from mhar_titan.console import count
from mhar_titan.metrics import FlopsPerToken, mfu, peak_memory_gib


def performance_row(tokens_per_s: float, world_size: int, flops: FlopsPerToken, peak: Optional[float],
                    device: torch.device) -> dict:
    """The throughput part of a step's metrics row: tokens/s (all ranks and per device),
    TFLOP/s per device, MFU in percent (None without a known ``peak`` FLOP/s), the routing share of
    the FLOPs and the peak memory (GiB) of ``device``."""
    per_device = tokens_per_s / world_size
    return {
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_per_device": per_device,
        "tflops_per_device": flops.total * per_device / 1e12,
        "mfu": mfu(flops.total, per_device, peak),
        "routing_flops_share": flops.routing / flops.total,
        "peak_mem_gib": peak_memory_gib(device),
    }


class RunTotals:
    """The steps one run (one start of the trainer) trained, for the end-of-run summary.

    ``smoothed_loss``: the training loss smoothed as the plain mean of the last ``window`` finite
    step losses (non-finite ones left out). ``tokens_per_s``: this run's tokens over the
    wall time from ``start()`` (before the first step) to the end of its last step, validation,
    checkpoint saves and logging included (what the per-step tok/s rows average to).
    ``clock``: seconds (``time.perf_counter``)."""

    def __init__(self, window: int = 20, clock: Callable[[], float] = time.perf_counter):
        self.window, self.clock = window, clock
        self.losses: collections.deque = collections.deque(maxlen=window)
        self.tokens, self.steps, self.t0, self.seconds = 0, 0, None, 0.0

    def start(self) -> None:
        self.t0 = self.clock()

    def step(self, loss: float, tokens: int) -> None:
        """After each step: its loss (a non-finite one is not averaged) and the tokens it trained on."""
        if math.isfinite(loss):
            self.losses.append(loss)
        self.tokens += tokens
        self.steps += 1
        self.seconds = self.clock() - self.t0

    def smoothed_loss(self) -> Optional[tuple[float, int]]:
        """(mean of the last finite step losses, how many were averaged); None before any."""
        return (sum(self.losses) / len(self.losses), len(self.losses)) if self.losses else None

    def tokens_per_s(self) -> Optional[float]:
        """Mean tokens/s over all ranks; None before a step ended."""
        return self.tokens / self.seconds if self.steps and self.seconds > 0 else None


def summary_throughput_fields(totals: RunTotals, world_size: int, flops: FlopsPerToken,
                              peak: Optional[float], device: torch.device) -> list[str]:
    """The summary's throughput fields: mean tok/s of the run (all ranks), per device, and the
    mean MFU where the device's peak is known (`metrics.peak_flops`), else why it is not given."""
    rate = totals.tokens_per_s()
    if rate is None:
        return ["none (no step ended)"]
    fields = [f"mean {count(rate)} tok/s"]
    if world_size > 1:
        fields.append(f"{count(rate / world_size)} tok/s per device")
    value = mfu(flops.total, rate / world_size, peak)
    fields.append(f"mfu {value:.1f}%" if value is not None else f"mfu n/a (no peak FLOP/s known for {device.type})")
    return fields


def routing_kernel_runs(model_args, device: torch.device) -> Optional[tuple[str, str]]:
    """(kernel asked for, implementation that runs) of a routed model's routing on ``device``
    (`mhar_kernels.dispatch.backend`, the one rule); None for the baseline."""
    if model_args.residual != "attn_res":
        return None
    runs = dispatch.backend(model_args.routing_kernel, device, model_args.dim, model_args.resolved_routing_heads)
    return model_args.routing_kernel, runs


def routing_kernel_warning(model_args, device: torch.device) -> Optional[str]:
    """Why the routing kernel asked for is not the one that runs (``routing_kernel = "triton"``
    where the Triton kernels cannot run falls back to eager), or None when it is (or was "auto")."""
    pair = routing_kernel_runs(model_args, device)
    if pair is None or pair[0] in ("auto", pair[1]):
        return None
    asked, runs = pair
    where = (" (on CPU they run only with TRITON_INTERPRET=1 set before the start)" if device.type == "cpu" else "")
    return (f"model.routing_kernel = {asked!r} but routing runs on the {runs} path: mhar_kernels.can_run({device.type}, "
            f"dim={model_args.dim}, heads={model_args.resolved_routing_heads}) is False{where}")


def startup_fields(cfg, model_args, model: torch.nn.Module, world_size: int, device: torch.device,
                   global_batch: int, grad_accum: int, flops: FlopsPerToken) -> list[str]:
    """The console line a run starts with (`mhar_titan.console` fields): flavor and family,
    parameter count, ranks and device, batch geometry (sequences x tokens, accumulation),
    training FLOPs per token with the routing share, and for a routed model the routing
    implementation that runs (``routing eager``; ``routing triton -> eager`` when the kernel asked
    for cannot run: `routing_kernel_warning` says why). The run folder gets a line of its own."""
    family = model_args.residual
    if model_args.residual == "attn_res":
        family += f" H={model_args.resolved_routing_heads} {model_args.routing_granularity} {model_args.routing_mode}"
    params = sum(p.numel() for p in model.parameters())
    accum = f" x {grad_accum} accum" if grad_accum > 1 else ""
    fields = [
        "start", f"{cfg.model.flavor} {family}", f"{count(params)} params",
        f"{world_size} rank{'s' if world_size > 1 else ''} {device}",
        f"batch {global_batch} x {cfg.training.seq_len}{accum}",
        f"{count(flops.total)} FLOP/token ({100 * flops.routing / flops.total:.1f}% routing)",
    ]
    pair = routing_kernel_runs(model_args, device)
    if pair is not None:
        fields.append(f"routing {pair[1]}" if pair[0] == pair[1] else f"routing {pair[0]} -> {pair[1]}")
    return fields


def build_profiler(cfg: Profiling, run_dir: pathlib.Path, rank: int, device: torch.device,
                   current_step: Callable[[], int]):
    """A context manager yielding a ``torch.profiler.profile`` that writes one step's Chrome
    trace every ``cfg.profile_freq`` steps to ``<run_dir>/<save_traces_folder>/iteration_N/``
    (call ``prof.step()`` after each step), or yielding None when profiling is off."""
    if not cfg.enable_profiling:
        return contextlib.nullcontext(None)
    folder = run_dir / cfg.save_traces_folder

    def on_trace_ready(prof):
        out = folder / f"iteration_{current_step()}"
        out.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(out / f"rank{rank}_trace.json"))

    warmup = 1 if cfg.profile_freq > 1 else 0
    schedule = torch.profiler.schedule(wait=max(cfg.profile_freq - warmup - 1, 0), warmup=warmup, active=1)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=activities, schedule=schedule, on_trace_ready=on_trace_ready)


class MemorySnapshots:
    """CUDA allocator history, dumped every ``cfg.profile_freq`` steps to
    ``<run_dir>/<save_memory_snapshot_folder>/iteration_N/rank<R>_memory_snapshot.pickle``;
    does nothing off CUDA or when ``enable_memory_snapshot`` is false."""

    def __init__(self, cfg: Profiling, run_dir: pathlib.Path, rank: int, device: torch.device):
        self.cfg, self.run_dir, self.rank = cfg, run_dir, rank
        self.enabled = cfg.enable_memory_snapshot and device.type == "cuda"

    def start(self) -> None:
        if self.enabled:
            torch.cuda.memory._record_memory_history(max_entries=100_000)

    def after_step(self, step: int) -> None:
        if not (self.enabled and step % self.cfg.profile_freq == 0):
            return
        out = self.run_dir / self.cfg.save_memory_snapshot_folder / f"iteration_{step}"
        out.mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(out / f"rank{self.rank}_memory_snapshot.pickle"))
