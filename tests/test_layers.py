"""Imports flow one way (docs/ARCHITECTURE.md): config -> builders -> trainer and tools.

Read from the source (no import runs): the modules below the trainer import nothing
of the trainer, its components or the tools built on them, and the config layer imports
nothing but itself, the errors and the section dataclasses its builders own (the
``[model]`` checks import the model package when a config is loaded, inside functions).
"""
import ast

import pytest
from helpers import ROOT

PACKAGE = ROOT / "mhar_titan"
BELOW_TRAINER = ["errors.py", "lazy.py", "config", "models", "data", "checkpoint", "optim.py", "metrics.py", "parallel.py",
                 "launch_env.py", "preemption.py", "progress.py", "exit_status.py", "files.py"]
ABOVE = ("mhar_titan.train", "mhar_titan.components", "mhar_titan.dryrun", "mhar_titan.eval", "mhar_titan.analysis",
         "mhar_titan.experiments", "mhar_titan.convert", "mhar_titan.generate")


def imports(path, top_level_only=False):
    """Absolute module names ``path`` imports (with ``top_level_only``: outside functions)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    names = []
    for node in nodes:
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def modules(part):
    path = PACKAGE / part
    return [path] if path.suffix == ".py" else sorted(path.rglob("*.py"))


@pytest.mark.parametrize("part", BELOW_TRAINER)
def test_lower_layers_import_nothing_above_them(part):
    found = [(p.relative_to(ROOT).as_posix(), name) for p in modules(part) for name in imports(p)
             if name.startswith(ABOVE)]
    assert found == []


def test_config_layer_imports_only_its_own_layer_at_module_level():
    allowed = ("mhar_titan.config", "mhar_titan.errors", "mhar_titan.data.config", "mhar_titan.checkpoint.config")
    found = [(p.name, name) for p in modules("config") + modules("errors.py") for name in imports(p, True)
             if name.startswith("mhar_titan") and not name.startswith(allowed)]
    assert found == []
    # the section dataclasses the config layer borrows import nothing of the project but the errors
    for owned in ("data/config.py", "checkpoint/config.py"):
        assert [n for n in imports(PACKAGE / owned) if n.startswith("mhar_titan")] in ([], ["mhar_titan.errors"])


def test_the_file_writer_imports_nothing_of_the_project_but_the_errors():
    # every layer writes its files through mhar_titan.files, so it must sit below all of them
    assert [n for n in imports(PACKAGE / "files.py") if n.startswith("mhar_titan")] == ["mhar_titan.errors"]
