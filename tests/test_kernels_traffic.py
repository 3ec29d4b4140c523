"""Bytes accounting of the routing kernels (issue 12, acceptance 1): `mhar_kernels.traffic`, fed
with the routing plan's per-site sources, equals what a debug-flavor training step really
launches (the tensors and depth-buffer rows every routing launch reads and writes, including the
gradient rows a backward launch adds into, and each source's copy into its slot), autograd adds
no source gradients, and the counted traffic stays within 1.5x of the floor."""
from __future__ import annotations

import pathlib
import re
import sys

import pytest
import torch

from mhar_kernels import traffic, triton_routing
from mhar_titan.models.args import ModelArgs
from mhar_titan.models.model import Transformer

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
import routing as routing_bench  # noqa: E402
import routing_bytes  # noqa: E402
from mhar_titan.components import performance  # noqa: E402

FP32 = traffic.FP32


def _nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _cast_bf16(*tensors) -> int:
    """Bytes of casting fp32 gradient sums to the bf16 parameters (read fp32, write bf16)."""
    return sum(t.numel() * (FP32 + 2) for t in tensors if t is not None)


def _bf16_training_step(args: ModelArgs, tokens: torch.Tensor) -> None:
    """Forward and backward of one bf16 step of a seeded model with non-uniform routing."""
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    model.to(torch.bfloat16)
    with torch.no_grad():
        model.routing.query.normal_(0.0, 0.3)
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    loss.backward()


def _measured_step(monkeypatch, args: ModelArgs, tokens: torch.Tensor) -> dict:
    """Bytes per launch kind, read from the tensors and depth-buffer rows each real routing launch
    gets and returns, the rows its backward writes or adds gradients into, and the sources written
    into their slots by a copy (`DepthBuffer.write`)."""
    from mhar_kernels import depth_buffer

    measured = {"forward": 0, "backward": 0, "reduce": 0, "launches": 0, "writes": 0, "rows": set(),
                "first": []}
    forward, backward = triton_routing.route_forward, triton_routing.route_backward
    write = depth_buffer.DepthBuffer.write

    def rows(values, slots):
        return [] if slots is None else [values[i] for i in slots.tolist()]

    def counting_forward(values, slots, query, norm_weight, heads, eps, *, partial=None, alpha=None,
                         mix_residual=None, **kw):
        out, mix, stats = forward(values, slots, query, norm_weight, heads, eps, partial=partial, alpha=alpha,
                                  mix_residual=mix_residual, **kw)
        measured["forward"] += _nbytes(*rows(values, slots), partial, query, norm_weight) \
            + _nbytes(out, mix, mix_residual, stats)
        measured["launches"] += 1
        return out, mix, stats

    def counting_backward(grad_out, values, slots, mix, query, norm_weight, heads, eps, stats, alpha=None, *,
                          grads=None, accumulate=None, mix_residual=None, **kw):
        sources = rows(values, slots)
        adds = [False] * len(sources) if accumulate is None else [bool(a) for a in accumulate.tolist()]
        dq, dg, dalpha, dnull = backward(grad_out, values, slots, mix, query, norm_weight, heads, eps, stats, alpha,
                                         grads=grads, accumulate=accumulate, mix_residual=mix_residual, **kw)
        # fp32 partial sums of dq, dg (and dnull), one program on CPU; dq, dg come back cast (param_dtype)
        partials = FP32 * sum(t.numel() for t in (dq, dg, dnull) if t is not None) + (FP32 if alpha is not None else 0)
        written = [grads[i] for i in slots.tolist()]  # every source's gradient row
        read_back = [row for row, add in zip(written, adds) if add]
        measured["backward"] += _nbytes(grad_out, mix, mix_residual, *sources, stats, query, norm_weight) \
            + _nbytes(*read_back) + _nbytes(*written) + partials
        measured["reduce"] += 2 * partials + _cast_bf16(dq, dg, dnull)  # the host sums the partials, casts
        measured["first"] += [i for i, add in zip(slots.tolist(), adds) if not add]  # rows written, not added to
        measured["rows"].update(slots.tolist())
        return dq, dg, dalpha, dnull

    def counting_write(buffer, slot, source, token):
        measured["writes"] += _nbytes(source) * 2  # the source read, its slot written
        return write(buffer, slot, source, token)

    monkeypatch.setattr(triton_routing, "route_forward", counting_forward)
    monkeypatch.setattr(triton_routing, "route_backward", counting_backward)
    monkeypatch.setattr(depth_buffer.DepthBuffer, "write", counting_write)
    _bf16_training_step(args, tokens)
    return measured


def test_counted_traffic_equals_real_launches_at_debug_flavor(monkeypatch):
    args = ModelArgs.from_flavor("debug", residual="attn_res", routing_heads=8, vocab_size=512,
                                 routing_kernel="triton")
    tokens = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(1))
    measured = _measured_step(monkeypatch, args, tokens)
    sites = performance.plan_sources(args)
    assert [len(ids) for ids in sites] == list(range(1, 2 * args.n_layers + 2))  # site s reads s sources
    counted = routing_bytes.step_traffic(args, tokens[:, :-1].numel(), torch.bfloat16, programs=1)
    kinds = counted.by_kind()

    assert measured["launches"] == len(sites)
    for kind in ("forward", "backward", "reduce"):
        assert measured[kind] == kinds[kind], (kind, measured[kind], kinds[kind])
    assert "accumulate" not in kinds
    # the embedding and every sublayer output copied into their slots; each gradient row written by
    # one reader (its last in the forward), added into by the others: nothing for autograd to add
    distinct = len({j for ids in sites for j in ids})
    assert performance.slot_copies(args) == (1 + 2 * args.n_layers, 0)
    assert measured["writes"] == kinds["write"] == 2 * (1 + 2 * args.n_layers) * counted.row_bytes
    assert len(measured["rows"]) == distinct and sorted(measured["first"]) == sorted(measured["rows"])
    # separate source tensors, their per-site gradients summed by autograd, would cost more
    unshared = routing_bytes.step_traffic(args, tokens[:, :-1].numel(), torch.bfloat16, programs=1, shared=False)
    reads = sum(map(len, sites))
    buffer = kinds["write"] + kinds.get("zero", 0)  # the copies into slots, the gradient buffer made
    assert unshared.total - counted.total == 2 * counted.row_bytes * (reads - distinct) - buffer > 0


def test_counted_traffic_at_1b_is_within_1_5x_of_the_floor():
    """Acceptance 1 with the accounting checked above: MHAR H = 8 at 1b (sublayer, replace, AC none,
    bf16, the paper's 2 x 1024 micro-batch) moves at most 1.5x the floor (1.98x with autograd
    summing per-site gradients). The debug flavor is not the target: its per-token logits and
    lse (H = 8 fp32 per source at d = 64) are a large share of a row there."""
    args = ModelArgs.from_flavor("1b", residual="attn_res", routing_heads=8)
    counted = routing_bytes.step_traffic(args, 2 * 1024, torch.bfloat16)
    assert 1.0 < counted.ratio <= 1.5, counted.ratio
    assert routing_bytes.step_traffic(args, 2 * 1024, torch.bfloat16, shared=False).ratio > 1.9


def test_traffic_floor_and_rows_by_hand():
    """Two sites over sources {0} and {0, 1}, 4 tokens, d = 8, bf16 (row = 64 bytes), H = 2, one program."""
    t = traffic.routing_traffic([[0], [0, 1]], dim=8, tokens=4, dtype=torch.bfloat16, heads=2, programs=1)
    row = 64
    assert t.floor == ((1 + 1) + (2 + 1) + (2 + 1) + (4 + 1)) * row
    fwd = [launch for launch in t.launches if launch.kind == "forward"]
    assert [f.read for f in fwd] == [1 * row + 32, 2 * row + 32]  # sources + q, g (2 x 8 bf16)
    # out + the mix residual (bf16) + logits + lse
    assert [f.written for f in fwd] == [2 * row + 4 * 2 * 4 * 2, 2 * row + 4 * 2 * 4 * 3]
    bwd = [launch for launch in t.launches if launch.kind == "backward"]
    stats = [4 * 2 * 4 * 2, 4 * 2 * 4 * 3]
    # grad_out, mix, residual and the sources; site 1 runs backward first and writes both
    # buffers; site 0 reads source 0's back and adds
    assert [b.read for b in bwd] == [(1 + 3 + 1) * row + stats[0] + 32, (2 + 3) * row + stats[1] + 32]
    assert traffic.accumulated_reads([[0], [0, 1]]) == [1, 0]
    assert traffic.accumulated_reads([[0, 1], [1, 2], [0, 2]]) == [2, 1, 0]
    # each of the two sources copied into its depth-buffer slot once (a row read, a row written)
    assert [(w.read, w.written) for w in t.launches if w.kind == "write"] == [(2 * row, 2 * row)]
    again = traffic.routing_traffic([[0], [0, 1]], dim=8, tokens=4, dtype=torch.bfloat16, heads=2, programs=1,
                                    recomputed_writes=1)
    assert again.total == t.total + 2 * row  # a write recomputed under activation checkpointing
    unshared = traffic.routing_traffic([[0], [0, 1]], dim=8, tokens=4, dtype=torch.bfloat16, heads=2, programs=1,
                                       shared=False)
    accumulate = next(launch for launch in unshared.launches if launch.kind == "accumulate")
    assert (accumulate.read, accumulate.written) == (2 * row, row)  # one source read twice: one addition
    # the read-back replaced by a three-row addition, and no depth buffer (no slot writes, no gradient
    # buffer to make)
    buffer = sum(launch.bytes for launch in t.launches if launch.kind in ("write", "zero"))
    assert buffer >= 4 * row and unshared.total == t.total - row + 3 * row - buffer
    with pytest.raises(ValueError, match="at least one"):
        traffic.routing_traffic([[0], []], dim=8, tokens=4, dtype=torch.bfloat16, heads=2)


def test_host_row_is_its_own_mode(tmp_path):
    """`bench/routing.py --host`: the host time of one call with launches stubbed (a benchmark row,
    its value is not asserted), with the machine's load stated."""
    routing_bench.main(["--host", "--iters", "2", "--out", str(tmp_path / "host.md")])
    text = (tmp_path / "host.md").read_text()
    assert text.startswith("Host time (host CPU time") and "routing call (N = 73" in text and "2 calls" in text
    assert "load average" in text and "Grouped" not in text
    # the whole-step rows: the harness, the harness without routing, and their difference
    assert text.count("of which the harness without routing") == 2 and "mhar-grouped (g = 11" in text


def test_host_row_as_json(tmp_path):
    """`bench/routing.py --host --json`: family -> the routing's host time per 1b step (minimum
    and median), one call's minimum in microseconds and the load, as one object (values are
    measurements, not asserted beyond their kind)."""
    import json

    routing_bench.main(["--host", "--json", "--iters", "2", "--out", str(tmp_path / "host.json")])
    result = json.loads((tmp_path / "host.json").read_text())
    assert sorted(result) == ["mhar", "mhar-grouped"]
    for row in result.values():
        assert sorted(row) == ["call_us_min", "load", "step_ms_median", "step_ms_min"]
        assert row["call_us_min"] > 0 and row["load"] >= 0


def test_bytes_table_reports_every_scale(tmp_path):
    """`bench/routing.py --bytes`: the table for 100m / 350m / 1b (AC off and on), with no timing in
    it (the host time is `--host`'s row, see test_host_row_is_its_own_mode)."""
    routing_bench.main(["--bytes", "--out", str(tmp_path / "bytes.md")])
    text = (tmp_path / "bytes.md").read_text()
    assert "Host time" not in text
    per_call, grouped = text.split("Grouped routing at the group size")
    rows = [line for line in per_call.splitlines() if line.startswith("| 1") or line.startswith("| 3")]
    assert [r.split("|")[1].strip() for r in rows] == ["100m", "100m", "350m", "350m", "1b", "1b"]
    assert all(float(r.split("|")[-2].strip().rstrip("x")) > 1 for r in rows)
    # grouped at the auto g beside per call: forward source rows per token (issue 13, acceptance 2)
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in grouped.splitlines()
            if line.startswith("| 1") or line.startswith("| 3")]
    assert [r[:3] + r[4:6] for r in rows] == [[s, ac, g, call, grp] for s, g, call, grp in
                                              (("100m", "5", "325", "105"), ("350m", "7", "1,225", "301"),
                                               ("1b", "11", "2,701", "589")) for ac in ("none", "full")]
    assert all(float(r[6]) > float(r[7]) and float(r[-1]) < 1 for r in rows)  # grouped moves fewer bytes


def test_grouped_traffic_by_hand():
    """One group of 2 sites over start sources {0, 1, 2} (the second site merging source 3), then
    a per-call site over {0, 1, 2, 4}; 4 tokens, d = 8, bf16 (row = 64 bytes), H = 2, one program,
    two backward site chunks of one site. (The whole model is checked against a complete count
    of a training step in tests/test_byte_count.py.)"""
    row, stats, stat = 64, 4 * 2 * 2 * 4, 4 * 2 * 4  # rows; (g, B*T, H) and (B*T, H) fp32
    t = traffic.grouped_traffic([([0, 1, 2], [[], [3]]), ([0, 1, 2, 4], [[]])], dim=8, tokens=4,
                                dtype=torch.bfloat16, heads=2, programs=1, backward_site_block=1)
    assert t.floor == ((3 + 1 + 2) + (6 + 1 + 3) + (4 + 1) + (8 + 1)) * row
    p1 = {launch.kind: launch for launch in t.launches if launch.phase == "phase1"}
    # forward: 3 rows, 2 query and 2 key-norm rows (bf16); 2 mixes (bf16 rows), lse (site-major: each
    # site's state takes a view of it, no copy), the normalisers of ones
    assert (p1["forward"].read, p1["forward"].written) == (3 * row + 2 * 2 * 16, 2 * row + 2 * stats)
    # backward: 3 sources, 2 mix gradients, every gradient row read back (two chunks), the (1, 2, 8)
    # partials added into, dnorm, lse and the stack's read of the normaliser gradients
    t_sums = 2 * 8 * 4
    assert p1["backward"].read == (3 + 2) * row + 3 * row + 2 * 2 * 16 + 3 * stats + t_sums
    assert p1["backward"].written == 3 * row + t_sums + stats + t_sums  # rows, partials, stack, zeroed partials
    merges = [launch for launch in t.launches if launch.phase == "merge"]
    assert [(m.site, m.kind) for m in merges] == [(0, "backward"), (0, "reduce"), (1, "forward"), (1, "backward"),
                                                  (1, "reduce")]  # the first site returns its state: no forward
    forward = merges[2]
    assert (forward.read, forward.written) == (2 * row + stat + 2 * 16, 2 * row + 2 * stat)  # out, its residual
    # site 1's backward: grad_out, mix, residual, source 3; its logits, lse, the state's lse; q, g
    assert merges[3].read == 4 * row + 3 * stat + 2 * 16
    assert merges[3].written == 2 * row + stat + 2 * 8 * 4  # source 3's gradient, the state's, dnorm, partials
    # site 0 copies grad_out into its row of the group's mix gradients, writes dnorm and the partials
    assert (merges[0].read, merges[0].written) == (3 * row + stat + 2 * 16, row + stat + 2 * 8 * 4)
    # the five sources copied into their slots once
    assert [(w.read, w.written) for w in t.launches if w.kind == "write"] == [(5 * row, 5 * row)]
    assert not any(launch.kind == "accumulate" for launch in t.launches)  # every reader shares the gradient rows
    with pytest.raises(ValueError, match="at least two sites"):
        traffic.phase1_launches(0, 3, 1, dim=8, tokens=4, dtype=torch.bfloat16, heads=2)


def _grouped_rows(text: str) -> list[list[str]]:
    """The grouped bytes table's rows in `text`, without the two per-call byte columns."""
    rows = []
    for line in text.splitlines():
        if re.match(r"\| (100m|350m|1b) \| (none|full) \| \d+ \| \d+ \|", line):
            cells = [c.strip() for c in line.split("|")[1:-1]]
            rows.append([c for i, c in enumerate(cells) if i not in (6, 8, 10)])  # per call, and the ratio to it
    return rows


def test_design_doc_shows_the_grouped_bytes_table():
    """docs/DESIGN.md "Grouped routing" shows what `bench/routing.py --bytes` prints for grouped
    routing (the columns that do not depend on the per-call launches' accounting)."""
    printed = _grouped_rows(routing_bytes.grouped_bytes_table())
    assert len(printed) == 6
    assert _grouped_rows((pathlib.Path(__file__).resolve().parents[1] / "docs" / "DESIGN.md").read_text()) == printed
