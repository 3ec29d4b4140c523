"""The project as a user's cluster image installs it: a wheel, not the editable install of `make setup`.

The wheel is built offline (``pip wheel --no-deps --no-build-isolation``) from a copy of the files git
tracks or would track (the checkout's tracked and untracked-but-not-ignored files, as they are now),
so it is what a fresh clone builds. It must hold every such file under ``mhar_titan/`` and
``kernels/mhar_kernels/`` (the latter as ``mhar_kernels/``) and nothing else: a subpackage left out
of discovery, a new one it would not find, or a data file nobody declared fails here, by name.

The wheel is then installed into a fresh virtual environment whose dependencies are the project
venv's: a ``.pth`` file lists the folders this interpreter imports installed packages from (its
site-packages and what their ``.pth`` files add), without this checkout. Folders named in a
``.pth`` file are plain path entries: the ``.pth`` files inside them (the editable install's finder)
are not run, so the project itself comes only from the wheel. From an empty folder outside the
checkout, with no tokenizer cache variable set, the installed copy prints the trainer's help,
prepares the tokenizer cache in the user's cache folder, trains 2 steps of debug_mhar on the
checkout's Shakespeare sample into ``./outputs``, exports the run as a Hugging Face folder and
transformers' Auto classes load it with the logits of our model; nothing is written under the
fresh venv's site-packages.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from helpers import PATIENCE_S, ROOT, read_metrics

pytestmark = pytest.mark.slow

PACKAGES = {"mhar_titan": "mhar_titan", "kernels/mhar_kernels": "mhar_kernels"}
"""Folder in the repository -> the import name (and folder) it has in the wheel."""
SAMPLE = ROOT / "data" / "shakespeare"
DEBUG_MHAR = ROOT / "train_configs" / "debug_mhar.toml"


def repository_files() -> list[str]:
    """The files git tracks or would track (tracked, and untracked but not ignored), relative to ROOT."""
    if not (ROOT / ".git").exists():
        pytest.skip(f"{ROOT} is not a git checkout: the wheel test builds from the files git tracks")
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    return sorted(name for name in set(listed) if name and (ROOT / name).is_file())


def expected_in_wheel(files: list[str]) -> set[str]:
    """Where each repository file under a package folder lands in the wheel."""
    out = set()
    for name in files:
        for folder, package in PACKAGES.items():
            if name.startswith(folder + "/"):
                out.add(package + name[len(folder):])
    return out


def build_wheel(tmp: Path) -> Path:
    """``pip wheel`` of a copy of the repository's files (the checkout itself gets no build/ folder)."""
    source = tmp / "source"
    for name in repository_files():
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, source / name)
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                           "--no-index", "-w", str(tmp / "dist"), str(source)],
                          capture_output=True, text=True, timeout=PATIENCE_S)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    wheels = list((tmp / "dist").glob("mhar_titan-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    return build_wheel(tmp_path_factory.mktemp("wheel"))


def test_the_wheel_holds_every_file_of_both_packages_and_nothing_else(wheel):
    files = repository_files()
    expected = expected_in_wheel(files)
    assert {"mhar_titan/optim/__init__.py", "mhar_titan/train.py", "mhar_kernels/__init__.py"} <= expected
    assert len(expected) >= 100  # the listing saw the whole checkout, not a handful of files
    with zipfile.ZipFile(wheel) as z:
        names = {n for n in z.namelist() if not n.endswith("/")}
    shipped = {n for n in names if not n.split("/")[0].endswith(".dist-info")}
    missing = sorted(expected - shipped)
    assert not missing, (f"the wheel lacks {len(missing)} file(s) of the packages: {missing[:20]}; a folder "
                         "needs an __init__.py to be a package (pyproject.toml's packages.find), and a file that "
                         "is not .py must be listed under [tool.setuptools.package-data]")
    # nothing else either: no `kernels` package (that name is Hugging Face's), no tests, no stray files
    extra = sorted(shipped - expected)
    assert not extra, f"the wheel holds files the repository's packages do not: {extra[:20]}"


# ---------------------------------------------------------------------------------------------
# installed in a fresh venv, run from outside the checkout


def _sys_path(python: str, cwd: Path) -> list[str]:
    done = subprocess.run([python, "-c", "import json, sys; print(json.dumps(sys.path))"], cwd=cwd,
                          env={k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")},
                          capture_output=True, text=True, timeout=PATIENCE_S, check=True)
    return json.loads(done.stdout)


def dependency_folders(venv_python: str, cwd: Path) -> list[str]:
    """The folders this interpreter imports installed packages from and the fresh venv does not (the
    project venv's site-packages and the folders its .pth files add), without folders in this
    checkout other than the project venv (an editable install's path entries)."""
    own = set(_sys_path(venv_python, cwd))
    prefix = Path(sys.prefix).resolve()
    out = []
    for entry in _sys_path(sys.executable, cwd):
        path = Path(entry).resolve() if entry else None
        if path is None or entry in own or not path.is_dir():
            continue
        if path.is_relative_to(ROOT) and not path.is_relative_to(prefix):
            continue
        out.append(str(path))
    return out


def install_in_fresh_venv(wheel: Path, tmp: Path) -> tuple[Path, Path]:
    """(the venv's python, its site-packages): the wheel installed (pip compiles it, as a user's
    install does), then a .pth file that lends it the project venv's dependencies."""
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=PATIENCE_S)
    python = venv / "bin" / "python"
    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                           "--no-index", str(wheel)], capture_output=True, text=True, timeout=PATIENCE_S)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    deps = dependency_folders(str(python), tmp)
    assert deps, "found no folder of installed packages for this interpreter"
    (site / "project_venv_dependencies.pth").write_text("".join(f"{d}\n" for d in deps))
    return python, site


def listing(folder: Path) -> dict[str, tuple]:
    """Every file and folder under ``folder``: relative path -> (size, mtime in ns) for files, () for folders."""
    out = {}
    for path in folder.rglob("*"):
        st = path.lstat()
        out[str(path.relative_to(folder))] = () if path.is_dir() else (st.st_size, st.st_mtime_ns)
    return out


_PROBE = r"""
import importlib.util, json, sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from mhar_titan.eval.load import load_run
run_dir, folder = sys.argv[1], sys.argv[2]
ours = load_run(run_dir)
tokens = ours.tokenizer.encode("ROMEO: But soft, what light through yonder window breaks?")
theirs = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, torch_dtype=torch.float32).eval()
with torch.no_grad():
    a = ours.model(torch.tensor([tokens]))[0]
    b = theirs(torch.tensor([tokens])).logits[0]
tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
kernels = importlib.util.find_spec("kernels")
print(json.dumps({
    "diff": (a - b).abs().max().item(), "shapes": [list(a.shape), list(b.shape)], "tokens": len(tokens),
    "class": type(theirs).__name__, "module": type(theirs).__module__,
    "ids_equal": tokenizer(ours.tokenizer.decode(tokens))["input_ids"] == tokens,
    "mhar_titan": sys.modules["mhar_titan"].__file__, "mhar_kernels": importlib.util.find_spec("mhar_kernels").origin,
    "kernels": None if kernels is None else (kernels.origin or list(kernels.submodule_search_locations)),
    "sys_path": sys.path, "meta_path": [repr(f) for f in sys.meta_path],
}))
"""


def test_the_installed_wheel_trains_exports_and_loads_outside_the_checkout_writing_nothing_into_site_packages(
        wheel, tmp_path):
    python, site = install_in_fresh_venv(wheel, tmp_path)
    before = listing(site)
    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir()
    home.mkdir()
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "TIKTOKEN_CACHE_DIR", "XDG_CACHE_HOME")}
    env.update(HOME=str(home), HF_HOME=str(tmp_path / "hf_home"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")

    def run(*args: str, **extra_env: str) -> str:
        # stdin closed: transformers 5 asks on a terminal before it reads a routed folder's config
        done = subprocess.run([str(python), *args], cwd=work, env={**env, **extra_env}, stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=PATIENCE_S)
        assert done.returncode == 0, (args[:3], done.stdout[-3000:], done.stderr[-5000:])
        return done.stdout

    assert "usage: python train.py --config FILE" in run("-m", "mhar_titan.train", "--help")

    # the tokenizer cache of an installed copy: the user's cache folder, not site-packages
    xdg = tmp_path / "xdg" / "mhar-titan" / "tiktoken"
    printed = run("-m", "mhar_titan.data.prepare_tokenizer", "--encodings", "gpt2", XDG_CACHE_HOME=str(xdg.parents[1]))
    assert f"tiktoken cache ready: {xdg} " in printed, printed
    cache = home / ".cache" / "mhar-titan" / "tiktoken"  # without XDG_CACHE_HOME, what the training reads
    printed = run("-m", "mhar_titan.data.prepare_tokenizer", "--encodings", "gpt2")
    assert f"tiktoken cache ready: {cache} " in printed, printed
    assert len(list(cache.iterdir())) == len(list(xdg.iterdir())) == 2  # encoder.json, vocab.bpe (sha1 names)

    run("-m", "mhar_titan.train", "--config", str(DEBUG_MHAR), "--job.name=wheel_mhar",
        f'--data.files=["{SAMPLE}/train-*.parquet"]', f'--data.validation_files=["{SAMPLE}/validation-*.parquet"]',
        "--training.steps=2", "--training.seq_len=32", "--training.local_batch_size=2",
        "--lr_scheduler.warmup_steps=1", "--validation.enable=false", "--metrics.log_freq=1")
    run_dir = work / "outputs" / "wheel_mhar"  # job.dump_folder "./outputs": the working folder
    rows = [r for r in read_metrics(run_dir) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["loss"]) for r in rows), rows
    assert (run_dir / "checkpoints" / "step-2" / "complete.json").is_file()

    printed = run("-m", "mhar_titan.convert", "export", "outputs/wheel_mhar", "outputs/hf/wheel_mhar")
    assert "trust_remote_code" in printed.strip().splitlines()[-1], printed
    seen = json.loads(run("-c", _PROBE, "outputs/wheel_mhar", "outputs/hf/wheel_mhar").splitlines()[-1])
    assert seen["class"] == "MharTitanForCausalLM" and seen["module"] == "mhar_titan.convert.hf_remote", seen
    assert seen["shapes"] == [[seen["tokens"], 50_304]] * 2, seen["shapes"]  # (tokens, gpt2's vocabulary padded)
    assert seen["diff"] <= 1e-5, seen["diff"]
    assert seen["ids_equal"]

    # the project came from the wheel alone
    for name in ("mhar_titan", "mhar_kernels"):
        assert Path(seen[name]).is_relative_to(site), (name, seen[name])
    assert not any("__editable__" in f for f in seen["meta_path"]), seen["meta_path"]
    for entry in seen["sys_path"]:  # no other folder on the path holds either package
        path = Path(entry or work).resolve()
        assert path == site.resolve() or not any((path / name).exists() for name in ("mhar_titan", "mhar_kernels")), entry
    kernels = [seen["kernels"]] if isinstance(seen["kernels"], str) else seen["kernels"] or []
    assert not any(Path(p).resolve().is_relative_to(ROOT) for p in kernels), kernels  # Hugging Face's, if any

    after = listing(site)
    written = {k: after.get(k) for k in set(before) | set(after) if before.get(k) != after.get(k)}
    assert not written, f"written under site-packages: {sorted(written)[:20]}"
