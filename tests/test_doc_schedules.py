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
        out = f"--job.dump_folder={env.get('OUT', 'outputs')}"  # and the job names, as the script passes them
        base = load_config("train_configs/debug_baseline.toml", [out, "--job.name=toy_base",
                                                                  f"--training.steps={env.get('BASE_STEPS', 200)}",
                                                                  *shlex.split(env.get("BASE_ARGS", ""))])
        arms = [(f"{command} [{arm}]", load_config(f"train_configs/toy_midtrain_{arm}.toml",
                                                  [out, f"--job.name=toy_{arm}", *shlex.split(env.get("ARM_ARGS", ""))]))
                for arm in ("plain", "delta_mhar")]
        return [(f"{command} [base]", base), *arms]
    if words[:4] == ["python", "-m", "mhar_titan.experiments", "run"]:
        from mhar_titan.experiments.__main__ import _settings
        from mhar_titan.experiments.sweep import load_sweep

        sets = [words[i + 1] for i, w in enumerate(words) if w == "--set"]
        dump = next((words[i + 1] for i, w in enumerate(words) if w == "--dump-folder"), None)
        only = words[words.index("--only") + 1:] if "--only" in words else None
        only = only[:next((i for i, w in enumerate(only) if w.startswith("-") or w == "&"), len(only))] if only else None
        sweep = load_sweep(ROOT / words[4], _settings(sets), dump)
        return [(f"{command} [{run.name}]", run.config) for run in sweep.runs if only is None or run.name in only]
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
    assert 'make train ARGS="--job.name=first_look --training.steps=20' in names and "experiments run" in names
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


def _differences(a: dict, b: dict, prefix: str = "") -> list[str]:
    """The keys (section.key) in which two ``JobConfig.to_dict()`` trees differ."""
    out = []
    for key in sorted(set(a) | set(b)):
        x, y = a.get(key), b.get(key)
        if isinstance(x, dict) and isinstance(y, dict):
            out += _differences(x, y, f"{prefix}{key}.")
        elif x != y:
            out.append(f"{prefix}{key}")
    return out


def test_no_documented_command_changes_what_a_later_one_trains(monkeypatch):
    """A short first look must not change what the next documented command does: two documented
    trainings of one run folder may differ in training.steps only (the later one resumes and
    continues the earlier one's schedule, as the README's resume section does), and the quickstart's
    folder, whose losses the README documents, is trained by the quickstart's config alone."""
    monkeypatch.chdir(ROOT)
    by_folder: dict[str, list] = {}
    for doc, what, cfg in _documented_trainings():
        by_folder.setdefault(f"{cfg.job.dump_folder.rstrip('/')}/{cfg.job.name}", []).append((doc, what, cfg))
    quickstart = load_config(MAKE_DEFAULT_CONFIG).to_dict()
    clashes = []
    for folder, trainings in by_folder.items():
        first_doc, first, cfg = trainings[0]
        for doc, what, other in trainings[1:]:
            differ = [k for k in _differences(cfg.to_dict(), other.to_dict()) if k != "training.steps"]
            if differ:
                clashes.append(f"{folder}: {first_doc}: {first!r} and {doc}: {what!r} differ in {differ}")
        for doc, what, other in trainings:
            if folder.endswith("/debug_mhar") and _differences(quickstart, other.to_dict()):
                clashes.append(f"{folder}, the quickstart's folder: {doc}: {what!r} trains another config there")
    assert not clashes, "\n".join(clashes)
