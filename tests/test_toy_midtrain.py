"""The mid-training experiment end to end at toy size (scripts/toy_midtrain.sh, README "The mid-training
experiment on CPU"), shrunk: a 12-step base, 6 steps per arm, 24 examples. Every stage runs as the
README shows it: base training, Llama export, schedule check, both arms from the export on the
two-source mixture with in-training evaluation, the paired table. Marked slow and lm_eval."""
from __future__ import annotations

import json
import os
import subprocess

import pytest

pytestmark = [pytest.mark.lm_eval, pytest.mark.slow]  # about 60 s of CPU; several minutes on busy cores
pytest.importorskip("lm_eval")

from helpers import ROOT, read_metrics  # noqa: E402


def test_the_toy_midtraining_experiment_runs_end_to_end(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "BASE_STEPS": "12", "LIMIT": "24",
           "ARM_ARGS": "--training.steps=6 --eval.limit=8 --validation.sequences=8"}
    proc = subprocess.run(["bash", "scripts/toy_midtrain.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "schedule-matched: train_configs/toy_midtrain_plain.toml (planned) and " in out
    assert (tmp_path / "toy_base_llama" / "config.json").is_file()
    # a standard model with q/k norm (the debug flavor) exports in Qwen3's layout, else Llama's
    assert json.loads((tmp_path / "toy_base_llama" / "config.json").read_text())["model_type"] == "qwen3"

    plain, mhar = (read_metrics(tmp_path / f"toy_{arm}") for arm in ("plain", "delta_mhar"))
    # both arms start from the same base: delta-MHAR's zero gates give the base's logits at step 1
    assert [r["loss"] for r in plain if r["step"] == 1] == pytest.approx([r["loss"] for r in mhar if r["step"] == 1],
                                                                         rel=1e-5)
    for rows in (plain, mhar):
        last = [r for r in rows if "eval/sequences" in r]
        assert [r["step"] for r in last] == [6] and 0 <= last[0]["eval/shakespeare_next_line/acc"] <= 1
        assert any("tokens_seen/plays_b" in r for r in rows)  # the two-source mixture

    line = next(ln for ln in out.splitlines() if ln.startswith("| shakespeare_next_line | acc |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[3] == "24"  # n
    rows = json.loads((tmp_path / "toy_paired" / "paired.json").read_text())["rows"]
    acc = next(r for r in rows if r["metric"] == "acc")
    assert cells[8:11] == [str(acc["a_only"]), str(acc["b_only"]), f"{acc['p_value']:.4g}"]
    assert "toy_plain" in json.loads((tmp_path / "toy_paired" / "paired.json").read_text())["a"]
