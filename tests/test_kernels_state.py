"""The kernels keep no module-level mutable state besides caches of compiled code (the depth
buffer's design, docs/DESIGN.md "The depth buffer"): what a routing call depends on is in its
arguments, so two models, two threads or a CUDA graph capture see the same launches.

Read from the sources (no import runs), for every module of kernels/mhar_kernels/:
- no `global` statement, except for the one compiled-function cache listed below;
- no function mutates a module-level table (item or attribute assignment, or a mutating method
  call such as `append` / `update` / `add` on a name bound at module level);
- nothing in the project (kernels, models, trainer, benchmarks, tests) assigns to an attribute of
  a kernels class from outside it (a class attribute used as a switch is module-level state; a
  test's `monkeypatch.setattr` spy on a method, undone after the test, is not).
And the one process-wide setting, TRITON_INTERPRET, is read once for every kernel (a fresh
interpreter that unsets it after the first fused forward still runs the grouped kernels).
"""
import ast
import importlib.util
import os
import subprocess
import sys

import pytest
from helpers import PATIENCE_S, ROOT

KERNELS = ROOT / "kernels" / "mhar_kernels"
COMPILED_CACHES = {("reference.py", "_compiled_route_stacked")}  # torch.compile'd function, made on first use
MUTATORS = {"append", "extend", "insert", "update", "add", "pop", "popitem", "clear", "remove", "discard",
            "setdefault", "__setitem__", "__delitem__"}


def _modules() -> dict[str, ast.Module]:
    return {path.name: ast.parse(path.read_text(), str(path)) for path in sorted(KERNELS.glob("*.py"))}


def _module_names(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
        names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def _root_name(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _function_mutations(tree: ast.Module, names: set[str]) -> list[str]:
    """'line: name' for every mutation of a module-level `names` entry inside a function."""
    found = []
    for function in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
        local = {a.arg for a in (*function.args.args, *function.args.kwonlyargs, *function.args.posonlyargs)}
        for node in ast.walk(function):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else \
                node.targets if isinstance(node, ast.Delete) else []
            for target in targets:
                if isinstance(target, (ast.Subscript, ast.Attribute)) and _root_name(target) in names - local:
                    found.append(f"{node.lineno}: {_root_name(target)}")
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in MUTATORS and _root_name(node.func.value) in names - local):
                found.append(f"{node.lineno}: {_root_name(node.func.value)}.{node.func.attr}()")
    return found


def test_no_global_statement_besides_the_compiled_cache():
    found = [(name, g) for name, tree in _modules().items() for node in ast.walk(tree)
             if isinstance(node, ast.Global) for g in node.names]
    assert set(found) <= COMPILED_CACHES, found


def test_no_function_mutates_a_module_level_table():
    found = {name: hits for name, tree in _modules().items()
             if (hits := _function_mutations(tree, _module_names(tree)))}
    assert not found


def test_no_kernels_class_attribute_is_assigned_from_outside():
    classes = {node.name for tree in _modules().values() for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}
    files = [p for folder in ("kernels", "mhar_titan", "bench", "tests", "scripts") for p in (ROOT / folder).rglob("*.py")]
    found = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for target in targets:
                if isinstance(target, ast.Attribute):
                    owner = target.value
                    name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", None)
                    if name in classes:
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {name}.{target.attr}")
    assert not found


_INTERPRET_THEN_UNSET = """
import os
os.environ["TRITON_INTERPRET"] = "1"
import torch
from mhar_titan.models import ModelArgs, Transformer

def step(group):
    model = Transformer(ModelArgs(dim=64, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=128, vocab_size=256,
                                  residual="attn_res", routing_heads=4, routing_kernel="triton",
                                  routing_group_size=group))
    model.init_weights()
    model(torch.randint(0, 256, (2, 16))).sum().backward()

step(1)  # the per-call kernels load under the interpreter
del os.environ["TRITON_INTERPRET"]
step(2)  # the grouped kernels: decorated when the per-call ones were, under the same setting
print("grouped ran under the interpreter")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_every_kernel_is_decorated_under_the_one_interpreter_setting():
    """TRITON_INTERPRET is read once, when the kernels first load (`routing_kernels.INTERPRET`, which
    `op.can_run` answers from): the grouped kernels are decorated then too, so a later change of the
    environment cannot leave them on another backend than the per-call ones (it crashed the first
    grouped forward: "0 active drivers")."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    done = subprocess.run([sys.executable, "-c", _INTERPRET_THEN_UNSET], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=PATIENCE_S)
    assert done.returncode == 0 and "grouped ran under the interpreter" in done.stdout, done.stderr[-3000:]
