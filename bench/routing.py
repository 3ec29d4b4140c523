"""Depth-routing forward+backward time: eager vs torch.compile vs the fused Triton kernels.

For each shape (the paper's: bf16, H = 8) it times one routing call over N sources and the
full set of calls of one training step (site s = 1..2L+1 reads s sources), and reports
milliseconds (median after warm-up; CUDA events on a GPU), the bytes the fused kernels move
as counted by `mhar_kernels.traffic` (forward, backward and reduce launches; in the step the
sources are shared as the models share them, so their gradients are added inside the backward
launches), the achieved GB/s and its fraction
of the measured device copy bandwidth. The same bytes are charged to eager and compile (they
move more), so the GB/s column compares implementations at equal work. Gradients are taken
with torch.autograd.grad (nothing accumulates into the leaves' .grad between calls).

    python bench/routing.py                       # CUDA: paper shapes, eager/compile/triton
    python bench/routing.py --append BENCHMARKS.md
    python bench/routing.py --shapes toy --iters 2 --warmup 1      # CPU (Triton via the interpreter)
    python bench/routing.py --bytes                # counted bytes per step vs the floor, no timing
    python bench/routing.py --host                 # host time of one call, launches stubbed
    python bench/routing.py --group 11             # also the step with its sites in groups of 11
    python bench/routing.py --scales 1b --impls triton --group auto   # one shape, g = "auto" for it
    python bench/routing.py --isolated --scales 1b --group auto      # do_bench: step per call vs grouped

`--bytes` prints, for 100m / 350m / 1b (MHAR, H = 8, sublayer, replace, bf16, the paper's
micro-batches), the bytes the kernels move per training step as counted by
`mhar_kernels.traffic` from the model's routing plan, beside the floor (N + 1 rows forward and
2N + 1 backward per site), with activation checkpointing off and on, then the same for grouped routing at the group size
`routing_group_size="auto"` picks beside per-call routing (`grouped_bytes_table`; the merge
modelled as if fused). It does no timing, so its run time does not depend on the machine's
load; `--host` is the host timing. `--bytes --measure 100m,...` counts what really runs
(`measured_bytes`: the routing-only harness through `bench/byte_count.py`, minutes per scale on
CPU) and prints it beside the model and the floor (`--json`: the same as an object).

`--isolated` times, for each shape, one whole step of per-call routing and of grouped routing
(Triton, forward + backward) with `triton.testing.do_bench` (which empties the L2 cache before
every run) beside a device copy timed the same way in the same process, and reports the achieved
bandwidth as a fraction of that copy bandwidth. On CPU (no do_bench) it falls back to the host
clock and says so.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import statistics
import sys
import time
import traceback

import torch

if not torch.cuda.is_available():  # Triton runs on CPU only through its interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mhar_kernels.traffic import (H200_PROGRAMS, Launch, Traffic, element_bytes, grouped_traffic,  # noqa: E402
                                  routing_traffic)
from mhar_titan.files import write_text  # noqa: E402
from mhar_titan.models.args import ModelArgs  # noqa: E402
from mhar_titan.models.plan import RoutingPlan  # noqa: E402
from mhar_kernels.dispatch import merge, phase1, route as model_route, share_gradient  # noqa: E402

# name: (B, T, d, N); N = 2L + 1 sources at the final routing of an L-layer model.
SHAPES = {
    "paper": {"100m": (2, 2048, 512, 25), "350m": (1, 1024, 1024, 49), "1b": (1, 1024, 1280, 73)},
    "toy": {"toy": (1, 8, 64, 5)},
}
IMPLS = ("eager", "compile", "triton")
# The paper's micro-batches (batch, sequence length) per scale; bench/throughput.py uses them too.
MICRO_BATCH = {"100m": (8, 2048), "350m": (4, 1024), "1b": (2, 1024), "debug": (2, 64)}
SECTION = "## Kernels: depth routing"


def auto_group(shape: str) -> int:
    """The group size `routing_group_size="auto"` picks for the model flavor `shape` names (MHAR,
    H = 8); shapes that name no flavor (toy) get 2."""
    from mhar_titan.models.args import FLAVORS

    if shape not in FLAVORS:
        return 2
    args = ModelArgs.from_flavor(shape, residual="attn_res", routing_heads=8, routing_group_size="auto")
    return RoutingPlan.from_args(args).group_size


def moved_bytes(scope: str, b: int, t: int, d: int, n: int, heads: int, dtype, device) -> int:
    """Counted bytes of one fused call over n sources ("call") or of the n sites of a step,
    site s reading the first s sources, shared as the models share them ("step"), forward +
    backward."""
    from mhar_kernels.triton_routing import reduce_programs

    sites = [list(range(n))] if scope == "call" else [list(range(s)) for s in range(1, n + 1)]
    return routing_traffic(sites, dim=d, tokens=b * t, dtype=dtype, heads=heads,
                           programs=reduce_programs(b * t, device)).total


def step_groups(n: int, g: int) -> list[tuple[list[int], list[list[int]]]]:
    """The n sites of a step (site k = 1..n reads sources 0..k-1) in groups of g consecutive sites,
    as `mhar_kernels.traffic.grouped_traffic` takes them: (start source ids, per site its in-group ids)."""
    return [(list(range(k0)), [list(range(k0, k0 + m)) for m in range(min(g, n + 1 - k0))])
            for k0 in range(1, n + 1, g)]


def grouped_moved_bytes(b: int, t: int, d: int, n: int, heads: int, dtype, device, g: int) -> int:
    """Counted bytes of the n sites of a step routed in groups of g (`one_grouped_step`)."""
    from mhar_kernels.triton_grouped import launch_config
    from mhar_kernels.triton_routing import reduce_programs

    block = launch_config(b * t, g, heads, d // heads, backward=True)["SB"]
    return grouped_traffic(step_groups(n, g), dim=d, tokens=b * t, dtype=dtype, heads=heads,
                           programs=reduce_programs(b * t, device), backward_site_block=block).total


def plan_sources(args: ModelArgs) -> list[list[int]]:
    """For each routing site of the model's routing plan, the entries (ids) of the (B, T, d)
    sources it reads; the null source is not a row and is left out."""
    plan = RoutingPlan.from_args(args)
    return [[j for j in site.reads if plan.sources[j].kind != "null"] for site in plan.sites]


def parameter_gradients(args: ModelArgs, dtype: torch.dtype) -> Launch:
    """Bytes autograd moves to assemble the gradients of the routing parameters of one step
    (kind "parameters"; independent of the tokens), as models/model.py lays them out: the
    pseudo-queries and key-norm weights are (S, d) parameters, layer i's blocks get the (2, d)
    slice of its two sites and each site selects its row, the final site selects its row of the
    whole parameter. Per parameter, backward then runs: per layer site a select backward ((d,)
    read, (2, d) written) and per layer one (2, d) addition of its two sites and a slice backward
    ((2, d) read, (S, d) written); for the final site a select backward ((d,) read, (S, d)
    written); and L additions of (S, d) summing the L + 1 contributions. Per-call routing
    (routing_group_size 1); grouped routing adds, per group of g > 1 sites, the slice backward of
    the group's (g, d) rows its phase 1 reads ((g, d) read, (S, d) written) and one more (S, d)
    addition. The null source and delta gates not included."""
    el, d, layers, s = element_bytes(dtype), args.dim, args.n_layers, args.n_routing_sites
    row, pair, whole = d * el, 2 * d * el, s * d * el
    groups = [g.size for g in RoutingPlan.from_args(args).groups if g.size > 1]
    read = 2 * layers * row + layers * 2 * pair + layers * pair + row + layers * 2 * whole
    written = 2 * layers * pair + layers * pair + layers * whole + whole + layers * whole
    read += sum(g * row + 2 * whole for g in groups)
    written += 2 * whole * len(groups)
    return Launch(None, "parameters", read=2 * read, written=2 * written)


def step_traffic(args: ModelArgs, tokens: int, dtype: torch.dtype, ac: str = "none",
                 programs: int = H200_PROGRAMS, shared: bool = True) -> Traffic:
    """Counted routing bytes of one training step of `args` at `tokens` tokens per micro-batch
    (shared: the sources' gradient buffers shared between sites, as the models run), with the
    routing parameters' gradient assembly (`parameter_gradients`)."""
    sites = plan_sources(args)
    t = routing_traffic(sites, dim=args.dim, tokens=tokens, dtype=dtype, heads=args.resolved_routing_heads,
                        delta=args.routing_mode == "delta", null_source=args.routing_null_source,
                        programs=programs, recomputed_sites=len(sites) - 1 if ac == "full" else 0, shared=shared)
    return Traffic(t.launches + (parameter_gradients(args, dtype),), t.floor, t.row_bytes)


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
    from mhar_kernels.triton_grouped import launch_config

    groups = plan_groups(args)
    heads = args.resolved_routing_heads
    g = max(len(late) for _, late in groups)
    block = launch_config(tokens, g, heads, args.dim // heads, backward=True)["SB"]
    t = grouped_traffic(groups, dim=args.dim, tokens=tokens, dtype=dtype, heads=heads,
                        delta=args.routing_mode == "delta", null_source=args.routing_null_source,
                        programs=programs, backward_site_block=block,
                        recomputed_sites=args.n_routing_sites - 1 if ac == "full" else 0)
    return Traffic(t.launches + (parameter_gradients(args, dtype),), t.floor, t.row_bytes)


def grouped_bytes_table(scales=("100m", "350m", "1b"), dtype=torch.bfloat16) -> str:
    """Per scale and AC mode: per-call routing beside grouped routing at the group size `auto` picks."""
    lines = [
        f"Grouped routing at the group size `routing_group_size=\"auto\"` picks, beside per-call routing, as "
        f"modelled (`mhar_kernels.traffic.grouped_traffic`: the fused phase 1 and merge, every launch, host "
        f"reduction and per-token tensor of the step, and the routing parameters' gradient assembly; within 1% of "
        f"a complete count of a debug-flavor step, tests/test_byte_count.py, and `--bytes --measure` counts the "
        f"paper shapes; MHAR H = 8, sublayer, replace, {dtype}, {H200_PROGRAMS} backward programs), GB per "
        "training step; source rows = (B, T, d) sources read per token by one forward.",
        "",
        "| scale | AC | g | backward site chunks | source rows, per call | source rows, grouped | modelled, per call | "
        "modelled, grouped | floor, per call | floor, grouped | grouped / per call |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    from mhar_kernels.triton_grouped import launch_config

    for scale in scales:
        args = ModelArgs.from_flavor(scale, residual="attn_res", routing_heads=8, routing_group_size="auto")
        plan = RoutingPlan.from_args(args)
        b, t = MICRO_BATCH[scale]
        g = plan.group_size
        chunks = -(-g // launch_config(b * t, g, 8, args.dim // 8, backward=True)["SB"])
        for ac in ("none", "full"):
            call, grouped = step_traffic(args, b * t, dtype, ac), grouped_step_traffic(args, b * t, dtype, ac)
            lines.append(
                f"| {scale} | {ac} | {g} | {chunks} | {plan.source_rows:,} | {plan.grouped_rows:,} | "
                f"{call.total / 1e9:.2f} | {grouped.total / 1e9:.2f} | {call.floor / 1e9:.2f} | "
                f"{grouped.floor / 1e9:.2f} | {grouped.total / call.total:.2f} |")
    return "\n".join(lines)


def bytes_table(scales=("100m", "350m", "1b"), dtype=torch.bfloat16) -> str:
    lines = [
        f"Counted routing traffic per training step (`mhar_kernels.traffic`, MHAR H = 8, sublayer, replace, "
        f"{dtype}, backward partial sums from {H200_PROGRAMS} programs), GB; floor = N + 1 rows forward and "
        "2N + 1 backward per site. The backward column includes the read-back of shared gradient buffers; "
        "the last column is the ratio if autograd summed separate per-site gradients instead.",
        "",
        "| scale | AC | sites | micro-batch | d | forward | backward | reduce | counted | floor | "
        "counted / floor | without shared gradients |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for scale in scales:
        args = ModelArgs.from_flavor(scale, residual="attn_res", routing_heads=8)
        b, t = MICRO_BATCH[scale]
        for ac in ("none", "full"):
            traffic = step_traffic(args, b * t, dtype, ac)
            unshared = step_traffic(args, b * t, dtype, ac, shared=False)
            kinds = {k: v / 1e9 for k, v in traffic.by_kind().items()}
            lines.append(
                f"| {scale} | {ac} | {args.n_routing_sites} | {b}x{t} | {args.dim} | {kinds['forward']:.2f} | "
                f"{kinds['backward']:.2f} | {kinds['reduce']:.3f} | "
                f"{traffic.total / 1e9:.2f} | {traffic.floor / 1e9:.2f} | {traffic.ratio:.2f}x | {unshared.ratio:.2f}x |")
    return "\n".join(lines)


def measured_bytes(scales=("100m", "350m", "1b"), families=("mhar", "mhar-grouped"), tokens=(4, 8, 12),
                   dtype=torch.bfloat16, progress=None, shapes=SHAPES["paper"], micro_batch=MICRO_BATCH) -> dict:
    """Measured routing bytes per step at the paper micro-batch: the routing-only harness
    (`byte_count.count_harness`, SHAPES["paper"]'s d and N, H = 8, Triton kernels through the
    interpreter) counted at each of `tokens` (batch 1), checked linear in tokens (every count
    within 1% of the line through the first and last), and extrapolated to MICRO_BATCH's tokens.
    Returns {scale: {family: {'modelled', 'measured', 'floor', 'counts'}}} in bytes ('modelled',
    'floor': `moved_bytes` / `grouped_moved_bytes` at the micro-batch; 'counts': tokens -> bytes).
    progress(result) after every scale and family. shapes, micro_batch: name -> (B, T, d, N) and
    (batch, sequence length) of the scales named.

    Raises:
        RuntimeError: a count off the line by more than 1% (not linear in tokens)."""
    import byte_count

    device = torch.device("cpu")
    result: dict = {}
    for scale in scales:
        _, _, d, n = shapes[scale]
        b, t = micro_batch[scale]
        g = auto_group(scale)
        for family in families:
            counts = {k: byte_count.count_harness(d, n, family, k, g, dtype=dtype)["bytes"] for k in tokens}
            lo, hi = tokens[0], tokens[-1]
            slope = (counts[hi] - counts[lo]) / (hi - lo)
            line = lambda k: counts[lo] + slope * (k - lo)  # noqa: E731
            off = {k: c / line(k) - 1 for k, c in counts.items()}
            if any(abs(v) > 0.01 for v in off.values()):
                raise RuntimeError(f"{scale} {family}: bytes not linear in tokens: {counts} (off the line by {off})")
            if family == "mhar":
                modelled = moved_bytes("step", b, t, d, n, 8, dtype, device)
                floor = routing_traffic([list(range(s)) for s in range(1, n + 1)], dim=d, tokens=b * t, dtype=dtype,
                                        heads=8).floor
            else:
                modelled = grouped_moved_bytes(b, t, d, n, 8, dtype, device, g)
                groups = step_groups(n, g)
                floor = grouped_traffic(groups, dim=d, tokens=b * t, dtype=dtype, heads=8).floor
            result.setdefault(scale, {})[family] = dict(modelled=modelled, measured=round(line(b * t)), floor=floor,
                                                        counts=counts)
            if progress is not None:
                progress(result)
    return result


def measured_table(result: dict) -> str:
    lines = [
        "Routing bytes per training step, measured (`bench/byte_count.py`: every aten op outside the kernels and "
        "every Triton launch's distinct loaded and stored bytes, counted on CPU through the interpreter) in the "
        "routing-only harness (each site over the sources before it, H = 8, bf16; the stand-in for the sublayers "
        "counted alone and subtracted) at a few tokens, linear in tokens, extrapolated to the paper's micro-batch; "
        "beside the model (`mhar_kernels.traffic`) and the floor, GB.",
        "",
        "| scale | family | micro-batch | tokens counted | modelled | measured | floor | measured / floor | "
        "measured / per call |",
        "|---|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for scale, families in result.items():
        b, t = MICRO_BATCH.get(scale, ("?", "?"))
        per_call = families.get("mhar", {}).get("measured")
        for family, r in families.items():
            vs = f"{r['measured'] / per_call:.2f}" if per_call else "-"
            name = family if family == "mhar" else f"{family} (g={auto_group(scale)})"
            lines.append(f"| {scale} | {name} | {b}x{t} | {', '.join(map(str, r['counts']))} | "
                         f"{r['modelled'] / 1e9:.2f} | {r['measured'] / 1e9:.2f} | {r['floor'] / 1e9:.2f} | "
                         f"{r['measured'] / r['floor']:.2f}x | {vs} |")
    return "\n".join(lines)


class _NoLaunch:
    """Stands in for a @triton.jit kernel: `kernel[grid](...)` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def host_ms(n: int = 73, d: int = 1280, heads: int = 8, iters: int = 200) -> dict:
    """Host time (ms) of routing with the two kernel launches stubbed out (argument check,
    pointer table, allocations, autograd; no device work), through the models' route
    (kernel="triton") and over sources shared as the models share them (`share_gradient`).
    CUDA tensors where there is a GPU; CPU tensors otherwise (needs TRITON_INTERPRET=1 so that
    the op accepts them).

    Returns {'call': median and 'call_min': minimum of one forward+backward call over n sources
    whose gradient buffers deeper sites already wrote (every site but a source's last reader),
    'share': median per source of `share_gradient` forward + backward (once per source and
    step, i.e. about once per call), 'total' = call + share}."""
    from mhar_kernels import triton_routing

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sources, query, norm_weight = make_inputs(1, 4, d, n, torch.bfloat16, device)
    saved = triton_routing._route_fwd_kernel, triton_routing._route_bwd_kernel
    triton_routing._route_fwd_kernel = triton_routing._route_bwd_kernel = _NoLaunch()
    try:
        grad_out = torch.ones_like(sources[0])
        shared = [share_gradient(x, "triton", heads) for x in sources]

        def call():  # gradients of q and g only: the shared buffers stay with their sinks, as mid-step
            out = model_route(shared, query, norm_weight, heads, kernel="triton")
            torch.autograd.grad(out, [query, norm_weight], grad_out)

        def share():  # n sources shared, used, and their gradients handed on
            views = [share_gradient(x, "triton", heads) for x in sources]
            torch.autograd.grad([v.sum() for v in views], sources)

        def plain():  # the same without share_gradient, subtracted from share()
            torch.autograd.grad([x.sum() for x in sources], sources)
        measure = timer(torch.device("cpu"))  # the host clock: there is no device work
        result = {}
        for name, fn in (("call", call), ("share", share), ("plain", plain)):
            for _ in range(10):
                fn()
            times = [measure(fn) for _ in range(iters)]
            result[name], result[name + "_min"] = statistics.median(times), min(times)
        result["share"] = max(0.0, result["share"] - result.pop("plain")) / n
        result["total"] = result["call"] + result["share"]
        return result
    finally:
        triton_routing._route_fwd_kernel, triton_routing._route_bwd_kernel = saved


def host_step_ms(shape: str = "1b", family: str = "mhar", heads: int = 8, iters: int = 5) -> dict:
    """Host time (ms) of one whole step's routing with every kernel launch stubbed out (the
    per-call and phase-1 kernels do nothing): `one_step` (family "mhar") or `one_grouped_step` at
    `auto_group(shape)` ("mhar-grouped") over SHAPES["paper"][shape]'s N sources of d, 4 tokens,
    bf16, forward and backward, AC none. CUDA tensors where there is a GPU, else CPU tensors
    (TRITON_INTERPRET=1).

    Returns {'median', 'min'} of the whole harness step over `iters` steps after one warm-up,
    {'standin_median', 'standin_min'} of the same loop with no routing (`standin_step`: each
    site's output is its newest source, the harness's sums and backward stay), and 'routing' =
    median - standin_median, the routing's own host time (sharing the sources included)."""
    from mhar_kernels import triton_grouped, triton_routing

    _, _, d, n = SHAPES["paper"][shape]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sources, query, norm_weight = make_inputs(1, 4, d, n, torch.bfloat16, device)
    if family == "mhar":
        run = one_step("triton", sources, query, norm_weight, heads)
    else:
        run = one_grouped_step("triton", sources, query, norm_weight, heads, auto_group(shape))
    kernels = [(triton_routing, "_route_fwd_kernel"), (triton_routing, "_route_bwd_kernel"),
               (triton_grouped, "_phase1_fwd_kernel"), (triton_grouped, "_phase1_bwd_kernel")]
    saved = [getattr(module, name) for module, name in kernels]
    for module, name in kernels:
        setattr(module, name, _NoLaunch())
    try:
        measure = timer(torch.device("cpu"))  # the host clock: there is no device work
        result = {}
        for key, fn in (("", run), ("standin_", standin_step(sources, query, norm_weight))):
            fn()
            times = [measure(fn) for _ in range(iters)]
            result[key + "median"], result[key + "min"] = statistics.median(times), min(times)
        result["routing"] = result["median"] - result["standin_median"]
        return result
    finally:
        for (module, name), kernel in zip(kernels, saved):
            setattr(module, name, kernel)


def standin_step(sources, query, norm_weight):
    """`one_step`'s loop without routing: site s's output is sources[s - 1] itself (no op, no
    sharing), then the same sum and one backward. Its host time is what `host_step_ms` subtracts."""
    def run():
        total = None
        for s in range(1, len(sources) + 1):
            out = sources[s - 1]
            total = out.float().sum() if total is None else total + out.float().sum()
        torch.autograd.grad(total, [*sources, query, norm_weight], allow_unused=True)
    return run


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


def median_ms(fn, device, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    measure = timer(device)
    return statistics.median(measure(fn) for _ in range(iters))


def copy_bandwidth(device: torch.device, dtype: torch.dtype, time_ms=None) -> float:
    """Measured device copy bandwidth in GB/s (read + write of a 1 GiB tensor; 64 MiB on CPU);
    time_ms(fn) -> milliseconds of one fn() (default: `median_ms`, 2 warm-ups, 10 runs)."""
    numel = (2**30 if device.type == "cuda" else 2**26) // torch.finfo(dtype).bits * 8
    src = torch.empty(numel, dtype=dtype, device=device).uniform_()
    dst = torch.empty_like(src)
    ms = (time_ms or (lambda fn: median_ms(fn, device, warmup=2, iters=10)))(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e9


def make_inputs(b, t, d, n, dtype, device, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    sources = [torch.randn(b, t, d, generator=gen).to(device, dtype).requires_grad_() for _ in range(n)]
    query = (torch.randn(d, generator=gen) * 0.3).to(device, dtype).requires_grad_()
    norm_weight = (1 + 0.1 * torch.randn(d, generator=gen)).to(device, dtype).requires_grad_()
    return sources, query, norm_weight


def one_call(impl, sources, query, norm_weight, heads):
    def run():
        out = model_route(sources, query, norm_weight, heads, kernel=impl)
        torch.autograd.grad(out, [*sources, query, norm_weight], torch.ones_like(out))
    return run


def one_step(impl, sources, query, norm_weight, heads):
    """All 2L+1 routing sites of a step: site s routes over sources[:s] (forward, then one backward)."""
    def run():
        total = None
        shared = [share_gradient(x, impl, heads) for x in sources]  # as the models pass their sources
        for s in range(1, len(sources) + 1):
            out = model_route(shared[:s], query, norm_weight, heads, kernel=impl)
            total = out.float().sum() if total is None else total + out.float().sum()
        torch.autograd.grad(total, [*sources, query, norm_weight])
    return run


def one_grouped_step(impl, sources, query, norm_weight, heads, g: int, end=None):
    """`one_step`'s sites in groups of g (grouped two-phase routing, `mhar_kernels.dispatch.phase1`
    and `merge`): phase 1 of each group over the sources that exist when it starts (fused for impl
    "triton"), then each site's merge with its in-group sources; a group of one site is a per-call
    route. end(out) -> a scalar stands in for what follows each site (default `out.float().sum()`);
    the step's loss is their sum."""
    end = end or (lambda out: out.float().sum())

    def run():
        total = None
        shared = [share_gradient(x, impl, heads) for x in sources]  # as the models pass their sources
        for start, late in step_groups(len(sources), g):
            if len(late) == 1:
                outs = [model_route([shared[j] for j in start], query, norm_weight, heads, kernel=impl)]
            else:
                size = len(late)
                rows = query.unsqueeze(0).expand(size, -1), norm_weight.unsqueeze(0).expand(size, -1)
                reads = tuple((True,) * len(start) for _ in late)
                states = phase1(*rows, reads, heads, 1e-6, impl, *[shared[j] for j in start])
                outs = [merge(states[i], states[size + i], states[2 * size][..., i, :].contiguous(), query,
                              norm_weight, heads, 1e-6, sources[0].dtype, impl, *[shared[j] for j in ids])
                        for i, ids in enumerate(late)]
            for out in outs:
                total = end(out) if total is None else total + end(out)
        torch.autograd.grad(total, [*sources, query, norm_weight])
    return run


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


def write_table(path: pathlib.Path, text: str) -> None:
    """Write a table file (the GPU suite's OUT_DIR), replacing an earlier version."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path, text + "\n")


def append_section(path: pathlib.Path, text: str, title: str) -> None:
    """Append `text` under `title` inside the kernels section of BENCHMARKS.md (other sections untouched)."""
    content = path.read_text() if path.exists() else "# Benchmarks\n"
    block = f"\n### {title}\n\n{text}\n"
    if SECTION not in content:
        content = content.rstrip("\n") + f"\n\n{SECTION}\n\nWritten by `bench/routing.py` and `bench/throughput.py`.\n"
    start = content.index(SECTION)
    nxt = content.find("\n## ", start + len(SECTION))
    end = len(content) if nxt == -1 else nxt
    content = content[:end].rstrip("\n") + "\n" + block + content[end:]
    write_text(path, content)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", choices=sorted(SHAPES), default="paper" if torch.cuda.is_available() else "toy")
    p.add_argument("--impls", default=",".join(IMPLS), help="comma list of eager, compile, triton")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--no-step", action="store_true", help="skip the full-step rows")
    p.add_argument("--scales", help="comma list of the shapes' names to run (default: all of --shapes)")
    p.add_argument("--group", default="0", help="also time the step with its sites in groups of this many "
                   "(grouped routing; eager, triton); auto: the group size routing_group_size='auto' picks per shape")
    p.add_argument("--append", type=pathlib.Path, help="append the table to this BENCHMARKS.md")
    p.add_argument("--out", type=pathlib.Path, help="write the table to this file after every row")
    p.add_argument("--budget-s", type=float, help="start no new measurement after this many seconds")
    p.add_argument("--bytes", action="store_true", help="print the counted bytes per step vs the floor, then stop")
    p.add_argument("--measure", help="with --bytes: count the routing-only harness at these scales (comma list; "
                   "minutes per scale on CPU) and print measured beside modelled")
    p.add_argument("--families", default="mhar,mhar-grouped", help="with --measure: mhar, mhar-grouped")
    p.add_argument("--tokens", default="4,8,12", help="with --measure: the token counts counted (batch 1)")
    p.add_argument("--json", action="store_true", help="with --bytes --measure: print the result as JSON "
                   "(scale -> family -> {modelled, measured, floor} in bytes)")
    p.add_argument("--host", action="store_true", help="print the host time of one call with launches stubbed "
                   "(--iters calls) and of one whole 1b step, per call and grouped, with the harness without "
                   "routing subtracted (max(3, iters // 20) steps), then stop")
    p.add_argument("--isolated", action="store_true", help="time one step per call and grouped (Triton) with "
                   "triton.testing.do_bench beside the copy bandwidth, then stop")
    a = p.parse_args(argv)
    if a.group != "auto" and not a.group.isdigit():
        p.error(f"--group must be a number of sites or auto, got {a.group!r}")
    shapes = SHAPES[a.shapes]
    if a.scales:
        unknown = sorted(set(a.scales.split(",")) - set(shapes))
        if unknown:
            p.error(f"unknown --scales {', '.join(unknown)} for --shapes {a.shapes}; choose from {', '.join(shapes)}")
        shapes = {name: shapes[name] for name in a.scales.split(",")}
    if a.bytes and a.measure:
        def write(result):
            if a.out:
                write_table(a.out, json.dumps(result, indent=1) if a.json else measured_table(result))

        result = measured_bytes(a.measure.split(","), a.families.split(","), tuple(map(int, a.tokens.split(","))),
                                progress=write)
        text = json.dumps(result, indent=1) if a.json else measured_table(result)
        print(text)
        write(result)
        if a.append and not a.json:
            append_section(a.append, text, "Routing bytes per step (measured, no GPU needed)")
        return
    if a.bytes or a.host:
        if a.bytes:
            text, title = bytes_table() + "\n\n" + grouped_bytes_table(), "Routing bytes per step (counted, no GPU needed)"
        else:
            where = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"
            host = host_ms(iters=a.iters)
            text, title = (
                f"Host time of one forward+backward routing call (N = 73, d = 1280, H = 8, bf16, kernel launches "
                f"stubbed, {a.iters} calls, sources shared as the models share them): median {host['call']:.3f} ms "
                f"(minimum {host['call_min']:.3f} ms), plus {host['share']:.3f} ms per source for sharing its "
                f"gradient (once per source and step): {host['total']:.3f} ms per call on {where}, load average "
                f"{os.getloadavg()[0]:.2f}."), "Routing host time"
            step_iters = max(3, a.iters // 20)
            steps = {family: host_step_ms("1b", family, iters=step_iters) for family in ("mhar", "mhar-grouped")}
            text += "\n\n" + " ".join(
                f"Host time of one whole 1b step, {family} ({'73 calls' if family == 'mhar' else 'g = 11'}; every "
                f"site, forward + backward, launches stubbed, AC none, {step_iters} steps): harness median "
                f"{r['median']:.1f} ms (minimum {r['min']:.1f} ms), of which the harness without routing "
                f"{r['standin_median']:.1f} ms: routing {r['routing']:.1f} ms." for family, r in steps.items()) + (
                f" Load average {os.getloadavg()[0]:.2f} on {where}.")
        print(text)
        if a.out:
            write_table(a.out, text)
        if a.append:
            append_section(a.append, text, title)
        return
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    impls = [i for i in a.impls.split(",") if i]
    for i in impls:
        if i not in IMPLS:
            p.error(f"unknown impl {i!r}; choose from {IMPLS}")
    heads = a.heads if a.shapes == "paper" else min(a.heads, 4)
    if a.isolated:
        def write(rows, bandwidth, how):
            if a.out:
                write_table(a.out, isolated_table(rows, bandwidth, how, heads, dtype, device))

        rows, bandwidth, how = isolated(shapes, heads, dtype, device, a.group, a.iters, write)
        text = isolated_table(rows, bandwidth, how, heads, dtype, device)
        print(text)
        write(rows, bandwidth, how)
        if a.append:
            append_section(a.append, text, "Routing step in isolation (do_bench)")
        return

    def progress(rows, bandwidth):
        if a.out:
            write_table(a.out, table(rows, bandwidth, heads, dtype, device))

    rows, bandwidth, missing = bench(shapes, impls, heads, dtype, device, a.warmup, a.iters,
                                     not a.no_step, a.budget_s, progress, a.group)
    text = table(rows, bandwidth, heads, dtype, device, missing)
    print(text)
    if a.out:
        write_table(a.out, text)
    if a.append:
        append_section(a.append, text, f"Routing forward+backward ({a.shapes} shapes)")
    if any("failed" in m for m in missing):
        raise SystemExit(f"failed: {', '.join(m for m in missing if 'failed' in m)}")


if __name__ == "__main__":
    main()
