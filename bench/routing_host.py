"""Host time of routing with the kernel launches stubbed: one call at N = 73 and one whole 1b
step's routing, per call and grouped; and the per-step cost of the routing logit scale /
learned temperature (`fold_host_ms`). Run through `bench/routing.py --host`.
"""
from __future__ import annotations

import statistics

import os
import pathlib
import sys

import torch

if not torch.cuda.is_available():  # Triton runs on CPU only through its interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from mhar_kernels.depth_buffer import DepthBuffer  # noqa: E402
from mhar_kernels.dispatch import route_rows  # noqa: E402
from routing_harness import (SHAPES, auto_group, last_reader_reads, make_inputs, one_grouped_step,  # noqa: E402
                             one_step, standin_step, stubbed_launches, host_timer)


def host_ms(n: int = 73, d: int = 1280, heads: int = 8, iters: int = 200) -> dict:
    """Host time (ms) of routing with the two kernel launches stubbed out (allocations, autograd;
    no device work), on the fused path as the models run it: rows of one depth buffer
    (`dispatch.route_rows`). CUDA tensors where there is a GPU; CPU tensors otherwise (needs
    TRITON_INTERPRET=1 so that the op accepts them).

    Returns {'call': median and 'call_min': minimum of one forward+backward call over n rows whose
    gradient rows deeper sites already wrote (every site but a row's last reader: its backward adds),
    'write': median per source of writing it into its slot (`DepthBuffer.write`, forward + backward,
    once per source and step, i.e. about once per call), 'total' = call + write}."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sources, query, norm_weight = make_inputs(1, 4, d, n, torch.bfloat16, device)
    first = last_reader_reads([range(n), range(n)], device)[0]  # a reader before the last: every row added into
    with stubbed_launches():
        grad_out = torch.ones_like(sources[0])
        buffer, token = DepthBuffer(n, sources[0]), None
        for slot, x in enumerate(sources):
            token = buffer.write(slot, x, token)
        buffer.gradients(first)

        def call():  # gradients of q and g only: the rows' gradients stay in the buffer, as mid-step
            out = route_rows(buffer, first, token, query, norm_weight, heads, 1e-6)
            torch.autograd.grad(out, [query, norm_weight], grad_out)

        def write():  # n sources written into their slots (a token chain) and their gradient rows handed on
            into, newest = DepthBuffer(n, sources[0]), None
            into.gradients(first)  # (made once per step, as the first backward reader makes it)
            for slot, x in enumerate(sources):
                newest = into.write(slot, x, newest)
            torch.autograd.grad(newest, sources, newest.new_empty(0))

        measure = host_timer  # host CPU time: there is no device work
        result = {}
        for name, fn in (("call", call), ("write", write)):
            for _ in range(10):
                fn()
            times = [measure(fn) for _ in range(iters)]
            result[name], result[name + "_min"] = statistics.median(times), min(times)
        result["write"] /= n
        result["total"] = result["call"] + result["write"]
        return result


def host_step_ms(shape: str = "1b", family: str = "mhar", heads: int = 8, iters: int = 5) -> dict:
    """Host time (ms) of one whole step's routing with every kernel launch stubbed out (the
    per-call and phase-1 kernels do nothing): `one_step` (family "mhar") or `one_grouped_step` at
    `auto_group(shape)` ("mhar-grouped") over SHAPES["paper"][shape]'s N sources of d, 4 tokens,
    bf16, forward and backward, AC none. CUDA tensors where there is a GPU, else CPU tensors
    (TRITON_INTERPRET=1).

    Returns {'median', 'min'} of the whole harness step over `iters` steps after one warm-up,
    {'standin_median', 'standin_min'} of the same loop with no routing (`standin_step`: each
    site's output is its newest source, the harness's sums and backward stay), and 'routing' =
    median - standin_median, the routing's own host time (the slot writes included)."""
    _, _, d, n = SHAPES["paper"][shape]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sources, query, norm_weight = make_inputs(1, 4, d, n, torch.bfloat16, device)
    if family == "mhar":
        run = one_step("triton", sources, query, norm_weight, heads)
    else:
        run = one_grouped_step("triton", sources, query, norm_weight, heads, auto_group(shape))
    with stubbed_launches():
        measure = host_timer  # host CPU time: there is no device work
        result = {}
        for key, fn in (("", run), ("standin_", standin_step(sources, query, norm_weight))):
            fn()
            times = [measure(fn) for _ in range(iters)]
            result[key + "median"], result[key + "min"] = statistics.median(times), min(times)
        result["routing"] = result["median"] - result["standin_median"]
        return result



def fold_host_ms(shape: str = "1b", iters: int = 50) -> dict:
    """Host time (ms) per step of taking the routing parameters' rows (`DepthRouting.rows`, once
    per forward) and their backward, for the 1b MHAR model (H = 8, sublayer, per call, bf16
    parameters as FSDP2 mixed precision hands them to the forward) at routing_logit_scale 1
    (today's: the raw parameter), a fixed scale ("match_heads:8": one (S, d) multiply folded into
    the pseudo-queries) and a learned temperature (exp of an (S, H) log-temperature, a per-head
    multiply). The fused kernels are the same in all three (they receive the effective query), so
    this is the whole host-side difference of a scaled step. CPU tensors (host work only).

    Returns {setting: (median, minimum)} over `iters` steps after 5 warm-up steps."""
    from mhar_titan.models.args import FLAVORS, ModelArgs
    from mhar_titan.models.router import DepthRouting

    settings = {"1.0 (fixed)": {}, "match_heads:8 (fixed)": dict(routing_logit_scale="match_heads:8"),
                "1.0 (learned)": dict(routing_temperature="learned")}
    result = {}
    for name, fields in settings.items():
        args = ModelArgs(**FLAVORS[shape], residual="attn_res", routing_heads=8, routing_kernel="triton", **fields)
        routing = DepthRouting(args)
        routing.reset_parameters()
        routing.to(torch.bfloat16)
        with torch.no_grad():
            routing.query.normal_(0.0, 0.3)
        groups = routing_plan_groups(args)

        def step():
            rows = routing.rows(groups)
            torch.autograd.backward([rows.query[0].float().sum(), rows.key_norm[0].float().sum()])
        for _ in range(5):
            step()
        times = [host_timer(step) for _ in range(iters)]
        result[name] = (statistics.median(times), min(times))
    return result


def routing_plan_groups(args):
    from mhar_titan.models.plan import RoutingPlan

    return RoutingPlan.from_args(args).groups
