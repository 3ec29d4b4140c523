"""Performance: the per-step throughput/MFU/memory metrics, and ``[profiling]`` (torch.profiler
traces and CUDA memory snapshots inside the run folder)."""
from __future__ import annotations

import contextlib
import pathlib
from typing import Callable, Optional

import torch

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


def startup_fields(cfg, model_args, model: torch.nn.Module, world_size: int, device: torch.device,
                   global_batch: int, grad_accum: int, flops: FlopsPerToken) -> list[str]:
    """The console line a run starts with (`mhar_titan.console` fields): flavor and family,
    parameter count, ranks and device, batch geometry (sequences x tokens, accumulation),
    training FLOPs per token with the routing share (the run folder gets a line of its own)."""
    family = model_args.residual
    if model_args.residual == "attn_res":
        family += f" H={model_args.resolved_routing_heads} {model_args.routing_granularity} {model_args.routing_mode}"
    params = sum(p.numel() for p in model.parameters())
    accum = f" x {grad_accum} accum" if grad_accum > 1 else ""
    return [
        "start", f"{cfg.model.flavor} {family}", f"{count(params)} params",
        f"{world_size} rank{'s' if world_size > 1 else ''} {device}",
        f"batch {global_batch} x {cfg.training.seq_len}{accum}",
        f"{count(flops.total)} FLOP/token ({100 * flops.routing / flops.total:.1f}% routing)",
    ]


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
