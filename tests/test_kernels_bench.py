"""The routing and throughput benchmarks run at toy sizes on CPU so they cannot rot
(issue 6, acceptance 6): eager, torch.compile and Triton (interpreter) routing; a debug-flavor
training step of the baseline and MHAR with activation checkpointing."""
from __future__ import annotations

import pathlib
import sys

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import routing as routing_bench  # noqa: E402
import routing_bytes  # noqa: E402
import throughput as throughput_bench  # noqa: E402


@pytest.mark.slow  # torch.compile and the Triton interpreter, each timed
def test_routing_bench_toy_all_impls(tmp_path, capsys):
    """One toy call per implementation; the table lands in the kernels section of BENCHMARKS.md
    without touching another section."""
    md = tmp_path / "BENCHMARKS.md"
    md.write_text("# Benchmarks\n\n## Data loader\n\nrows of someone else\n")
    routing_bench.main(["--shapes", "toy", "--iters", "1", "--warmup", "1", "--no-step", "--append", str(md)])
    text = md.read_text()
    assert text.startswith("# Benchmarks\n\n## Data loader\n\nrows of someone else\n")
    assert routing_bench.SECTION in text
    rows = [line for line in text.splitlines() if line.startswith("| toy | call |")]
    assert [r.split("|")[7].strip() for r in rows] == ["eager", "compile", "triton"]
    assert all(float(r.split("|")[8]) > 0 for r in rows)  # milliseconds


def test_bytes_charged_to_a_call_and_a_step():
    """A call over N sources is the accountant's one site plus the N sources' copies into the slots
    of a depth buffer; a step of sites over 1..N sources of one buffer copies each source once and
    adds the read-back of each source's gradient row at all but its last reader."""
    import torch
    from mhar_kernels import traffic

    b, t, d, n, heads = 1, 8, 64, 5, 4
    row = b * t * d * 2  # bf16
    call = routing_bytes.moved_bytes("call", b, t, d, n, heads, torch.bfloat16, torch.device("cpu"))
    launches = traffic.site_launches(0, n, dim=d, tokens=b * t, dtype=torch.bfloat16, heads=heads, programs=1)
    assert call == sum(launch.bytes for launch in launches) + 2 * n * row  # + n rows read, n slots written
    assert call >= (3 * n + 2) * row  # at least the floor (plus the mix residual's two rows)
    step = routing_bytes.moved_bytes("step", b, t, d, n, heads, torch.bfloat16, torch.device("cpu"))
    sites = sum(routing_bytes.moved_bytes("call", b, t, d, s, heads, torch.bfloat16, torch.device("cpu"))
                for s in range(1, n + 1))
    # source k is read by n - k + 1 sites, and copied into its slot once instead of once per call
    assert step == sites + (1 + 2 + 3 + 4) * row - 2 * ((1 + 2 + 3 + 4 + 5) - n) * row


def test_throughput_bench_debug_flavor(tmp_path):
    md = tmp_path / "BENCHMARKS.md"
    throughput_bench.main(["--scales", "debug", "--batch", "1", "--seq", "8", "--steps", "1", "--warmup", "0",
                           "--vocab", "256", "--ac", "full", "--families", "mhar,mhar-grouped", "--kernel", "triton",
                           "--append", str(md)])
    rows = [line for line in md.read_text().splitlines() if line.startswith("| debug | full |")]
    assert [r.split("|")[3].strip() for r in rows] == ["baseline", "mhar", "mhar-grouped"]
    assert [r.split("|")[4].strip() for r in rows] == ["-", "1", "3"]  # routing g: per call, auto at debug
    assert rows[0].split("|")[7].strip() == "1.00"  # ratio of the baseline to itself
    assert all(float(r.split("|")[6].replace(",", "")) > 0 for r in rows)  # tokens/s


def test_throughput_bench_options_apply_to_every_family(tmp_path):
    """--mask / --rope-per-document / --loss / --compile: every family runs with them, the table says so."""
    out = tmp_path / "throughput.md"
    throughput_bench.main(["--scales", "debug", "--batch", "1", "--seq", "16", "--steps", "1", "--warmup", "0",
                           "--vocab", "256", "--ac", "none", "--families", "mhar", "--kernel", "eager",
                           "--mask", "block_causal", "--rope-per-document", "--doc-len", "4", "--loss", "chunked",
                           "--loss-chunk", "8", "--out", str(out)])
    text = out.read_text()
    assert ("every family with attn_mask_type=block_causal (documents of 4 tokens on average, RoPE per document), "
            "loss_path=chunked (8-token chunks), compile none") in text
    rows = [line for line in text.splitlines() if line.startswith("| debug | none |")]
    assert [r.split("|")[3].strip() for r in rows] == ["baseline", "mhar"]
    tokens = throughput_bench.synthetic_tokens(2, 63, 256, 4, "cpu")
    assert 0.1 < (tokens == throughput_bench.EOS).float().mean() < 0.4  # documents of about 4 tokens


def test_throughput_rejects_unknown_scale():
    with pytest.raises(SystemExit):
        throughput_bench.main(["--scales", "7b"])


def test_bench_modules_import_no_circle():
    """bench/'s modules import one another in one direction only: the import graph of the files
    in bench/ (top-level and in-function imports alike) has no cycle, and each routing benchmark
    job has its own file under the `bench/routing.py` entry."""
    import ast

    names = {p.stem for p in BENCH.glob("*.py")}
    graph = {}
    for path in BENCH.glob("*.py"):
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                imported.add(node.module.split(".")[0])
        graph[path.stem] = imported & names - {path.stem}
    assert {"routing_bytes", "routing_host", "routing_gpu", "routing_harness"} <= graph["routing"]
    assert "routing" not in graph["byte_count"]

    def cycle_from(node, path):
        for nxt in sorted(graph[node]):
            if nxt in path:
                return path[path.index(nxt):] + [nxt]
            found = cycle_from(nxt, path + [nxt])
            if found:
                return found
        return None
    cycles = [c for c in (cycle_from(n, [n]) for n in sorted(graph)) if c]
    assert not cycles, f"circular imports in bench/: {cycles[0]}"


def test_step_host_bench_rows(tmp_path):
    """`bench/step_host.py` at 100m, baseline and per-call MHAR, AC none, one timed step: one row per
    family with its host time (a measurement, not asserted beyond its sign), the GPU time of each
    micro-batch as `performance.modelled_gpu_ms` gives it, and the verdict that follows from the two."""
    import step_host
    from mhar_titan.components import performance
    from mhar_titan.models.args import ModelArgs

    step_host.main(["--scales", "100m", "--families", "baseline,mhar", "--ac", "none", "--repeats", "1",
                    "--out", str(tmp_path / "step.md")])
    text = (tmp_path / "step.md").read_text()
    assert "launches stubbed" in text and "a model, not a measurement" in text and "load average" in text
    rows = [line.strip("|").split("|") for line in text.splitlines() if line.startswith("| 100m | none |")]
    assert [r[2].strip() for r in rows] == ["baseline", "mhar"]
    for r in rows:
        host = float(r[3])
        assert host > 0
        args = ModelArgs.from_flavor("100m", **step_host.FAMILIES[r[2].strip()])
        for i, mb in enumerate(performance.MICRO_BATCHES):
            gpu = performance.modelled_gpu_ms(args, mb, 2048, "none")["total_ms"]
            assert abs(float(r[6 + i]) - gpu) < 0.06
            bound = r[6 + len(performance.MICRO_BATCHES) + i].split()[0]
            assert bound == ("host-bound" if host > gpu else "GPU-bound")
