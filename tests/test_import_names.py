"""No name of ours shadows an installed package when Python runs from the repository root.

Every command in the README runs from the root of a clone, where the root is first on `sys.path`
(`python -c`, `python -m`, pytest); pytest also puts `tests/` first, and `python bench/X.py` puts
`bench/`. A module or regular package in one of those folders whose name an installed
distribution also provides wins over the installed one: with transformers 5.25, which imports
Hugging Face's `kernels` package, our old `kernels/__init__.py` made every export, import and
lm-eval command fail from the root (`cannot import name 'CUDAProperties' from 'kernels'`).
The Triton code therefore lives in `kernels/mhar_kernels/` and `kernels/` has no `__init__.py`
(a folder without one loses to any installed package of its name).
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from helpers import PATIENCE_S, ROOT

# Folders that are first on sys.path for some command of ours (see the module docstring).
PATH_FOLDERS = (ROOT, ROOT / "tests", ROOT / "bench")
# Imported in full from the root, where installed; every other name is only resolved (find_spec).
MUST_IMPORT = ("kernels", "transformers", "lm_eval", "datasets", "triton", "torch")
OUR_DISTRIBUTION = "mhar-titan"


def installed_top_level_names() -> dict[str, list[str]]:
    """{import name: [distributions]} for every top-level module or package the environment's
    distributions provide, ours excluded."""
    names = {}
    for name, dists in importlib.metadata.packages_distributions().items():
        dists = [d for d in dists if d.lower().replace("_", "-") != OUR_DISTRIBUTION]
        if dists and name.isidentifier() and not name.startswith("__editable__"):
            names[name] = dists
    return names


def importable_from(folder: Path) -> set[str]:
    """Names `import NAME` resolves to ``folder`` when it is on sys.path: its modules (*.py) and its
    regular packages (folders with __init__.py). A folder without one is a namespace portion, which
    an installed module or regular package of the same name always wins over."""
    names = {p.stem for p in folder.glob("*.py")}
    names |= {p.name for p in folder.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    return {n for n in names if n.isidentifier()}


def test_no_folder_on_our_path_defines_an_installed_name():
    installed = installed_top_level_names()
    assert {"torch", "numpy"} <= installed.keys()  # the metadata walk found the environment
    clashes = {f"{folder.relative_to(ROOT.parent)}/{name}": installed[name]
               for folder in PATH_FOLDERS for name in importable_from(folder) & installed.keys()}
    assert clashes == {}, f"rename these (an installed distribution provides the name): {clashes}"


def test_the_rule_sees_a_package_folder_and_a_module(tmp_path):
    """The check above can fail: a regular package and a module are both seen, a namespace folder is not."""
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").touch()
    (tmp_path / "numpy.py").touch()
    (tmp_path / "triton").mkdir()  # no __init__.py: a namespace portion, loses to the installed triton
    assert importable_from(tmp_path) == {"kernels", "numpy"}


# Run from the repository root as `python -c`: sys.path[0] is the root, as for every README command.
_RESOLVE = r"""
import importlib, importlib.util, json, sys
names, must = json.loads(sys.argv[1]), json.loads(sys.argv[2])
assert sys.path[0] in ("", ".") or sys.path[0] == __import__("os").getcwd(), sys.path[:3]
where = {}
for name in names:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):  # a name a distribution lists but cannot be found alone
        continue
    if spec is not None:
        where[name] = [spec.origin] if spec.origin not in (None, "namespace") else list(spec.submodule_search_locations)
imported = {name: [importlib.import_module(name).__file__] for name in ("mhar_titan", "mhar_kernels")}
for name in must:
    module = importlib.import_module(name)
    imported[name] = [module.__file__] if getattr(module, "__file__", None) else list(module.__path__)
if "transformers" in must:
    from transformers import AutoModelForCausalLM  # what failed from the root with transformers 5.25
    imported["transformers.AutoModelForCausalLM"] = AutoModelForCausalLM.__module__
print(json.dumps({"where": where, "imported": imported}))
"""


def _inside_repository(path: str, site_dirs: list[Path]) -> bool:
    resolved = Path(path).resolve()
    return resolved.is_relative_to(ROOT) and not any(resolved.is_relative_to(s) for s in site_dirs)


def resolve_from(cwd: Path, names: list[str], must: list[str]) -> dict:
    """What a child `python -c` run in ``cwd`` finds for ``names`` (find_spec) and imports for ``must``
    and our two packages."""
    env = dict(os.environ, TRITON_INTERPRET="1", TRANSFORMERS_OFFLINE="1", HF_HUB_OFFLINE="1")
    env.pop("PYTHONPATH", None)
    done = subprocess.run([sys.executable, "-c", _RESOLVE, json.dumps(names), json.dumps(must)],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=PATIENCE_S)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_installed_packages_resolve_to_site_packages_from_the_root_and_from_elsewhere(tmp_path):
    installed = installed_top_level_names()
    must = [n for n in MUST_IMPORT if n in installed]
    assert {"torch", "triton"} <= set(must), must  # `make setup` installs both
    seen = resolve_from(ROOT, sorted(installed), must)
    site_dirs = [Path(sysconfig.get_paths()[k]).resolve() for k in ("purelib", "platlib")]
    shadowed = {name: paths for name, paths in seen["where"].items()
                if any(_inside_repository(p, site_dirs) for p in paths)}
    assert shadowed == {}, f"from the repository root these names resolve to our files: {shadowed}"
    for name in must:
        assert not any(_inside_repository(p, site_dirs) for p in seen["imported"][name]), (name, seen["imported"][name])
    assert len(seen["where"]) >= 50  # the resolve walk covered the environment, not a handful of names
    # The same names from another folder with the venv's Python: the same files, ours included.
    assert resolve_from(tmp_path, sorted(installed), must) == seen
    assert Path(seen["imported"]["mhar_kernels"][0]) == ROOT / "kernels" / "mhar_kernels" / "__init__.py"


def test_a_command_prints_the_same_from_the_root_and_from_elsewhere(tmp_path):
    runs = [subprocess.run([sys.executable, "-m", "mhar_titan.models"], cwd=cwd, capture_output=True, text=True,
                           timeout=PATIENCE_S) for cwd in (ROOT, tmp_path)]
    assert all(r.returncode == 0 for r in runs), [r.stderr[-2000:] for r in runs]
    assert "mhar" in runs[0].stdout and runs[0].stdout == runs[1].stdout
