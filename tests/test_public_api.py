"""The package's public API: `import mhar_titan` is light and resolves its names lazily (the
README's notebook-sized script that uses it runs, without a warning, in the README doc test,
tests/test_readme_commands.py). The analysis guide analyses only runs it trains, and its training
and analysis lines run as written (shrunk to a few steps, in a temporary folder)."""
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

from helpers import PATIENCE_S, ROOT
from train_common import SAMPLE

import mhar_titan


def test_the_package_exports_lazily_and_imports_nothing_heavy():
    code = ("import sys, mhar_titan; print(sorted(m for m in ('torch', 'mhar_titan.models', 'mhar_titan.train', "
            "'mhar_titan.config') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert out.strip() == "[]"
    from mhar_titan.eval.generation import generate_batch
    from mhar_titan.models import FAMILIES, Transformer
    from mhar_titan.train import run_training

    assert mhar_titan.Transformer is Transformer and mhar_titan.FAMILIES is FAMILIES
    assert mhar_titan.run_training is run_training and mhar_titan.generate_batch is generate_batch
    assert set(mhar_titan.__all__) >= {"Transformer", "ModelArgs", "FLAVORS", "FAMILIES", "load_config",
                                       "JobConfig", "run_training", "Trainer", "load_run", "generate_batch"}
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        mhar_titan.nope  # noqa: B018


def readme_bash_block(heading: str, doc: str = "docs/ANALYSIS.md") -> list[list[str]]:
    """The command lines (shlex words, comments dropped) of the first bash block after ``heading`` in
    ``doc`` (the analysis guide; the README's own blocks run in tests/test_readme_commands.py)."""
    readme = (ROOT / doc).read_text()
    section = readme[readme.index(heading):]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [words for words in (shlex.split(line, comments=True) for line in block.splitlines()) if words]


def run_folder_of(words: list[str]) -> str:
    """``outputs/<job.name>`` that ``python train.py --config X [overrides]`` trains into."""
    from mhar_titan.config import load_config

    cfg = load_config(None, words[2:])
    return str(pathlib.PurePosixPath(cfg.job.dump_folder) / cfg.job.name)


def test_the_readme_analyses_only_runs_it_trains():
    lines = readme_bash_block("# Analysis and generation")
    make_train = ["python", "train.py", "--config", "train_configs/debug_mhar.toml"]  # the quickstart's make train
    makefile = (ROOT / "Makefile").read_text()
    assert f"CONFIG ?= {make_train[3]}" in makefile and "$(PY) train.py --config $(CONFIG)" in makefile
    trained = {run_folder_of(make_train)}
    for words in lines:
        if words[:2] == ["python", "train.py"]:
            trained.add(run_folder_of(words))
    assert trained == {"outputs/debug_mhar", "outputs/debug_attnres", "outputs/debug_baseline"}, trained
    for words in lines:
        if words[:2] != ["python", "train.py"]:
            for word in words:
                run = re.match(r"(outputs/[^/]+)", word)
                assert run is None or run.group(1) in trained, (run.group(1), shlex.join(words))


# the README's runs, shrunk: a few steps of short sequences, validated at every step
SHRINK = ["--training.steps=2", "--training.seq_len=32", "--training.local_batch_size=2",
          "--validation.freq=1", "--validation.sequences=2", "--metrics.log_freq=1",
          "--lr_scheduler.warmup_steps=1", "--checkpoint.interval=2"]


@pytest.mark.slow  # three 2-step trainings, a heatmap, a probe, a comparison: 3.5 min at load 14 on 2 cores
@pytest.mark.skipif(not (SAMPLE / "validation-00000-of-00001.parquet").exists(),
                    reason="run `python -m mhar_titan.data.prepare_shakespeare --out data/shakespeare`")
def test_the_readme_training_and_analysis_lines_run_as_written(tmp_path, warm_python):
    lines = readme_bash_block("# Analysis and generation")
    trainings = [["python", "train.py", "--config", "train_configs/debug_mhar.toml"]]  # make train
    trainings += [w for w in lines if w[:2] == ["python", "train.py"]]
    analyses = [w for w in lines if w[:3] == ["python", "-m", "mhar_titan.analysis"]]
    assert len(trainings) == 3 and [w[3] for w in analyses] == ["heatmap", "probe", "compare"]
    for words in trainings:  # each command a process of its own, forked from the warm interpreter
        done = warm_python.run([*words[1:], f"--job.dump_folder={tmp_path / 'outputs'}", *SHRINK], timeout=PATIENCE_S)
        assert done.returncode == 0, (shlex.join(words), done.stderr[-3000:])
    for words in analyses:  # outputs/... read the runs just trained
        words = [re.sub(r"^outputs/", f"{tmp_path / 'outputs'}/", w) for w in words]
        done = warm_python.run(words[1:], timeout=PATIENCE_S)
        assert done.returncode == 0, (shlex.join(words), done.stderr[-3000:])
        assert "warning" not in done.stderr.lower(), (shlex.join(words), done.stderr[-3000:])
    assert list((tmp_path / "outputs" / "debug_mhar" / "analysis").glob("*.png"))
