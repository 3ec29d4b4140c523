"""Depth-routing forward+backward time: eager vs torch.compile vs the fused Triton kernels.

For each shape (the paper's: bf16, H = 8) it times one routing call over N sources and the
full set of calls of one training step (site s = 1..2L+1 reads s sources), and reports
milliseconds (median after warm-up; CUDA events on a GPU), the bytes the fused kernels move
as counted by `mhar_kernels.traffic` (forward, backward and reduce launches; in the step the
sources are rows of one depth buffer as in the models, so their gradients are added inside the
backward launches, and each source's copy into its slot is counted), the achieved GB/s and its fraction
of the measured device copy bandwidth. The same bytes are charged to eager and compile (they
move more), so the GB/s column compares implementations at equal work. Gradients are taken
with torch.autograd.grad (nothing accumulates into the leaves' .grad between calls).

    python bench/routing.py                       # CUDA: paper shapes, eager/compile/triton
    python bench/routing.py --append docs/benchmarks-log.md
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
import json
import os
import pathlib
import sys

import torch

if not torch.cuda.is_available():  # Triton runs on CPU only through its interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from routing_bytes import bytes_table, grouped_bytes_table, measured_bytes, measured_table  # noqa: E402
from routing_gpu import bench, isolated, isolated_table, table  # noqa: E402
from routing_harness import SHAPES  # noqa: E402
from routing_host import fold_host_ms, host_ms, host_step_ms  # noqa: E402
from tables import SECTION, append_section, write_table  # noqa: E402, F401  (SECTION: the section the tables go to)

IMPLS = ("eager", "compile", "triton")


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
    p.add_argument("--append", type=pathlib.Path, help="append the table to this notebook (docs/benchmarks-log.md)")
    p.add_argument("--out", type=pathlib.Path, help="write the table to this file after every row")
    p.add_argument("--budget-s", type=float, help="start no new measurement after this many seconds")
    p.add_argument("--bytes", action="store_true", help="print the counted bytes per step vs the floor, then stop")
    p.add_argument("--measure", help="with --bytes: count the routing-only harness at these scales (comma list; "
                   "minutes per scale on CPU) and print measured beside modelled")
    p.add_argument("--families", default="mhar,mhar-grouped", help="with --measure: mhar, mhar-grouped")
    p.add_argument("--tokens", default="4,8,12", help="with --measure: the token counts counted (batch 1)")
    p.add_argument("--json", action="store_true", help="with --bytes --measure: print the result as JSON "
                   "(scale -> family -> {modelled, measured, floor} in bytes); with --host: family -> "
                   "{step_ms_min, step_ms_median, call_us_min, load} (the routing's host time per 1b step)")
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
                f"Host time (host CPU time of the thread, `time.thread_time`) of one forward+backward routing call "
                f"(N = 73, d = 1280, H = 8, bf16, kernel launches stubbed, {a.iters} calls, sources read as rows "
                f"of one depth buffer as the models read them): median {host['call']:.3f} ms (minimum "
                f"{host['call_min']:.3f} ms), plus {host['write']:.3f} ms per source for writing it into its slot "
                f"(once per source and step): {host['total']:.3f} ms per call on {where}, load average "
                f"{os.getloadavg()[0]:.2f}."), "Routing host time"
            step_iters = max(3, a.iters // 20)
            steps = {family: host_step_ms("1b", family, iters=step_iters) for family in ("mhar", "mhar-grouped")}
            load = os.getloadavg()[0]
            text += "\n\n" + " ".join(
                f"Host time of one whole 1b step, {family} ({'73 calls' if family == 'mhar' else 'g = 11'}; every "
                f"site, forward + backward, launches stubbed, AC none, {step_iters} steps): harness median "
                f"{r['median']:.1f} ms (minimum {r['min']:.1f} ms), of which the harness without routing "
                f"{r['standin_median']:.1f} ms (minimum {r['standin_min']:.1f} ms): routing {r['routing']:.1f} ms "
                f"(minimum {r['min'] - r['standin_min']:.1f} ms)." for family, r in steps.items()) + (
                f" Load average {load:.2f} on {where}.")
            fold = fold_host_ms("1b")
            text += "\n\n" + "Host time per 1b step of the routing parameters' rows and their backward " + \
                "(`DepthRouting.rows`, once per forward; the logit scale / learned temperature folded into the " + \
                "pseudo-queries there, the kernels unchanged), median (minimum) over 50 steps: " + "; ".join(
                    f"routing_logit_scale {name}: {median:.3f} ms ({low:.3f} ms)" for name, (median, low) in fold.items()
                ) + f". Load average {os.getloadavg()[0]:.2f}."
            if a.json:  # family -> the routing's host time per step and one call's, and the load
                text = json.dumps({family: dict(step_ms_min=r["min"] - r["standin_min"], step_ms_median=r["routing"],
                                                call_us_min=1e3 * host["call_min"], load=load)
                                   for family, r in steps.items()}, indent=1)
        print(text)
        if a.out:
            write_table(a.out, text)
        if a.append and not a.json:
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
    from mhar_titan.cli_args import run_command

    run_command(main)
