"""The GPU suite (bench/gpu_suite.sh) in a simulated GPU environment (issue 12, acceptance 5): run
on CPU through the Triton interpreter at toy sizes, from the checkout without the installed
package, with datasets / torchdata / tiktoken / wandb unimportable. Every section must finish
and write its table, and the plan (printed first) must fit the 4-minute window."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from helpers import ROOT


def test_gpu_suite_tiny_writes_every_table(tmp_path):
    out = tmp_path / "suite"
    env = dict(os.environ, PYTHON=sys.executable, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_suite.sh"), str(out), "--tiny"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.startswith("GPU suite plan")
    budget = int(re.search(r"at most (\d+) s in all", proc.stdout).group(1))
    assert budget < 240  # four minutes by construction

    summary = json.loads((out / "summary.json").read_text())
    names = [s["name"] for s in summary["sections"]]
    assert names == ["env", "bytes", "compile", "tests", "routing", "throughput"], names
    assert sum(s["budget_s"] for s in summary["sections"]) == budget
    for section in summary["sections"]:
        log = (out / section["log"]).read_text()
        assert section["status"] == "ok", (section, log[-2000:])
        table = (out / f"{section['name']}.md").read_text().splitlines()
        rows = [line for line in table if line.startswith("| ") and not line.startswith("|---")]
        assert len(rows) >= 3, (section["name"], table)  # a header and at least two data rows
    tests = (out / "tests.md").read_text()
    assert tests.count("| passed |") >= 3 and "failed" not in tests
    routing = (out / "routing.md").read_text()
    assert "| triton |" in routing and "| step g=2 | 1 | 8 | 64 | 5 | triton |" in routing
    throughput = (out / "throughput.md").read_text()
    assert "| mhar | 1 |" in throughput and "| mhar-grouped | 3 |" in throughput  # per call and grouped (auto)
    assert summary["versions"]["triton_interpret"] == "1" and summary["all_ok"]
