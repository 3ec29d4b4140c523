"""Compile the routing kernels for sm_90 without a GPU and report what ptxas made of them.

    python bench/compile_report.py            # paper shapes, N = 73, bf16: one line each
    python bench/compile_report.py --json     # the same as JSON
    python bench/compile_report.py --kernels phase1_forward,phase1_backward --group 11 --shapes 1280x8

Uses Triton's ahead-of-time path (`triton.compile` with `GPUTarget("cuda", 90, 64)`) and the
ptxas that ships with Triton, so it runs on a CPU-only machine. The registers and spills are those of
Triton's own build (the cubin a launch loads: ptxas with Triton's options, whose `-v` report Triton
prints on request), not of a second ptxas run with other flags; run it with another Triton
(for example 3.6 in a second environment) to compare versions. For each kernel and variant it
reports registers per thread, spill bytes, sites per program (phase 1), the widest global/async
source access in the PTX and whether the loop over sources is software-pipelined (cp.async groups).
Async copies are counted by width twice: all of them (slots, read flags and fp32 statistics are 4-
or 8-byte copies too) and those of source tiles alone (the copies of the load in
`routing_kernels._load_source`, told apart by the PTX's line information).

Must run without TRITON_INTERPRET=1 (the interpreter replaces the compiler). A compile takes seconds
(the whole default report about 1.5 minutes on a CPU): one progress line per kernel goes to stderr
(`progress_line`), so a log shows the work as it goes; the table goes to stdout at the end.
"""
from __future__ import annotations

import argparse
import contextlib
import inspect
import io
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
for _folder in (ROOT, ROOT / "kernels"):  # a plain checkout: mhar_titan (the exit handler) and mhar_kernels
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))

# The paper's shapes (d, H) and the deepest site of the 1b flavor.
SHAPES = [(512, 1), (512, 8), (1024, 1), (1024, 8), (1280, 1), (1280, 8)]
N_SOURCES = 73
TOKENS = 2048

# Pointer arguments as the launchers pass them (triton_routing, triton_grouped): the depth buffer
# BUF (and its gradient buffer GRADS) in the sources' dtype, the call's int32 slot vector SLOTS and
# add flags ACCUM, the (d,) null source NULL cast to the sources' dtype, phase 1's int8 read table
# READS and its (g, B, T, d) mixes MIX / mix gradients DMIX in the sources' dtype.
_POINTER_ARGS = {
    "forward": dict(BUF="*SRC", SLOTS="*i32", NULL="*SRC", Q="*SRC", G="*SRC", PARTIAL="*SRC", ALPHA="*SRC",
                    STATE_OUT="*SRC", STATE_LSE="*fp32", OUT="*SRC", MIX="*SRC", RES="*SRC", STATS="*fp32"),
    "backward": dict(BUF="*SRC", SLOTS="*i32", GRADS="*SRC", ACCUM="*i32", NULL="*SRC", Q="*SRC", G="*SRC",
                     ALPHA="*SRC", DOUT="*SRC", MIX="*SRC", RES="*SRC", STATS="*fp32", PARTS="*fp32",
                     DALPHA_PART="*fp32", STATE_LSE="*fp32", DSTATE="*SRC", DSTATE_NORM="*fp32"),
    "phase1_forward": dict(BUF="*SRC", SLOTS="*i32", NULL="*SRC", READS="*i8", MIX="*SRC", Q="*SRC", G="*SRC",
                           LSE="*fp32"),
    "phase1_backward": dict(BUF="*SRC", SLOTS="*i32", GRADS="*SRC", ACCUM="*i32", NULL="*SRC", READS="*i8",
                            DMIX="*SRC", Q="*SRC", G="*SRC", DNORM="*fp32", LSE="*fp32", T_PART="*fp32",
                            DNULL_PART="*fp32"),
}
# The general variant (aligned=False) compiles the code for sources and gradient rows whose 16-byte
# alignment is unknown: no ALIGNED hint, and no divisibility-16 specialisation of the depth buffer
# and its gradient buffer (Triton gives it only to pointers that are divisible at launch). (A
# freshly allocated buffer is aligned, so a general launch at these shapes gets the
# specialisation and may still vectorise its source loads.)
_ROW_ARGS = frozenset({"BUF", "GRADS"})
# Grouped routing's phase 1 (triton_grouped): the group size `auto` picks at 1b.
GROUP = 11
_SCALAR_ARGS = dict(N="i32", NG="i32", C="i32", BT="i32", D="i32", H="i32", K="i32", eps="fp32")


def _triton_build(triton, src, num_warps: int, maxnreg: int | None) -> tuple:
    """(the compiled kernel, ptxas's ``-v`` report) of Triton's own build for sm_90: ``triton.compile``
    runs ptxas itself, with its own options (line info, ``--regAllocOptLevel``, ``PTXAS_OPTIONS``);
    its report is captured through Triton's ``dump_ptxas_log`` knob, with the cache bypassed
    (``always_compile``) so that ptxas runs every time. The cubin it returns is the one a launch loads.

    Raises RuntimeError when Triton's ptxas fails or printed no report."""
    from triton.backends.compiler import GPUTarget

    knobs = triton.knobs
    log = io.StringIO()
    with knobs.nvidia.scope(), knobs.compilation.scope():
        knobs.nvidia.dump_ptxas_log = True
        knobs.compilation.always_compile = True
        try:
            with contextlib.redirect_stdout(log):
                compiled = triton.compile(src, target=GPUTarget("cuda", 90, 64),
                                          options=dict(num_warps=num_warps, maxnreg=maxnreg))
        except Exception as exc:  # PTXASError, CompilationError
            raise RuntimeError(f"Triton's sm_90 build failed: {str(exc)[-2000:]}") from None
    report = log.getvalue()
    if "Used " not in report:
        raise RuntimeError("Triton's build printed no ptxas report (TRITON_DUMP_PTXAS_LOG ignored by this Triton?)")
    return compiled, report


def compile_kernel(kind: str, d: int, heads: int, *, aligned: bool, n_sources: int = N_SOURCES,
                   tokens: int = TOKENS, dtype: str = "bf16", flags: dict | None = None, group: int = GROUP) -> dict:
    """Compile a routing kernel for sm_90 as a launch with these arguments would: kind "forward" /
    "backward" (per call, routing_kernels), "merge_forward" / "merge_backward" (the same kernels
    with grouped routing's phase-1 state in and its gradients out, triton_merge) or
    "phase1_forward" / "phase1_backward" (grouped routing's phase 1 over a group of `group`
    sites, triton_grouped).

    Integer arguments divisible by 16 and every pointer get Triton's divisibility-16
    specialisation, as at run time; in the general variant (aligned=False) the depth buffer and
    its gradient buffer do not (`_ROW_ARGS`: rows of unknown alignment). dtype: "bf16" or "fp32" sources; flags: the kernel's
    HAS_* constexprs (default: replacement routing without a null source, the mix residual
    for bf16, and a backward that adds into gradient rows of the depth buffer, HAS_ACCUM; phase 1:
    no null source, HAS_ACCUM, CHUNKED where the group is more than one site chunk). The launch's
    warps and register limit (maxnreg) are the launcher's. The numbers are those of Triton's own
    build (`_triton_build`: ptxas run by Triton with Triton's options; the cubin it returns is read
    back with cuobjdump). Returns {'registers', 'spill_bytes' (spill stores + loads, bytes per
    thread), 'spill_store_bytes', 'spill_load_bytes', 'cubin_registers', 'cubin_stack_bytes' (the
    cubin's own resource usage), 
    'num_warps', 'site_block' (phase 1, else None), 'block_t', 'pipelined' (sources prefetched by
    16-byte cp.async in a multi-stage loop), 'ptxas' (its -v report)} and `access_counts`'s counts
    ('scalar_16bit_loads', 'accesses_128bit', 'async_copies_128bit' / '_8byte' / '_4byte',
    'source_copies_128bit' / '_8byte' / '_4byte', 'loads_128bit', 'stores_128bit').
    Raises RuntimeError when this Triton has no CUDA backend or ptxas fails."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from mhar_kernels import grouped_kernels as gk
    from mhar_kernels import routing_kernels as rk
    if rk.interpret_requested():
        raise RuntimeError("compile_report needs the compiler: unset TRITON_INTERPRET")
    from mhar_kernels import triton_grouped as tg
    from mhar_kernels import triton_routing as tr

    if "nvidia" not in getattr(triton.backends, "backends", {}):
        raise RuntimeError("this Triton build has no CUDA backend")
    fn = dict(forward=rk._route_fwd_kernel, backward=rk._route_bwd_kernel, merge_forward=rk._route_fwd_kernel,
              merge_backward=rk._route_bwd_kernel, phase1_forward=gk._phase1_fwd_kernel,
              phase1_backward=gk._phase1_bwd_kernel)[kind]
    merge = kind.startswith("merge")  # the fused merge: the per-call kernels with the phase-1 state
    kind = kind.removeprefix("merge_")
    backward = kind.endswith("backward")
    if kind.startswith("phase1"):
        cfg = tg.launch_config(tokens, group, heads, d // heads, backward=backward)
    else:
        cfg = tr.launch_config(tokens, heads, d // heads, backward=backward)
    num_warps, maxnreg = cfg.pop("num_warps"), cfg.pop("maxnreg", None)  # launch options, not constexprs
    names = fn.arg_names
    types = {k: v.replace("SRC", dtype) for k, v in _POINTER_ARGS[kind].items()}
    types |= {k: v for k, v in _SCALAR_ARGS.items() if k in names}
    # backward: HAS_ACCUM, as the models run it (a site adds into gradient rows a deeper reader wrote)
    # HAS_RES for bf16 / fp16 (the saved mix's rounding residual), as the op runs them
    has_res = dtype != "fp32"
    defaults = dict(forward=dict(HAS_NULL=False, HAS_PARTIAL=False, HAS_STATE=merge, HAS_RES=has_res),
                    backward=dict(HAS_ALPHA=False, HAS_NULL=False, HAS_ACCUM=True, HAS_RES=has_res,
                                  HAS_STATE=merge, WRITE_DSTATE=merge),
                    phase1_forward=dict(HAS_NULL=False),
                    phase1_backward=dict(HAS_NULL=False, HAS_ACCUM=True, CHUNKED=cfg.get("SB", 0) < group))[kind]
    constexprs = dict(defaults, **(flags or {}), ALIGNED=aligned, NUM_STAGES=tr.NUM_STAGES, CDT=tl.float32,
                      RNE_BF16=False, **cfg)
    values = dict(N=n_sources, BT=tokens, D=d, H=heads, K=d // heads)
    divisible = [k for k in types if k.isupper() and types[k].startswith("*") and (aligned or k not in _ROW_ARGS)]
    divisible += [k for k, v in values.items() if v % 16 == 0]
    src = ASTSource(fn, {k: types.get(k, "constexpr") for k in names},
                    {(names.index(k),): v for k, v in constexprs.items()},
                    {(names.index(k),): [["tt.divisibility", 16]] for k in divisible})
    compiled, report = _triton_build(triton, src, num_warps, maxnreg)
    ptx = compiled.asm["ptx"]
    regs = int(re.search(r"Used (\d+) registers", report).group(1))
    stores = sum(int(x) for x in re.findall(r"(\d+) bytes spill stores", report))
    loads = sum(int(x) for x in re.findall(r"(\d+) bytes spill loads", report))
    cubin = cubin_usage(triton, compiled.asm["cubin"])
    counts = access_counts(ptx, _source_tile_load(rk))
    return dict(registers=regs, spill_bytes=stores + loads, spill_store_bytes=stores, spill_load_bytes=loads,
                cubin_registers=cubin["registers"], cubin_stack_bytes=cubin["stack"], num_warps=num_warps, site_block=cfg.get("SB"),
                block_t=cfg["BLOCK_T"], scalar_16bit_loads=counts["scalar_16bit"],
                accesses_128bit=counts["128bit"], async_copies_128bit=counts["async_128bit"],
                async_copies_8byte=counts["async_8byte"], async_copies_4byte=counts["async_4byte"],
                source_copies_128bit=counts["source_128bit"], source_copies_8byte=counts["source_8byte"],
                source_copies_4byte=counts["source_4byte"],
                loads_128bit=counts["load_128bit"], stores_128bit=counts["store_128bit"],
                pipelined=counts["async_128bit"] > 0 and "cp.async.wait_group" in ptx, ptxas=report.strip())


def cubin_usage(triton, cubin: bytes) -> dict:
    """{'registers', 'stack'} (bytes of stack frame, where spills go) of the kernel in ``cubin``, as
    ``cuobjdump --dump-resource-usage`` (shipped with Triton) reads them from the binary itself.
    Raises RuntimeError when cuobjdump fails or reports no kernel."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        proc = subprocess.run([triton.knobs.nvidia.cuobjdump.path, "--dump-resource-usage", str(path)],
                              capture_output=True, text=True)
    found = re.search(r"REG:(\d+) STACK:(\d+)", proc.stdout)
    if proc.returncode or not found:
        raise RuntimeError(f"cuobjdump could not read the cubin: {(proc.stderr or proc.stdout)[-2000:]}")
    return dict(registers=int(found.group(1)), stack=int(found.group(2)))


def _source_tile_load(routing_kernels) -> tuple[str, int]:
    """(file name, line) of the source-tile load in `routing_kernels._load_source`, the one load
    every routing kernel reads its sources' [BLOCK_T, HB, KB] tiles with."""
    fn = routing_kernels._load_source.fn
    lines, first = inspect.getsourcelines(fn)
    line = next(first + i for i, text in enumerate(lines) if "tl.load(base" in text)
    return Path(inspect.getsourcefile(fn)).name, line


def access_counts(ptx: str, source_load: tuple[str, int]) -> dict:
    """Global accesses in the PTX: 'scalar_16bit' loads (ld.global.b16: one bf16 per thread),
    '128bit' accesses (ld/st.global .v4.b32 and 16-byte cp.async) and 'async_128bit' copies alone;
    loads and stores apart: 'async_8byte' / 'async_4byte' copies (narrower cp.async, global to
    shared: source tiles loaded in halves or quarters of 128 bits, but also the int32 slots, int8
    read flags and fp32 logits), 'load_128bit' (ld.global .v4) and 'store_128bit'
    (st.global .v4). 'source_128bit' / 'source_8byte' / 'source_4byte': the cp.async copies whose
    innermost source location (the `.loc` before them) is `source_load`, (file name, line): the
    source tiles. Raises RuntimeError for PTX without line information."""
    files = {number: Path(name).name for number, name in re.findall(r'^\s*\.file\s+(\d+)\s+"([^"]+)"', ptx, re.M)}
    if not files:
        raise RuntimeError("the PTX has no line information (TRITON_DISABLE_LINE_INFO?): source tiles cannot "
                           "be told apart")
    copies, source, where = [], [], None
    for text in ptx.splitlines():
        loc = re.match(r"\s*\.loc\s+(\d+)\s+(\d+)\s", text)
        if loc:
            where = (files.get(loc.group(1)), int(loc.group(2)))
        copy = re.search(r"cp\.async\.c[ag]\.shared\.global \[[^]]*\], \[[^]]*\], (0x[0-9a-f]+|\d+)", text)
        if copy:
            copies.append(int(copy.group(1), 0))
            if where == source_load:
                source.append(copies[-1])
    loads = len(re.findall(r"ld\.global(?:\.\w+)*\.v4\.b32", ptx))
    stores = len(re.findall(r"st\.global(?:\.\w+)*\.v4\.b32", ptx))
    return dict(scalar_16bit=len(re.findall(r"ld\.global(?:\.\w+)*\.b16\b", ptx)),
                async_128bit=copies.count(16), async_8byte=copies.count(8), async_4byte=copies.count(4),
                source_128bit=source.count(16), source_8byte=source.count(8), source_4byte=source.count(4),
                load_128bit=loads, store_128bit=stores, **{"128bit": loads + stores + copies.count(16)})


def report(shapes=SHAPES, variants=("aligned", "general"), kernels=("forward", "backward"),
           group: int = GROUP, on_row: Optional[Callable[[dict, int, int], None]] = None) -> list[dict]:
    """compile_kernel for each of `kernels` at every (d, H) of `shapes` and every variant, as rows
    (phase-1 kernels over a group of `group` sites). on_row(row, done, total) is called after each
    compile (the command prints its progress line there: a compile takes seconds)."""
    rows = []
    total = len(shapes) * len(kernels) * len(variants)
    for d, heads in shapes:
        for kind in kernels:
            for aligned in (v == "aligned" for v in variants):
                r = compile_kernel(kind, d, heads, aligned=aligned, group=group)
                rows.append(dict(kernel=kind, d=d, H=heads, N=N_SOURCES, variant="aligned" if aligned else "general",
                                 **{k: v for k, v in r.items() if k != "ptxas"}))
                if on_row is not None:
                    on_row(rows[-1], len(rows), total)
    return rows


def progress_line(row: dict, done: int, total: int, seconds: float) -> str:
    """The command's progress line after a compile (stderr, one per kernel, also into a log):
    ``compile_report: [3/24] backward d=512 H=8 aligned: 96 registers, 0 spill bytes (41 s)``;
    ``seconds`` since the command started."""
    spills = row["spill_store_bytes"] + row["spill_load_bytes"]
    return (f"compile_report: [{done}/{total}] {row['kernel']} d={row['d']} H={row['H']} {row['variant']}: "
            f"{row['registers']} registers, {spills} spill bytes ({seconds:.0f} s)")


def markdown(rows: list[dict], title: str) -> str:
    """The report's rows as its Markdown table under ``title`` (what the command prints)."""
    lines = [title, "",
             "| kernel | d | H | variant | sites per program | warps | registers | spill bytes (stores / loads) "
             "| 16-bit loads | 128-bit accesses | async copies 16 / 8 / 4 bytes | of source tiles | 128-bit loads "
             "| 128-bit stores | pipelined |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---|---|---:|---:|---|"]
    lines += [f"| {r['kernel']} | {r['d']} | {r['H']} | {r['variant']} | {r['site_block'] or '-'} | "
              f"{r['num_warps']} | {r['registers']} | "
              f"{r['spill_store_bytes']} / {r['spill_load_bytes']} | {r['scalar_16bit_loads']} | "
              f"{r['accesses_128bit']} | "
              f"{r['async_copies_128bit']} / {r['async_copies_8byte']} / {r['async_copies_4byte']} | "
              f"{r['source_copies_128bit']} / {r['source_copies_8byte']} / {r['source_copies_4byte']} | "
              f"{r['loads_128bit']} | {r['stores_128bit']} | "
              f"{'yes' if r['pipelined'] else 'no'} |" for r in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--shapes", default=",".join(f"{d}x{h}" for d, h in SHAPES), help="comma list of dxH")
    p.add_argument("--variants", default="aligned,general")
    p.add_argument("--kernels", default="forward,backward",
                   help="comma list of forward, backward, merge_forward, merge_backward, phase1_forward, "
                   "phase1_backward")
    p.add_argument("--group", type=int, default=GROUP, help="sites per group of the phase-1 kernels")
    p.add_argument("--out", type=Path, help="also write the table (or JSON) to this file")
    a = p.parse_args(argv)
    import triton

    shapes = [tuple(int(x) for x in shape.split("x")) for shape in a.shapes.split(",")]
    began = time.perf_counter()

    def on_row(row: dict, done: int, total: int) -> None:  # a line per compile, on a terminal or in a log
        print(progress_line(row, done, total, time.perf_counter() - began), file=sys.stderr, flush=True)

    try:
        rows = report(shapes, a.variants.split(","), a.kernels.split(","), a.group, on_row=on_row)
    except RuntimeError as exc:
        raise SystemExit(f"compile_report: {exc}")
    if a.json:
        text = json.dumps(dict(triton=triton.__version__, rows=rows), indent=2)
    else:
        group = f", phase-1 group of {a.group} sites" if "phase1" in a.kernels else ""
        text = markdown(rows, f"triton {triton.__version__}, Triton's own sm_90 build (no GPU), bf16, N = {N_SOURCES}, "
                              f"{TOKENS} tokens{group}")
    print(text)
    if a.out:
        a.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    from mhar_titan.cli_args import run_command

    run_command(main)
