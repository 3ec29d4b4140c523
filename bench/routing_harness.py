"""The routing-only harness the routing benchmarks and byte counts run: the paper's shapes, seeded
inputs, one call, one step (every site over the sources before it) per call and grouped, the
same loop without routing, stubbed kernel launches and the host clock.

Imported by `bench/routing_bytes.py`, `bench/routing_host.py`, `bench/routing_gpu.py`,
`bench/byte_count.py` and `bench/step_host.py`; it imports none of them.
"""
from __future__ import annotations

import contextlib
import statistics
import time

import os
import pathlib
import sys

import torch

if not torch.cuda.is_available():  # Triton runs on CPU only through its interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from mhar_kernels import dispatch  # noqa: E402  (the module: tests patch dispatch.backend)
from mhar_kernels.depth_buffer import DepthBuffer, reads as device_reads  # noqa: E402
from mhar_kernels.dispatch import merge, phase1, route as model_route  # noqa: E402
from mhar_titan.models.args import ModelArgs  # noqa: E402
from mhar_titan.models.plan import RoutingPlan  # noqa: E402

# name: (B, T, d, N); N = 2L + 1 sources at the final routing of an L-layer model.
SHAPES = {
    "paper": {"100m": (2, 2048, 512, 25), "350m": (1, 1024, 1024, 49), "1b": (1, 1024, 1280, 73)},
    "toy": {"toy": (1, 8, 64, 5)},
}
# The paper's micro-batches (batch, sequence length) per scale; bench/throughput.py uses them too.
MICRO_BATCH = {"100m": (8, 2048), "350m": (4, 1024), "1b": (2, 1024), "debug": (2, 64)}


def auto_group(shape: str) -> int:
    """The group size `routing_group_size="auto"` picks for the model flavor `shape` names (MHAR,
    H = 8); shapes that name no flavor (toy) get 2."""
    from mhar_titan.models.args import FLAVORS

    if shape not in FLAVORS:
        return 2
    args = ModelArgs.from_flavor(shape, residual="attn_res", routing_heads=8, routing_group_size="auto")
    return RoutingPlan.from_args(args).group_size

def step_groups(n: int, g: int) -> list[tuple[list[int], list[list[int]]]]:
    """The n sites of a step (site k = 1..n reads sources 0..k-1) in groups of g consecutive sites,
    as `mhar_kernels.traffic.grouped_traffic` takes them: (start source ids, per site its in-group ids)."""
    return [(list(range(k0)), [list(range(k0, k0 + m)) for m in range(min(g, n + 1 - k0))])
            for k0 in range(1, n + 1, g)]

def timer(device: torch.device):
    """Returns f(fn) -> milliseconds of one fn() call."""
    if device.type == "cuda":
        def measure(fn):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
    else:
        def measure(fn):
            t0 = time.perf_counter()
            fn()
            return 1e3 * (time.perf_counter() - t0)
    return measure


def host_timer(fn) -> float:
    """Milliseconds of host CPU time of one fn() call on this thread (`time.thread_time`): what
    the host work costs, which other processes on a shared machine do not stretch (they do stretch
    the wall clock, by up to the load over the cores); on an idle machine it equals the wall time
    of single-threaded host work."""
    t0 = time.thread_time()
    fn()
    return 1e3 * (time.thread_time() - t0)


def median_ms(fn, device, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    measure = timer(device)
    return statistics.median(measure(fn) for _ in range(iters))

def make_inputs(b, t, d, n, dtype, device, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    sources = [torch.randn(b, t, d, generator=gen).to(device, dtype).requires_grad_() for _ in range(n)]
    query = (torch.randn(d, generator=gen) * 0.3).to(device, dtype).requires_grad_()
    norm_weight = (1 + 0.1 * torch.randn(d, generator=gen)).to(device, dtype).requires_grad_()
    return sources, query, norm_weight


def one_call(impl, sources, query, norm_weight, heads):
    """One routing call over all `sources` (forward, then one backward). On the fused kernels the
    sources are copied into a depth buffer of their own first (`mhar_kernels.route`'s list API)."""
    def run():
        out = model_route(sources, query, norm_weight, heads, kernel=impl)
        torch.autograd.grad(out, [*sources, query, norm_weight], torch.ones_like(out))
    return run


def last_reader_reads(readers, device):
    """Per reader (the slots it reads, in forward order), its `depth_buffer.Reads` on `device`: the
    last reader of a slot in the forward writes its gradient row, earlier ones add into it (the
    models' rule, `router.RoutingSchedule.buffer_calls`). Made once per harness, as the models make
    theirs once per model and device."""
    last = {slot: i for i, slots in enumerate(readers) for slot in slots}
    return [device_reads(slots, [last[slot] != i for slot in slots], device) for i, slots in enumerate(readers)]


def _fused(impl, sources, heads) -> bool:
    """Whether `impl` routes on the fused kernels here (`dispatch.backend`, the one rule), i.e. over
    a depth buffer as the models do."""
    x = sources[0]
    return dispatch.backend(impl, x.device, x.shape[-1], heads) == "triton"


def one_step(impl, sources, query, norm_weight, heads):
    """All 2L+1 routing sites of a step: site s routes over sources[:s] (forward, then one backward).
    On the fused kernels as the models run them: one depth buffer per step, source s - 1 written
    into slot s - 1 before site s (`DepthBuffer.write`), each site reading its rows of it; else
    through the list API (`dispatch.route`)."""
    n = len(sources)
    fused = _fused(impl, sources, heads)
    reads = last_reader_reads([range(s) for s in range(1, n + 1)], sources[0].device) if fused else None

    def run():
        total, buffer, token = None, DepthBuffer(n, sources[0]) if fused else None, None
        for s in range(1, n + 1):
            if fused:
                token = buffer.write(s - 1, sources[s - 1], token)
                out = dispatch.route_rows(buffer, reads[s - 1], token, query, norm_weight, heads, 1e-6)
            else:
                out = model_route(sources[:s], query, norm_weight, heads, kernel=impl)
            total = out.float().sum() if total is None else total + out.float().sum()
        torch.autograd.grad(total, [*sources, query, norm_weight])
    return run


def one_grouped_step(impl, sources, query, norm_weight, heads, g: int, end=None):
    """`one_step`'s sites in groups of g (grouped two-phase routing): phase 1 of each group over the
    sources that exist when it starts, then each site's merge with its in-group sources; a group of
    one site is a per-call route. On the fused kernels as the models run them: one depth buffer per
    step written source by source before the site that first reads it, phase 1 and the merges on
    its rows (`dispatch.phase1_rows`, `merge_rows`: the merges write their mix gradients into the
    group's rows); else through the list API (`dispatch.phase1`, `merge`). end(out) -> a scalar
    stands in for what follows each site (default `out.float().sum()`); the step's loss is their
    sum."""
    end = end or (lambda out: out.float().sum())
    n = len(sources)
    groups = step_groups(n, g)
    fused = _fused(impl, sources, heads)
    readers = []  # the fused calls' slots in forward order: phase 1 (or a per-call site), the merges' in-group rows
    for start, late in groups:
        readers.append(start)
        readers += [ids for ids in late if len(late) > 1 and ids]
    made = last_reader_reads(readers, sources[0].device) if fused else []

    def run():
        total, buffer, token = None, DepthBuffer(n, sources[0]) if fused else None, None
        reads, written = iter(made), 0

        def write_until(k):  # sources[:k] in their slots
            nonlocal token, written
            while written < k:
                token = buffer.write(written, sources[written], token)
                written += 1

        for start, late in groups:
            size = len(late)
            if fused:
                write_until(len(start))
            if size == 1:
                outs = [dispatch.route_rows(buffer, next(reads), token, query, norm_weight, heads, 1e-6) if fused
                        else model_route([sources[j] for j in start], query, norm_weight, heads, kernel=impl)]
            else:
                rows = query.unsqueeze(0).expand(size, -1), norm_weight.unsqueeze(0).expand(size, -1)
                site_reads = tuple((True,) * len(start) for _ in late)
                outs = []
                if fused:
                    states = dispatch.phase1_rows(buffer, next(reads), token, *rows, site_reads, heads, 1e-6)
                    for i, ids in enumerate(late):
                        write_until(len(start) + len(ids))
                        outs.append(dispatch.merge_rows(states[i], states[size + i], states[2 * size][i], query,
                                                        norm_weight, heads, 1e-6, buffer,
                                                        next(reads) if ids else None, token,
                                                        (states[-1], i, size)))
                else:
                    states = phase1(*rows, site_reads, heads, 1e-6, impl, *[sources[j] for j in start])
                    outs = [merge(states[i], states[size + i], states[2 * size][i], query, norm_weight, heads, 1e-6,
                                  sources[0].dtype, impl, *[sources[j] for j in ids]) for i, ids in enumerate(late)]
            for out in outs:
                total = end(out) if total is None else total + end(out)
        torch.autograd.grad(total, [*sources, query, norm_weight])
    return run

def standin_step(sources, query, norm_weight):
    """`one_step`'s loop without routing: site s's output is sources[s - 1] itself (no op, no
    slot write), then the same sum and one backward. Its host time is what `host_step_ms` subtracts."""
    def run():
        total = None
        for s in range(1, len(sources) + 1):
            out = sources[s - 1]
            total = out.float().sum() if total is None else total + out.float().sum()
        torch.autograd.grad(total, [*sources, query, norm_weight], allow_unused=True)
    return run

class _NoLaunch:
    """Stands in for a @triton.jit kernel: `kernel[grid](...)` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None



@contextlib.contextmanager
def stubbed_launches():
    """Within the block every routing kernel launch (per-call, phase-1 and merge kernels) does
    nothing: what is left of a routing call is its host work."""
    from mhar_kernels import triton_grouped, triton_routing

    kernels = [(triton_routing, "_route_fwd_kernel"), (triton_routing, "_route_bwd_kernel"),
               (triton_grouped, "_phase1_fwd_kernel"), (triton_grouped, "_phase1_bwd_kernel")]
    saved = [getattr(module, name) for module, name in kernels]
    for module, name in kernels:
        setattr(module, name, _NoLaunch())
    try:
        yield
    finally:
        for (module, name), kernel in zip(kernels, saved):
            setattr(module, name, kernel)
