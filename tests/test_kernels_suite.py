"""The GPU suite (bench/gpu_suite.sh): its plan (issue 21, acceptance 6) and a run in a simulated GPU
environment (issue 12, acceptance 5): on CPU through the Triton interpreter at toy sizes, from the
checkout without the installed package, with datasets / torchdata / tiktoken / wandb unimportable.
Every row must finish and write its table."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from helpers import PATIENCE_S, ROOT

SUITE = ROOT / "bench" / "gpu_suite.sh"
SCALES = ("1b", "100m")  # the order of value: the largest scale first (350m does not fit the window)


def plan(*flags: str) -> tuple[int, list[dict]]:
    """The suite's printed plan: (total budget in seconds, rows as dicts of the printed columns)."""
    proc = subprocess.run(["bash", str(SUITE), "--plan", *flags], capture_output=True, text=True, timeout=PATIENCE_S)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    total = int(re.search(r"at most (\d+) s in all", lines[0]).group(1))
    header = lines[1].split()
    rows = [dict(zip(header, line.split()[:-1]), budget=int(line.split()[-2])) for line in lines[2:]]
    return total, rows


def test_gpu_suite_plan_puts_the_valuable_rows_first_and_fits_six_minutes():
    total, rows = plan()
    assert total == sum(r["budget"] for r in rows) <= 360  # 6 minutes: a rerun fits a 15-minute window
    assert 2 * total + 180 <= 15 * 60  # two runs and a few minutes of machine start
    assert [r["row"] for r in rows] == [str(i) for i in range(1, len(rows) + 1)]
    index = {id(r): i for i, r in enumerate(rows)}
    # the isolated do_bench timing of 1b routing, per call and grouped, before every other measurement
    assert [r["section"] for r in rows[:2]] == ["env", "isolated"]
    assert rows[1]["scale"] == "1b" and rows[1]["family"] == "mhar,mhar-grouped"
    # then the real trainer: 100m MHAR (kill and resume) and the baseline, and 1b per call and grouped
    # with and without CUDA graphs
    assert [(r["section"], r["scale"], r["family"]) for r in rows[2:4]] == [
        ("trainer", "100m", "mhar,baseline"), ("graphs", "1b", "mhar,mhar-grouped")]
    # throughput: 1b before 100m, AC none and full side by side at each scale
    throughput = [(r["scale"], r["AC"]) for r in rows if r["section"] == "throughput"]
    assert throughput == [(s, ac) for s in SCALES for ac in ("none", "full")]
    assert all(r["family"] == "baseline,mhar,mhar-grouped" for r in rows if r["section"] == "throughput")
    # routing: Triton rows (1b first) before eager rows before the one torch.compile row, which ends the plan
    routing = [(r["impl"], r["scale"]) for r in rows if r["section"] == "routing"]
    assert routing == [("triton", s) for s in SCALES] + [("eager", s) for s in SCALES] + [("compile", "1b")]
    assert rows[-1]["impl"] == "compile" and sum(r["impl"] == "compile" for r in rows) == 1
    # one timed step of every depth connection at 350m (the eager mixing of DenseFormer, MUDDFormer,
    # Hyper-Connections and mHC, then MHAR and AttnRes fused),
    # after 1b's rows and before 100m's
    (connections,) = [(index[id(r)], r) for r in rows if r["section"] == "connections"]
    assert (connections[1]["scale"], connections[1]["family"], connections[1]["impl"], connections[1]["AC"]) == (
        "350m", "baseline,dense,mudd,hyper,mhc,mhar,attnres", "triton", "none")
    assert max(index[id(r)] for r in rows if r["scale"] == "1b" and r["impl"] == "triton") < connections[0] < min(
        index[id(r)] for r in rows if r["scale"] == "100m" and r["section"] in ("throughput", "routing"))
    # each scale's throughput rows come before the next scale's Triton routing row: a cut-off window
    # keeps whole scales
    for big, small in zip(SCALES, SCALES[1:]):
        last_big = max(index[id(r)] for r in rows if r["scale"] == big and r["impl"] == "triton")
        first_small = min(index[id(r)] for r in rows if r["scale"] == small and r["impl"] == "triton")
        assert last_big < first_small, (big, small)


@pytest.mark.distributed  # the suite's trainer rows run train.py under torchrun (and SIGKILL it)
def test_gpu_suite_tiny_writes_every_table(tmp_path):
    out = tmp_path / "suite"
    # the budgets are the GPU window's plan, not a verdict: scaled up so that load cannot fail a row
    env = dict(os.environ, PYTHON=sys.executable, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="",
               MHAR_SUITE_BUDGET_SCALE="20")
    total, planned = plan("--tiny")
    proc = subprocess.run(["bash", str(SUITE), str(out), "--tiny"], cwd=tmp_path,
                          env=env, capture_output=True, text=True,
                          timeout=max(20 * total + 300, PATIENCE_S))  # a hang guard only
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.startswith("GPU suite plan")

    summary = json.loads((out / "summary.json").read_text())
    assert [(r["section"], r["scale"], r["impl"], r["ac"]) for r in summary["rows"]] == \
        [(r["section"], r["scale"], r["impl"], r["AC"]) for r in planned]
    assert sum(r["budget_s"] for r in summary["rows"]) == total
    for row in summary["rows"]:
        log = (out / row["log"]).read_text()
        assert row["status"] == "ok", (row, log[-2000:])
        table = (out / row["table"]).read_text().splitlines()
        lines = [line for line in table if line.startswith("| ") and not line.startswith("|---")]
        assert row["section"] == "host" or len(lines) >= 3, (row["name"], table)  # a header and two data rows
    tables = {r["section"] + "/" + r["impl"]: (out / r["table"]).read_text() for r in summary["rows"]}
    assert tables["tests/triton"].count("| passed |") >= 3 and "failed" not in tables["tests/triton"]
    assert "| step g=2 | 1 | 8 | 64 | 5 | triton |" in tables["routing/triton"]
    assert "| toy | mhar | 1 |" in tables["isolated/triton"] and "| toy | mhar-grouped | 2 |" in tables["isolated/triton"]
    throughput = [t for key, t in tables.items() if key.startswith("throughput")]
    assert all("| mhar | 1 |" in t and "| mhar-grouped | 3 |" in t for t in throughput)  # per call and grouped (auto)
    connections = tables["connections/triton"]  # every depth connection's timed step (no routing group but MHAR's)
    assert all(f"| debug | none | {f} | - |" in connections for f in ("baseline", "dense", "mudd", "hyper", "mhc"))
    assert "| debug | none | mhar | 1 |" in connections and "| debug | none | attnres | 1 |" in connections
    assert "load average" in tables["host/stubbed"]
    # the trainer rows: a SIGKILL after a checkpoint and a bitwise resume; graphs report the eager half on CPU
    assert "resumed from 3: losses bitwise equal at all 8 steps" in tables["trainer/torchrun"]
    for family in ("mhar", "mhar-grouped"):
        assert f"| {family} | off | 5 (2 logged) |" in tables["graphs/torchrun"], tables["graphs/torchrun"]
        assert f"| {family} | on | not run (needs CUDA) |" in tables["graphs/torchrun"], tables["graphs/torchrun"]
    assert summary["versions"]["triton_interpret"] == "1" and summary["all_ok"]
