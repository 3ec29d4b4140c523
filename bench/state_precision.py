"""Can grouped routing's phase-1 state (mix, normaliser, lse) be stored in the sources' dtype?

Measures, against the fp64 oracle (per-call routing of the same bf16 values in fp64), the
relative error (`tests/kernels_oracle.rel_err`, floor 1e-3) of every output and gradient of one
group (sources, null source, queries, key norms) with bf16 sources, (a) as built: the state in
fp32, and (b) the state rounded to bf16 between phase 1 and the merge (what a fused merge
reading a bf16 state would see), and (c) the fused phase 1 and merge (`routing_kernel="triton"`,
which store the state's mix in bf16; on CPU through TRITON_INTERPRET=1), and prints the worst
error of each beside the kernels' bf16 bound (0.03, tests/test_grouped.py BF16_TOL).

    python bench/state_precision.py                  # d = 64, H = 4 and d = 1280, H = 8; 3 seeds
"""
from __future__ import annotations

import argparse
import os
import pathlib
import sys

import torch

if not torch.cuda.is_available():  # the fused kernels on CPU: the interpreter, set before triton loads
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from kernels_oracle import oracle_route, rel_err  # noqa: E402
from mhar_titan.models import router  # noqa: E402
from mhar_titan.models.plan import Group, Site  # noqa: E402

BF16_TOL = 0.03


def worst_errors(d: int, heads: int, seed: int, n0: int = 5, g: int = 3, tokens: int = 14) -> dict:
    """{'fp32 state', 'bf16 state', 'fused'}: the largest relative error over one group's outputs
    and gradients (g sites over a null source and n0 start entries, site i merging i in-group
    entries), CPU (the fused kernels through the interpreter)."""
    gen = torch.Generator().manual_seed(seed)
    dtype = torch.bfloat16
    sources = [torch.randn(2, tokens // 2, d, generator=gen).to(dtype).requires_grad_() for _ in range(n0 + g - 1)]
    null = (0.5 * torch.randn(d, generator=gen)).to(dtype).requires_grad_()
    query = (1.5 / (d // heads) ** 0.5 * torch.randn(g, d, generator=gen)).to(dtype).requires_grad_()
    key_norm = (1 + 0.2 * torch.randn(g, d, generator=gen)).to(dtype).requires_grad_()
    grad_outs = [torch.randn(2, tokens // 2, d, generator=gen).to(dtype) for _ in range(g)]
    entries = [null, *sources]
    group = Group(0, tuple(range(g)), tuple(range(n0 + 1)), tuple(tuple(range(n0 + 1)) for _ in range(g)),
                  tuple(tuple(range(n0 + 1, n0 + 1 + i)) for i in range(g)))
    leaves = [*sources, null, query, key_norm]

    def run(route_site):
        outs = [route_site(i) for i in range(g)]
        return [*outs, *torch.autograd.grad(outs, leaves, grad_outs)]

    def grouped_run(round_state: bool, kernel: str = "eager"):
        settings = router.RoutingSettings(kernel, heads, 1e-6)
        states = router.phase1(group, entries, query, key_norm, settings)
        if round_state:  # the state stored in bf16 and read back (gradients pass through the rounding)
            states = {i: router.State(s.mix.to(dtype).to(s.mix.dtype), s.norm.to(dtype).to(s.norm.dtype),
                                      s.lse.to(dtype).to(s.lse.dtype)) for i, s in states.items()}
        return run(lambda i: router.merge(Site(i, 0, "attention", ()), [entries[j] for j in group.late[i]],
                                          states[i], dtype, None, query[i], key_norm[i], None, settings))

    truth = run(lambda i: oracle_route([entries[j] for j in group.early[i][1:] + group.late[i]], query[i],
                                       key_norm[i], heads, null_source=null))
    return {name: max(rel_err(x, t, floor=1e-3) for x, t in zip(grouped_run(rounded, kernel), truth))
            for name, rounded, kernel in (("fp32 state", False, "eager"), ("bf16 state", True, "eager"),
                                          ("fused", False, "triton"))}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=3)
    a = p.parse_args(argv)
    print("| d | H | seed | worst error, eager (fp32 state) | eager, state rounded to bf16 | fused (bf16 state) "
          "| bf16 bound |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for d, heads in ((64, 4), (1280, 8)):
        for seed in range(a.seeds):
            e = worst_errors(d, heads, seed)
            print(f"| {d} | {heads} | {seed} | {e['fp32 state']:.4f} | {e['bf16 state']:.4f} | {e['fused']:.4f} | "
                  f"{BF16_TOL} |")


if __name__ == "__main__":
    from mhar_titan.cli_args import run_command

    run_command(main)
