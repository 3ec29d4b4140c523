"""The mid-training experiment at toy size (scripts/toy_midtrain.sh, README "Mid-training"). The README
doc test runs the README's shrunk command and checks what it did with ``check_the_toy_experiment``;
here a rerun after an interruption continues from the first unfinished stage. Marked lm_eval (the
slow tier)."""
from __future__ import annotations

import json
import subprocess

import pytest

from helpers import ROOT, read_metrics

pytestmark = pytest.mark.lm_eval  # runs lm-eval (the slow tier)


def check_the_toy_experiment(stdout: str, out) -> None:
    """What the shrunk experiment (a 12-step base, 6 steps per arm with evaluation on 8 examples, the
    paired table over 24; the README's mid-training command, run by the README doc test in
    tests/test_readme_commands.py) leaves in ``out`` and prints: every stage ran as the README shows
    it: base training, Llama export, schedule check, both arms from the export on the two-source
    mixture with in-training evaluation, the paired table."""
    assert "schedule-matched: train_configs/toy_midtrain_plain.toml (planned) and " in stdout
    assert (out / "toy_base_llama" / "config.json").is_file()
    # a standard model with q/k norm (the debug flavor) exports in Qwen3's layout, else Llama's
    assert json.loads((out / "toy_base_llama" / "config.json").read_text())["model_type"] == "qwen3"

    plain, mhar = (read_metrics(out / f"toy_{arm}") for arm in ("plain", "delta_mhar"))
    # both arms start from the same base: delta-MHAR's zero gates give the base's logits at step 1
    assert [r["loss"] for r in plain if r["step"] == 1] == pytest.approx([r["loss"] for r in mhar if r["step"] == 1],
                                                                         rel=1e-5)
    for rows in (plain, mhar):
        last = [r for r in rows if "eval/sequences" in r]
        assert [r["step"] for r in last] == [6] and 0 <= last[0]["eval/shakespeare_next_line/acc"] <= 1
        assert any("tokens_seen/plays_b" in r for r in rows)  # the two-source mixture

    line = next(ln for ln in stdout.splitlines() if ln.startswith("| shakespeare_next_line | acc |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[3] == "24"  # n
    rows = json.loads((out / "toy_paired" / "paired.json").read_text())["rows"]
    acc = next(r for r in rows if r["metric"] == "acc")
    assert cells[8:11] == [str(acc["a_only"]), str(acc["b_only"]), f"{acc['p_value']:.4g}"]
    assert "toy_plain" in json.loads((out / "toy_paired" / "paired.json").read_text())["a"]


def test_a_rerun_after_an_interruption_continues_from_the_first_unfinished_stage(tmp_path, warm_python):
    """The first run dies right after the export finished, before the script marked it (the issue's
    case: the export folder exists); the rerun skips the base training, redoes the export into its
    existing folder and finishes. A third run has nothing left to do. The script's Python commands run
    forked from one warm interpreter (tests/warm_python.py: each a process of its own, the imports
    done once)."""
    rerun_after_an_interruption(tmp_path, warm_python.python, warm_python.env())


def rerun_after_an_interruption(tmp_path, real: str, env: dict) -> None:
    dying = tmp_path / "python_dying_after_export"
    dying.write_text(f'#!/usr/bin/env bash\n"{real}" "$@" || exit $?\n'
                     'case " $* " in *" mhar_titan.convert export "*) exit 9 ;; esac\n')
    dying.chmod(0o755)
    out = tmp_path / "out"
    env = {**env, "OUT": str(out), "BASE_STEPS": "4", "LIMIT": "4",
           "ARM_ARGS": "--training.steps=2 --eval.limit=2 --validation.sequences=2"}

    def run(python):
        return subprocess.run(["bash", "scripts/toy_midtrain.sh"], cwd=ROOT, env={**env, "PYTHON": python},
                              capture_output=True, text=True, timeout=1800)

    first = run(str(dying))
    assert first.returncode == 9, first.stderr[-3000:]
    assert (out / "toy_base_llama" / "config.json").is_file()  # the export finished ...
    assert sorted(p.name for p in (out / ".toy_midtrain").iterdir()) == ["1-base.done"]  # ... unmarked
    base_rows = read_metrics(out / "toy_base")

    second = run(real)
    assert second.returncode == 0, second.stderr[-3000:]
    stages = second.stdout.split("== ")[1:]
    assert stages[0].startswith("1. base model") and "finished in an earlier run: skipped" in stages[0]
    assert all("skipped" not in s for s in stages[1:])  # the export and everything after it ran
    assert read_metrics(out / "toy_base") == base_rows  # the base was not trained again
    assert sorted(p.name for p in (out / ".toy_midtrain").iterdir()) == [
        "1-base.done", "2-export.done", "3-schedule.done", "4-delta_mhar.done", "4-plain.done", "5-paired.done"]
    assert (out / "toy_paired" / "paired.json").is_file()

    third = run(real)
    assert third.returncode == 0 and third.stdout.count("finished in an earlier run: skipped") == 6, third.stdout
