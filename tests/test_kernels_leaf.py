"""The kernel package is a leaf (issue 10, acceptance 2): it imports nothing of the models, it is
importable from a plain checkout, and one routing call checks its arguments exactly once."""
from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys

import pytest
import torch

import mhar_kernels
from mhar_kernels import contract, triton_routing
from mhar_kernels import dispatch
from kernels_oracle import leaves, make_inputs
from helpers import PATIENCE_S, ROOT, no_install_argv


def _imported_modules(path: pathlib.Path) -> list[str]:
    """Absolute module names a file imports (relative imports resolve inside the package)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.append(node.module)
    return names


def test_no_module_under_kernels_imports_the_models():
    modules = sorted((ROOT / "kernels").rglob("*.py"))
    assert len(modules) >= 5, modules  # the walk found the package
    offenders = {str(p.relative_to(ROOT)): name for p in modules for name in _imported_modules(p)
                 if name.split(".")[0] == "mhar_titan"}
    assert offenders == {}


def test_ast_scan_would_see_a_models_import(tmp_path):
    """The scan above can fail: it finds both spellings of an import of the models."""
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\ndef f():\n    from mhar_titan.models import routing\n    import mhar_titan.config\n")
    assert [n for n in _imported_modules(bad) if n.startswith("mhar_titan")] == ["mhar_titan.models",
                                                                                 "mhar_titan.config"]


# Run by bench/plain_python.py (the GPU suite's launcher): no editable install, the checkout first.
_PLAIN_CHECKOUT = """
import importlib.util, os, sys
sys.modules["mhar_titan"] = None  # the kernels must not need the models
found = importlib.util.find_spec("mhar_kernels").origin
assert found == os.path.join(os.getcwd(), "kernels", "mhar_kernels", "__init__.py"), found  # the checkout, not an install
import torch, mhar_kernels
srcs = [torch.randn(1, 3, 8) for _ in range(2)]
out = mhar_kernels.route(srcs, torch.zeros(8), torch.ones(8), 2)
torch.testing.assert_close(out, (srcs[0] + srcs[1]) / 2)
print("plain checkout ok")
"""


def test_kernels_import_from_a_plain_checkout_without_the_models(tmp_path):
    script = tmp_path / "plain.py"
    script.write_text(_PLAIN_CHECKOUT)
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "plain_python.py"), str(script)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=PATIENCE_S)
    assert proc.returncode == 0 and "plain checkout ok" in proc.stdout, proc.stderr[-3000:]


@pytest.fixture
def counted_checks(monkeypatch):
    """Counts calls of the one argument checker (and of the fused forward launcher)."""
    calls = {"check": 0, "launch": 0}
    check, launch = contract.check_route_args, triton_routing.route_forward

    def counting_check(*args, **kwargs):
        calls["check"] += 1
        return check(*args, **kwargs)

    def counting_launch(*args, **kwargs):
        calls["launch"] += 1
        return launch(*args, **kwargs)

    monkeypatch.setattr(contract, "check_route_args", counting_check)
    monkeypatch.setattr(triton_routing, "route_forward", counting_launch)
    return calls


@pytest.mark.parametrize("kernel", ["eager", "triton"])
@pytest.mark.parametrize("delta", [False, True])
def test_arguments_checked_once_per_routing_call(counted_checks, kernel, delta):
    """One forward+backward through the models' routing: exactly one argument check, on the eager
    path and on the Triton path (interpreter on CPU), whose kernel really launches."""
    inputs = make_inputs(4, 16, 4, torch.float32, delta=delta)
    null = [inputs["null_source"]] if delta else []
    out = dispatch.route(null + inputs["sources"], inputs["query"], inputs["norm_weight"], 4, kernel=kernel,
                         partial=inputs.get("partial"), alpha=inputs.get("alpha"))
    torch.autograd.grad(out.sum(), leaves(inputs))
    assert counted_checks == {"check": 1, "launch": int(kernel == "triton")}


@pytest.mark.parametrize("delta", [False, True])
def test_arguments_checked_once_per_permuted_routing_call(counted_checks, delta):
    """The permuted head layout (eager path only) also checks its arguments exactly once."""
    inputs = make_inputs(4, 16, 4, torch.float32, delta=delta)
    null = [inputs["null_source"]] if delta else []
    permutation = torch.randperm(16, generator=torch.Generator().manual_seed(0))
    out = dispatch.route(null + inputs["sources"], inputs["query"], inputs["norm_weight"], 4, kernel="eager",
                         partial=inputs.get("partial"), alpha=inputs.get("alpha"), permutation=permutation)
    torch.autograd.grad(out.sum(), leaves(inputs))
    assert counted_checks == {"check": 1, "launch": 0}


def test_kernel_package_public_route_checks_once(counted_checks):
    inputs = make_inputs(3, 16, 4, torch.float32)
    mhar_kernels.route(inputs["sources"], inputs["query"], inputs["norm_weight"], 4).sum().backward()
    assert counted_checks == {"check": 1, "launch": 1}


def test_plain_python_runs_a_module_of_the_checkout_with_no_install(tmp_path):
    """bench/plain_python.py puts the checkout first before it imports anything of the project
    itself (its exit handler included), so that the GPU suite's rows run where nothing is installed."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(no_install_argv(ROOT / "bench" / "plain_python.py", "-m", "mhar_titan.models"),
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=PATIENCE_S)
    assert proc.returncode == 0 and "debug" in proc.stdout, proc.stderr[-3000:]
