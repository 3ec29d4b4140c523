"""The training commands the README and the guides show run without a learning-rate schedule warning
(``optim.lr_schedule.schedule_warnings``: a warm-up as long as the run, a decay shorter than the warm-up):
a short first look shrinks the warm-up with the steps. Read from the documents (fenced bash blocks and
inline ``make train ARGS="..."``), each command's config is loaded as the command would load it; nothing
trains."""
from __future__ import annotations

import re
import shlex

import pytest
from helpers import ROOT
from test_readme_commands import commands, readme_blocks, words_of

from mhar_titan.config import load_config
from mhar_titan.optim.lr_schedule import schedule_warnings

DOCS = ["README.md", "RESULTS.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
MAKE_DEFAULT_CONFIG = "train_configs/debug_mhar.toml"  # the Makefile's CONFIG


def _substituted(block_text: str, command: str) -> str:
    """``command`` with the block's own ``VAR="..."`` assignments substituted (``$TOUR``, ``${SMOKE}``)."""
    for name, value in re.findall(r'^([A-Z_][A-Z0-9_]*)="([^"]*)"', re.sub(r"\\\n\s*", " ", block_text), re.M):
        command = re.sub(rf"\$\{{?{name}\}}?(?![A-Za-z0-9_])", value, command)
    return command


def _overrides(words: list[str]) -> list[str]:
    """The ``--section.key=value`` / ``--section.key value`` words (``--config`` included)."""
    out, i = [], 0
    while i < len(words):
        word = words[i]
        if word.startswith("--") and ("." in word.split("=")[0] or word.split("=")[0] == "--config"):
            if "=" in word or i + 1 >= len(words):
                out.append(word)
            else:
                out += [word, words[i + 1]]
                i += 1
        i += 1
    return out


def _jobs(command: str) -> list[tuple[str, object]]:
    """(what, JobConfig) of each training a documented command starts; [] for a command that trains nothing."""
    words = words_of(command)
    if any(w in ("-h", "--help") for w in words) or "$" in command:
        return []
    if "train.py" in words and words[0] in ("python", "torchrun"):
        return [(command, load_config(None, _overrides(words[words.index("train.py") + 1:])))]
    if words[:2] == ["make", "train"]:
        assigned = dict(w.split("=", 1) for w in words[2:] if "=" in w)  # make's VAR=value arguments
        args = shlex.split(assigned.get("ARGS", ""))
        return [(command, load_config(assigned.get("CONFIG", MAKE_DEFAULT_CONFIG), args))]
    if words[:2] == ["bash", "scripts/toy_midtrain.sh"]:  # its base model and its two arms, as the script runs them
        assigned = shlex.split(command, comments=True)
        env = dict(a.split("=", 1) for a in assigned[:assigned.index("bash")])
        base = load_config("train_configs/debug_baseline.toml", [f"--training.steps={env.get('BASE_STEPS', 200)}",
                                                                  *shlex.split(env.get("BASE_ARGS", ""))])
        arms = [(f"{command} [{arm}]", load_config(f"train_configs/toy_midtrain_{arm}.toml",
                                                  shlex.split(env.get("ARM_ARGS", ""))))
                for arm in ("plain", "delta_mhar")]
        return [(f"{command} [base]", base), *arms]
    if words[:4] == ["python", "-m", "mhar_titan.experiments", "run"]:
        from mhar_titan.experiments.__main__ import _settings
        from mhar_titan.experiments.sweep import load_sweep

        sets = [words[i + 1] for i, w in enumerate(words) if w == "--set"]
        sweep = load_sweep(ROOT / words[4], _settings(sets))
        return [(f"{command} [{run.name}]", run.config) for run in sweep.runs]
    return []


def _documented_trainings() -> list[tuple[str, str, object]]:
    found = []
    for doc in DOCS:
        text = (ROOT / doc).read_text()
        for block in readme_blocks(text):
            if block.info != "bash":
                continue
            for command in commands(block):
                found += [(doc, what, cfg) for what, cfg in _jobs(_substituted(block.text, command))]
        for span in re.findall(r'`(make train [^`]*ARGS="[^"`]*"[^`]*)`', text):
            found += [(doc, what, cfg) for what, cfg in _jobs(span)]
    return found


def test_every_documented_training_runs_without_a_schedule_warning(monkeypatch):
    monkeypatch.chdir(ROOT)
    trainings = _documented_trainings()
    # the walk found the README's tour, its first look and a sweep (a broken walk would check nothing)
    names = " ".join(what for _, what, _ in trainings)
    assert "tour_baseline" in names and "tour_muon" in names and "debug_mixture" in names
    assert 'make train ARGS="--training.steps=20' in names and "experiments run" in names
    assert "BASE_STEPS=12" in names and "toy_midtrain.sh [delta_mhar]" in names
    warned = [f"{doc}: {what}: {w}" for doc, what, cfg in trainings
              for w in schedule_warnings(cfg.lr_scheduler, cfg.training.steps)]
    assert not warned, "\n".join(warned)


@pytest.mark.parametrize("steps, warmup, warns", [(30, 20, True), (30, 10, False), (40, 20, False), (8, 20, True)])
def test_the_check_sees_the_warning_the_tour_printed(steps, warmup, warns):
    """The warning the README's 30-step tour printed with the config's 20 warm-up steps, and not with 10."""
    cfg = load_config(str(ROOT / "train_configs/debug_baseline.toml"),
                      [f"--training.steps={steps}", f"--lr_scheduler.warmup_steps={warmup}"])
    assert bool(schedule_warnings(cfg.lr_scheduler, cfg.training.steps)) is warns
