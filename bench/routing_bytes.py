"""Routing bytes per training step: counted from the kernels' launches (`mhar_kernels.traffic`)
from the model's routing plan, per call and grouped, beside the floor; and measured by counting
the routing-only harness (`bench/byte_count.py`). Run through `bench/routing.py --bytes`.
"""
from __future__ import annotations

import os
import pathlib
import sys

import torch

if not torch.cuda.is_available():  # Triton runs on CPU only through its interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from mhar_kernels.traffic import H200_PROGRAMS, grouped_traffic, routing_traffic  # noqa: E402
from mhar_titan.components.performance import grouped_step_traffic, step_traffic  # noqa: E402
from mhar_titan.models.args import ModelArgs  # noqa: E402
from mhar_titan.models.plan import RoutingPlan  # noqa: E402
from routing_harness import MICRO_BATCH, SHAPES, auto_group, step_groups  # noqa: E402


def moved_bytes(scope: str, b: int, t: int, d: int, n: int, heads: int, dtype, device) -> int:
    """Counted bytes of one fused call over n sources ("call") or of the n sites of a step,
    site s reading the first s sources, rows of one depth buffer as in the models ("step"), forward +
    backward."""
    from mhar_kernels.triton_routing import reduce_programs

    sites = [list(range(n))] if scope == "call" else [list(range(s)) for s in range(1, n + 1)]
    return routing_traffic(sites, dim=d, tokens=b * t, dtype=dtype, heads=heads,
                           programs=reduce_programs(b * t, device)).total

def grouped_moved_bytes(b: int, t: int, d: int, n: int, heads: int, dtype, device, g: int) -> int:
    """Counted bytes of the n sites of a step routed in groups of g (`one_grouped_step`)."""
    from mhar_kernels.triton_grouped import launch_config
    from mhar_kernels.triton_routing import reduce_programs

    block = launch_config(b * t, g, heads, d // heads, backward=True)["SB"]
    return grouped_traffic(step_groups(n, g), dim=d, tokens=b * t, dtype=dtype, heads=heads,
                           programs=reduce_programs(b * t, device), backward_site_block=block).total


def grouped_bytes_table(scales=("100m", "350m", "1b"), dtype=torch.bfloat16) -> str:
    """Per scale and AC mode: per-call routing beside grouped routing at the group size `auto` picks."""
    lines = [
        f"Grouped routing at the group size `routing_group_size=\"auto\"` picks, beside per-call routing, as "
        f"modelled (`mhar_kernels.traffic.grouped_traffic`: the fused phase 1 and merge, every launch, host "
        f"reduction and per-token tensor of the step, the slot writes and the routing parameters' gradient "
        f"assembly; within 1% of "
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
        "2N + 1 backward per site. The sources are rows of one depth buffer: the backward column includes the "
        "read-back of the gradient rows a deeper site wrote; slot writes: the copies into slots (the embedding "
        "and every sublayer output, copied in after its output projection; AC full copies a recomputed attention "
        "output again); the last column is the "
        "ratio if separate source tensors' per-site gradients were summed by autograd instead.",
        "",
        "| scale | AC | sites | micro-batch | d | forward | backward | reduce | slot writes "
        "| counted | floor | counted / floor | without shared gradients |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
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
                f"{kinds['backward']:.2f} | {kinds['reduce']:.3f} | {kinds['write']:.3f} | "
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

