"""Imports flow one way (docs/ARCHITECTURE.md, "Import direction"), checked on the sources.

Read from the source (no import runs): every import statement of every module, at module level
or inside a function, absolute or relative (resolved against the module's package), is an edge;
each documented direction is one rule below.
"""
import ast
import pathlib

import pytest
from helpers import ROOT

PACKAGE = ROOT / "mhar_titan"
KERNELS = ROOT / "kernels" / "mhar_kernels"

LEAVES = ("mhar_titan.errors", "mhar_titan.lazy", "mhar_titan.progress", "mhar_titan.exit_status",
          "mhar_titan.files",
          "mhar_titan.console", "mhar_titan.cli_args")
MODEL_ARGUMENTS = ("mhar_titan.models.args", "mhar_titan.models.plan")  # the model's argument leaf
CONFIG = ("mhar_titan.config",)
BUILDERS = ("mhar_titan.models", "mhar_titan.data", "mhar_titan.checkpoint", "mhar_titan.optim",
            "mhar_titan.metrics", "mhar_titan.parallel", "mhar_titan.launch_env", "mhar_titan.preemption")
TRAINER = ("mhar_titan.train", "mhar_titan.components", "mhar_titan.dryrun")
TOOLS = ("mhar_titan.convert", "mhar_titan.analysis", "mhar_titan.eval", "mhar_titan.generate")
EXPERIMENTS = ("mhar_titan.experiments",)


def module_name(path: pathlib.Path) -> str:
    """Dotted name of a source file: mhar_titan.x.y, or mhar_kernels.x for kernels/mhar_kernels/x.py."""
    if path.is_relative_to(KERNELS):
        parts = ("mhar_kernels", *path.relative_to(KERNELS).with_suffix("").parts)
    else:
        parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: pathlib.Path) -> list[str]:
    """Absolute names of every module ``path`` imports (module level and inside functions; a
    relative import is resolved against the file's package; ``from x import y`` gives x and x.y)."""
    own = module_name(path)
    package = own if path.name == "__init__.py" else own.rpartition(".")[0]
    names = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            names.append(module)
            names += [f"{module}.{a.name}" for a in node.names]
    return names


def sources(*prefixes: str) -> list[pathlib.Path]:
    files = sorted(PACKAGE.rglob("*.py")) + sorted(KERNELS.rglob("*.py"))
    return [p for p in files if module_name(p).startswith(prefixes)]


def within(name: str, prefixes: tuple) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def violations(importers: tuple, forbidden: tuple, allowed: tuple = ()) -> list[tuple[str, str]]:
    """(module, imported name) where a module under ``importers`` imports one under ``forbidden``
    that is not under ``allowed``."""
    found = []
    for path in sources(*importers):
        for name in imports(path):
            if within(name, forbidden) and not within(name, allowed):
                found.append((module_name(path), name))
    return sorted(set(found))


OURS = ("mhar_titan", "mhar_kernels")

RULES = {
    # the bottom: imported by anyone, they import nothing of ours (lazy only resolves names it is given)
    "leaves import nothing of ours": (LEAVES, OURS, LEAVES),
    "kernels import nothing of mhar_titan": (("mhar_kernels",), ("mhar_titan",)),
    "the model's arguments import only the leaves": (MODEL_ARGUMENTS, OURS, LEAVES + MODEL_ARGUMENTS),
    "config imports no builder, trainer or tool": (CONFIG, OURS, LEAVES + CONFIG + MODEL_ARGUMENTS),
    "builders import no trainer, tool or experiment": (BUILDERS, TRAINER + TOOLS + EXPERIMENTS),
    # eval scores with the trainer's token loss, its one definition (components/loss.py)
    "analysis and eval import no trainer": (("mhar_titan.analysis", "mhar_titan.eval"), TRAINER + EXPERIMENTS,
                                            ("mhar_titan.components.loss",)),
    "the trainer and the tools import no experiment": (TRAINER + TOOLS, EXPERIMENTS),
}


@pytest.mark.parametrize("rule", RULES)
def test_imports_follow_the_documented_direction(rule):
    importers, forbidden, *allowed = RULES[rule]
    assert violations(importers, forbidden, *allowed) == []


def test_builders_import_no_other_builders_internals():
    """A builder reads another builder only through the leaves (config, the model's arguments)
    and through what the documented contracts name (the model for parallel, optim and metrics; the
    launch environment for parallel)."""
    shared = {  # importer -> builders it may read (docs/ARCHITECTURE.md)
        "mhar_titan.parallel": ("mhar_titan.models", "mhar_titan.launch_env"), "mhar_titan.metrics": ("mhar_titan.models",),
        "mhar_titan.optim": ("mhar_titan.models",),
    }
    found = []
    for builder in BUILDERS:
        others = tuple(b for b in BUILDERS if b != builder and b not in shared.get(builder, ()))
        found += violations((builder,), others, MODEL_ARGUMENTS)
    assert found == []


def test_the_scan_sees_relative_and_function_level_imports():
    """The scan can fail: a relative import, a function-level import and a `from . import x`
    inside a package are all edges."""
    assert "mhar_titan.models.plan" in imports(PACKAGE / "models" / "args.py")  # `from .plan import RoutingPlan`
    assert "mhar_kernels.op" in imports(KERNELS / "dispatch.py")  # `from . import op` inside a function
    parser = PACKAGE / "config" / "parser.py"
    assert "mhar_titan.models.args" in imports(parser)  # inside job_model_args()
    assert violations(("mhar_titan.dryrun",), ("mhar_kernels",)) != []  # a real edge is reported
    assert violations(("mhar_titan.models.router",), ("mhar_titan.models.plan",)) != []  # `from .plan import`


def test_the_file_writer_imports_nothing_of_the_project_but_the_errors():
    """Every layer writes its files through mhar_titan.files, so it sits with the leaves."""
    assert [n for n in imports(PACKAGE / "files.py") if n.startswith("mhar_titan")]
    assert violations(("mhar_titan.files",), OURS, ("mhar_titan.errors",)) == []


def import_cycles() -> list[list[str]]:
    """Every set of our modules that import each other round a circle (module level or inside a
    function, as `imports` reads them), each sorted; empty when imports flow one way."""
    mods = {module_name(p): p for p in sources("mhar_titan", "mhar_kernels")}
    graph = {m: sorted({n for n in imports(p) if n in mods and n != m}) for m, p in mods.items()}
    order, low, stack, cycles = {}, {}, [], []
    for root in graph:  # Tarjan's strongly connected components, iteratively
        if root in order:
            continue
        work = [(root, iter(graph[root]))]
        order[root] = low[root] = len(order)
        stack.append(root)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == order[node]:
                    comp = stack[stack.index(node):]
                    del stack[stack.index(node):]
                    if len(comp) > 1:
                        cycles.append(sorted(comp))
            elif nxt not in order:
                order[nxt] = low[nxt] = len(order)
                stack.append(nxt)
                work.append((nxt, iter(graph[nxt])))
            elif nxt in stack:
                low[node] = min(low[node], order[nxt])
    return sorted(cycles)


def test_no_two_modules_import_each_other():
    """Imports flow one way inside a layer too: no circle of modules (a function-level import
    counts), e.g. the tokenizer builders and the tokenizer type they share."""
    assert import_cycles() == []
    assert "mhar_titan.data.tokenizer_base" in imports(PACKAGE / "data" / "hf_tokenizer.py")


def entry_points(path: pathlib.Path) -> list[str]:
    """How the module at ``path`` runs as a command: an ``argparse`` import and an
    ``if __name__ == "__main__"`` block, each named where present."""
    found = []
    tree = ast.parse(path.read_text(), filename=str(path))
    if any(name == "argparse" or name.startswith("argparse.") for name in imports(path)):
        found.append("imports argparse")
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Compare) and \
                isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__":
            found.append("has a __main__ block")
    return found


def test_the_kernels_package_holds_only_what_the_model_runs():
    """Measurement tools (the sm_90 compile report, benchmarks) live in bench/: no module of
    mhar_kernels parses a command line or runs as a command; the scan sees both forms."""
    assert {module_name(p): entry_points(p) for p in sources("mhar_kernels") if entry_points(p)} == {}
    assert entry_points(ROOT / "bench" / "compile_report.py") == ["imports argparse", "has a __main__ block"]


def test_one_module_finds_a_runs_checkpoint():
    """``find_checkpoint`` (which checkpoint a run or step-N folder names) is defined once, in the
    checkpoint package; the tools that take a run folder import it from there."""
    defined = [module_name(p) for p in sources("mhar_titan")
               if any(isinstance(n, ast.FunctionDef) and n.name == "find_checkpoint"
                      for n in ast.walk(ast.parse(p.read_text())))]
    assert defined == ["mhar_titan.checkpoint.find"]
    for tool in ("convert/__main__.py", "analysis/__main__.py", "eval/load.py"):
        assert "mhar_titan.checkpoint.find.find_checkpoint" in imports(PACKAGE / tool), tool
