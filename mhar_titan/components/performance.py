"""Performance: the per-step throughput/MFU/memory metrics, what the end-of-run summary reports
of the whole run (`RunTotals`), the start line (with the routing kernel that runs),
``[profiling]`` (torch.profiler traces and CUDA memory snapshots inside the run folder), and the
step-time model: the counted routing bytes of a training step, the modelled GPU time of a step on
an H200 beside the measured host time of the same step, and the verdict (host-bound or GPU-bound,
by how much) that `bench/step_host.py` prints per micro-batch and the dry run prints for the
configured job."""
from __future__ import annotations

import collections
import contextlib
import math
import pathlib
import time
from typing import Callable, Optional

import torch

from mhar_kernels import dispatch
from mhar_kernels.traffic import H200_PROGRAMS, Launch, Traffic, element_bytes, grouped_traffic, routing_traffic
from mhar_titan.config import Profiling
from mhar_titan.console import count
from mhar_titan.metrics import FlopsPerToken, flops_per_token, mfu, peak_memory_gib
from mhar_titan.models.args import CONNECTION_KEYS, ModelArgs, routing_settings
from mhar_titan.models.connections import build_connection
from mhar_titan.models.connections.base import checkpointed_blocks
from mhar_titan.models.plan import RoutingPlan


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


def planned_routing(model_args, device_type: str) -> Optional[tuple[str, str, str]]:
    """(kernel asked for, implementation planned, why) of a routed model's routing on ranks of
    ``device_type`` ("cuda" or "cpu"), for planning a job (the dry run); None for the baseline.

    On "cuda" the plan is `mhar_kernels.dispatch.planned_backend`: what a GPU machine set up as the
    project installs it runs (the fused Triton kernels for "auto" and "triton" where one token's tile
    fits), whatever this machine has installed. On "cpu" it is what the trainer runs on this machine
    (`dispatch.backend`), so a CPU dry run and the trainer's own fit check (`components.memory`)
    model the same job."""
    if model_args.residual != "attn_res":
        return None
    asked, dim, heads = model_args.routing_kernel, model_args.dim, model_args.resolved_routing_heads
    if device_type == "cuda":
        runs = dispatch.planned_backend(asked, "cuda", dim, heads)
    else:
        runs = dispatch.backend(asked, device_type, dim, heads)
    shape = f"d={dim}, H={heads}"
    if asked in ("eager", "compile"):
        why = f"model.routing_kernel = {asked!r}"
    elif runs == "triton":
        why = (f"model.routing_kernel = {asked!r} on {device_type} runs the fused kernels: {shape} fits their "
               "register tile" + (", and a CUDA build of torch brings triton" if device_type == "cuda" else
                                  ", under TRITON_INTERPRET=1 here"))
    elif device_type == "cuda":
        why = f"model.routing_kernel = {asked!r}: one token's tile at {shape} exceeds the fused kernels' register budget"
    elif asked == "auto":
        why = f"model.routing_kernel = 'auto' on {device_type}: the fused kernels are chosen on CUDA only"
    else:
        why = f"model.routing_kernel = {asked!r} on {device_type}: {dispatch.fused_unavailable(device_type, dim, heads)}"
    return asked, runs, why


def routing_kernel_warning(model_args, device: torch.device) -> Optional[str]:
    """Why the routing kernel asked for is not the one that runs (``routing_kernel = "triton"``
    where the Triton kernels cannot run falls back to eager), or None when it is (or was "auto")."""
    pair = routing_kernel_runs(model_args, device)
    if pair is None or pair[0] in ("auto", pair[1]):
        return None
    asked, runs = pair
    dim, heads = model_args.dim, model_args.resolved_routing_heads
    return (f"model.routing_kernel = {asked!r} but routing runs on the {runs} path: mhar_kernels.can_run({device.type}, "
            f"dim={dim}, heads={heads}) is False ({dispatch.fused_unavailable(device, dim, heads)})")


def startup_fields(cfg, model_args, model: torch.nn.Module, world_size: int, device: torch.device,
                   global_batch: int, grad_accum: int, flops: FlopsPerToken) -> list[str]:
    """The console line a run starts with (`mhar_titan.console` fields): flavor and family,
    parameter count, ranks and device, batch geometry (sequences x tokens, accumulation),
    training FLOPs per token with the routing share, and for a routed model the routing
    implementation that runs (``routing eager``; ``routing triton -> eager`` when the kernel asked
    for cannot run: `routing_kernel_warning` says why) and every other routing setting that is not
    at its default (`models.args.routing_settings`: ``routing_logit_scale=match_heads:8 (x0.354)``,
    ``routing_temperature=learned``, ...). The run folder gets a line of its own."""
    family = model_args.residual
    if model_args.residual == "attn_res":
        family += f" H={model_args.resolved_routing_heads} {model_args.routing_granularity} {model_args.routing_mode}"
    family += "".join(f" {k}={getattr(model_args, k)}" for k in CONNECTION_KEYS.get(model_args.residual, ())
                      if getattr(model_args, k) != getattr(ModelArgs, k))  # a connection's keys set away from defaults
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
    return fields + routing_settings(model_args)


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


# ---------------------------------------------------------------------------- routing bytes of a step
def plan_sources(args: ModelArgs) -> list[list[int]]:
    """For each routing site of the model's routing plan, the entries (ids) of the (B, T, d)
    sources it reads; the null source is not a row and is left out, except at a site that reads
    only its null source (paper layout, layer 0's attention): the router broadcasts it to a
    (B, T, d) tensor of its own (`router.routed_sources`), counted as one row of id -1 - s."""
    plan = RoutingPlan.from_args(args)
    rows = [[j for j in site.reads if plan.sources[j].kind != "null"] for site in plan.sites]
    return [ids or [-1 - s] for s, ids in enumerate(rows)]


def parameter_gradients(args: ModelArgs, dtype: torch.dtype) -> Launch:
    """Bytes autograd moves to assemble the gradients of the routing parameters of one step
    (kind "parameters"; independent of the tokens), as models/router.py takes their rows
    (`routing_params.parameter_rows`, once per forward). Per-call routing unbinds each of the (S, d)
    pseudo-queries and key-norm weights once: its backward stacks the S row gradients into one
    (S, d) gradient ((S, d) read, (S, d) written). Grouped routing splits each by group and
    unbinds every group's rows: the split's backward concatenates the group gradients ((S, d)
    read and written), each group's unbind backward stacks its rows ((g, d) read and written, so
    (S, d) over the groups), and a group of more than one site adds its phase 1's (g, d) gradient
    to that ((g, d) read twice, written once). The null source and delta gates not included."""
    el, d, s = element_bytes(dtype), args.dim, args.n_routing_sites
    row, whole = d * el, s * d * el
    groups = [g.size for g in RoutingPlan.from_args(args).groups]
    read = written = whole
    if any(g > 1 for g in groups):
        phase1_rows = sum(g for g in groups if g > 1)
        read, written = 2 * whole + 2 * phase1_rows * row, 2 * whole + phase1_rows * row
    return Launch(None, "parameters", read=2 * read, written=2 * written)


def slot_copies(args: ModelArgs, ac: str = "none") -> tuple[int, int]:
    """(copies per forward, copies run a second time under activation checkpointing `ac`) of
    routed entries into their depth-buffer slots (`mhar_kernels.depth_buffer`), from the model's
    `schedule.RoutingSchedule`: every routed entry is copied (`DepthBuffer.write`).
    Under "full" a recomputed block copies its attention sublayer's entries again; non-reentrant
    checkpointing stops recomputing at the block's last saved activation (inside the MLP), before
    the MLP sublayer's copies."""
    from mhar_titan.models.schedule import RoutingSchedule

    schedule = RoutingSchedule.from_plan(RoutingPlan.from_args(args), args.n_layers)
    copied = [[sum(slot is not None for slot in layer.slots[k]) for k in (0, 1)] for layer in schedule.layers]
    initial = sum(slot is not None for slot in schedule.initial_slots)
    return initial + sum(map(sum, copied)), sum(a for a, _ in copied) if ac == "full" else 0


def _copies(args: ModelArgs, ac: str) -> dict:
    writes, again = slot_copies(args, ac)
    return dict(writes=writes, recomputed_writes=again)


def step_traffic(args: ModelArgs, tokens: int, dtype: torch.dtype, ac: str = "none",
                 programs: int = H200_PROGRAMS, shared: bool = True) -> Traffic:
    """Counted routing bytes of one training step of `args` at `tokens` tokens per micro-batch
    (shared: the sources' gradient buffers shared between sites, as the models run), with the
    routing parameters' gradient assembly (`parameter_gradients`)."""
    sites = plan_sources(args)
    t = routing_traffic(sites, dim=args.dim, tokens=tokens, dtype=dtype, heads=args.resolved_routing_heads,
                        delta=args.routing_mode == "delta", null_source=args.routing_null_source,
                        programs=programs, recomputed_sites=len(sites) - 1 if ac == "full" else 0,
                        **_copies(args, ac), shared=shared)
    extra = (parameter_gradients(args, dtype),)
    return Traffic(t.launches + extra, t.floor, t.row_bytes)


def plan_groups(args: ModelArgs) -> list[tuple[list[int], list[list[int]]]]:
    """Per routing group of the plan (args.routing_group_size): the entries (ids) of the (B, T, d)
    sources its phase 1 reads, and per site those of its in-group sources; the grouped
    counterpart of `plan_sources` (null source left out)."""
    plan = RoutingPlan.from_args(args)
    rows = lambda entries: [j for j in entries if plan.sources[j].kind != "null"]  # noqa: E731
    return [(rows(group.reads), [rows(late) for late in group.late]) for group in plan.groups]


def grouped_step_traffic(args: ModelArgs, tokens: int, dtype: torch.dtype, ac: str = "none",
                         programs: int = H200_PROGRAMS) -> Traffic:
    """Counted routing bytes of one grouped training step (`mhar_kernels.traffic.grouped_traffic`),
    with the phase-1 backward's site chunks of the fused kernels' launch configuration."""
    from mhar_kernels.contract import grouped_layout  # the fused kernels' layout, without triton

    groups = plan_groups(args)
    heads = args.resolved_routing_heads
    g = max(len(late) for _, late in groups)
    block = grouped_layout(tokens, g, heads, args.dim // heads)["SB"]
    t = grouped_traffic(groups, dim=args.dim, tokens=tokens, dtype=dtype, heads=heads,
                        delta=args.routing_mode == "delta", null_source=args.routing_null_source,
                        programs=programs, backward_site_block=block,
                        recomputed_sites=args.n_routing_sites - 1 if ac == "full" else 0,
                        **_copies(args, ac))
    extra = (parameter_gradients(args, dtype),)
    return Traffic(t.launches + extra, t.floor, t.row_bytes)



def depth_read_bytes(args: ModelArgs, tokens: int, ac: str = "none", dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of the depth connection's reads of its depth history in one training step at `tokens`
    tokens per micro-batch: its (forward, backward) rows per token (`Connection.depth_reads`) times
    d values of `dtype`, the forward rows once more for the blocks activation checkpointing `ac`
    ("none", "full", "selective:k") recomputes (in proportion to them); 0 for the standard
    residual. A model of reads only (no writes, no gradient rows): docs/CONNECTIONS.md."""
    forward, backward = build_connection(args).depth_reads()
    recomputed = checkpointed_blocks(ac, args.n_layers)
    forward_again = forward * sum(recomputed) / args.n_layers
    return int(round((forward + forward_again + backward) * tokens * args.dim * element_bytes(dtype)))


def routing_step_bytes(args: ModelArgs, tokens: int, ac: str = "none") -> int:
    """Modelled bytes the depth connection moves in one training step at `tokens` tokens per
    micro-batch (bf16): for depth routing, the fused kernels' counted traffic, per call
    (`step_traffic`) or grouped (`grouped_step_traffic`) as args.routing_group_size gives it (reads
    and writes, the routing plan's sites); for a connection without routing sites, its depth reads
    (`depth_read_bytes`); 0 for the standard residual."""
    plan = RoutingPlan.from_args(args)
    if not plan.sites:
        return depth_read_bytes(args, tokens, ac)
    if plan.group_size > 1:
        return grouped_step_traffic(args, tokens, torch.bfloat16, ac).total
    return step_traffic(args, tokens, torch.bfloat16, ac).total


# ---------------------------------------------------------------------------- host vs GPU
H200_PEAK_FLOPS = 989e12  # dense bf16 (metrics.PEAK_FLOPS)
MODEL_MFU = 0.45  # the fraction of peak the modelled step reaches on its FLOPs
MODEL_BANDWIDTH = 4.0e12  # bytes/s the modelled routing launches reach (H200: 4.8 TB/s peak)
MICRO_BATCHES = (2, 4, 8, 16)  # the micro-batches the verdict is given for
STEP_SEQ = {"100m": 2048, "1b": 1024}  # the paper's sequence lengths of the measured scales

# Host time (ms, minimum) of one whole training step (forward, backward, clipping, AdamW step) of
# each scale, family ("baseline", "mhar" per call, "mhar-grouped") and activation checkpointing
# mode, measured by `python bench/step_host.py --repeats 20` (real depth and routing plan, tiny
# tensors, kernel launches stubbed; host CPU time of the step's thread, one torch thread, automatic
# garbage collection off inside the steps as in the trainer) on a 2-core CPU (AMD EPYC, load
# average 0.8, nothing else running), 2026-12-02 15:21 UTC (docs/benchmarks-log.md "Whole-step host time,
# routing calls that save only their activations"). The host work of a step does not depend on
# the micro-batch.
HOST_STEP_MS = {
    ("100m", "baseline", "none"): 14.7,
    ("100m", "mhar", "none"): 18.1,
    ("100m", "mhar-grouped", "none"): 19.7,
    ("100m", "baseline", "full"): 30.4,
    ("100m", "mhar", "full"): 37.3,
    ("100m", "mhar-grouped", "full"): 39.5,
    ("1b", "baseline", "none"): 65.7,
    ("1b", "mhar", "none"): 78.1,
    ("1b", "mhar-grouped", "none"): 79.6,
    ("1b", "baseline", "full"): 112.3,
    ("1b", "mhar", "full"): 142.3,
    ("1b", "mhar-grouped", "full"): 145.2,
}


def modelled_gpu_ms(args: ModelArgs, micro_batch: int, seq: int, ac: str = "none", mfu: float = MODEL_MFU,
                    peak: float = H200_PEAK_FLOPS, bandwidth: float = MODEL_BANDWIDTH) -> dict:
    """Modelled GPU time (ms) of one training step of one micro-batch of `micro_batch` x `seq`
    tokens on one H200 (a model, not a measurement): the model FLOPs (`metrics.flops_per_token`:
    dense, attention and LM head; AC "full" adds the blocks' forward again, a third of their
    training FLOPs) at `mfu` of `peak` FLOP/s, plus the counted routing bytes
    (`routing_step_bytes`) at `bandwidth` bytes/s. Returns {'flops_ms', 'bytes_ms', 'total_ms',
    'routing_bytes', 'mfu', 'peak', 'bandwidth'}."""
    tokens = micro_batch * seq
    f = flops_per_token(args, seq)
    flops = f.model + (f.dense + f.attention) / 3 * (ac == "full")
    flops_ms = 1e3 * flops * tokens / (mfu * peak)
    routing = routing_step_bytes(args, tokens, ac)
    bytes_ms = 1e3 * routing / bandwidth
    return dict(flops_ms=flops_ms, bytes_ms=bytes_ms, total_ms=flops_ms + bytes_ms, routing_bytes=routing, mfu=mfu,
                peak=peak, bandwidth=bandwidth)


def verdict(host_ms: float, gpu_ms: float) -> dict:
    """{'bound': "host-bound" when the host takes longer than the GPU (the GPU waits) else
    "GPU-bound", 'by': the longer time over the shorter}."""
    if host_ms > gpu_ms:
        return dict(bound="host-bound", by=host_ms / gpu_ms)
    return dict(bound="GPU-bound", by=gpu_ms / host_ms)


def host_family(args: ModelArgs) -> Optional[str]:
    """The row of HOST_STEP_MS `args` runs like: "baseline", "mhar" (per-call routing, any H) or
    "mhar-grouped" (routing_group_size > 1); None for a depth connection whose host time was not
    measured (one without routing sites: DenseFormer, MUDDFormer)."""
    plan = RoutingPlan.from_args(args)
    if plan.sites:
        return "mhar-grouped" if plan.group_size > 1 else "mhar"
    return "baseline" if build_connection(args).depth_reads() == (0, 0) else None


def step_verdict(flavor: str, args: ModelArgs, ac: str, local_batch: int, seq: int, accumulation: int,
                 world_size: int, host_ms: Optional[dict] = None) -> Optional[dict]:
    """The dry run's verdict for a job: the measured host time of its scale / family / AC mode
    (`host_ms`, default HOST_STEP_MS), the modelled GPU time of one micro-batch
    (`modelled_gpu_ms`) and `verdict`. When host-bound, a larger local batch that keeps the global
    batch (world_size x local x accumulation): local x k for a divisor k > 1 of `accumulation`, the
    smallest at which the GPU time covers the host time ('covers' True), else the largest one there
    is (k = accumulation: host-bound by 'then_by' at it, 'covers' False); 'local_batch' is None only
    when `accumulation` is 1 (no larger local batch keeps the global batch). Returns None when the
    flavor's host time was not measured.

    Returns {'host_ms', 'gpu_ms', 'bound', 'by', 'local_batch', 'accumulation', 'covers', 'then_by'}."""
    family = host_family(args)
    measured = None if family is None else (host_ms if host_ms is not None else HOST_STEP_MS).get((flavor, family, ac))
    if measured is None:
        return None
    gpu = modelled_gpu_ms(args, local_batch, seq, ac)["total_ms"]
    result = dict(host_ms=measured, gpu_ms=gpu, **verdict(measured, gpu), local_batch=None, accumulation=None,
                  covers=False, then_by=None)
    if result["bound"] == "host-bound" and accumulation > 1:
        for k in (k for k in range(2, accumulation + 1) if accumulation % k == 0):
            larger = modelled_gpu_ms(args, local_batch * k, seq, ac)["total_ms"]
            result.update(local_batch=local_batch * k, accumulation=accumulation // k, covers=larger >= measured,
                          then_by=measured / larger)
            if larger >= measured:
                break
    return result
