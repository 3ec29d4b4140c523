"""Shared test setup: offline, CPU-only, Triton through its interpreter; ``gpu`` tests need CUDA.

Environment variables must be set before torch/triton/datasets are imported,
so they live at the top of this file (pytest imports conftest first).
"""
import os
import re

import pytest
import tiers  # pytest and the standard library only
from helpers import ROOT  # standard library only: nothing is imported before the variables are set

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(ROOT / ".cache" / "tiktoken"))
# Triton kernels run on CPU only through the interpreter; the flag must be set
# before any @triton.jit decorator runs. A CUDA machine runs them natively.
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # pragma: no cover
    pass


# A test module that imports one of these (or importorskips it) touches a third-party API: it is
# marked ``third_party``, and `make test-latest` runs those against the newest allowed versions.
THIRD_PARTY = ("transformers", "lm_eval", "datasets", "wandb", "tensorboard", "safetensors", "tokenizers",
               "huggingface_hub", "kernels")
_THIRD_PARTY_IMPORT = re.compile(r"^\s*(?:import|from)\s+(?:torch\.utils\.)?(%s)\b|importorskip\(\s*[\"'](%s)\b"
                                 % ("|".join(THIRD_PARTY), "|".join(THIRD_PARTY)), re.MULTILINE)
_touches_third_party: dict[str, bool] = {}


def touches_third_party(path) -> bool:
    """Whether the test module at ``path`` imports a THIRD_PARTY package (read once per module)."""
    key = str(path)
    if key not in _touches_third_party:
        _touches_third_party[key] = bool(_THIRD_PARTY_IMPORT.search(open(path, encoding="utf-8").read()))
    return _touches_third_party[key]


def pytest_configure(config):
    tiers.configure(config)  # the fast tier's per-test budget, where it runs (CI)


def pytest_collection_modifyitems(config, items):
    """Tests in a module that imports a THIRD_PARTY package are marked ``third_party``; the slow tier
    is marked and kinds that cannot run here are skipped (``tiers.mark_tiers``: ``gpu`` without CUDA,
    CI runs CPU-only)."""
    for item in items:
        if item.path.suffix == ".py" and touches_third_party(item.path):
            item.add_marker(pytest.mark.third_party)
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        has_cuda = False
    tiers.mark_tiers(items, has_cuda)


@pytest.fixture
def one_thread():
    """Run the test with one intra-op thread (restored after): tiny ops gain nothing from more,
    and lose much on a busy 2-core runner. Use with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# -- launching fixtures: a test that asks for one (or for a fixture that does) is in the slow tier,
# marked with its kind (tests/tiers.py, SLOW_FIXTURES) ---------------------------------------------

@pytest.fixture(scope="session")
def torchrun():
    """``torchrun(script, *args, nproc=2, env=None)``: ``python -m torch.distributed.run --standalone
    --nproc_per_node=nproc script args`` from the repository root (gloo on CPU), with this
    environment updated by ``env``; returns the CompletedProcess (text, stdout and stderr captured).
    Its tests are in the slow tier, marked ``distributed``."""
    import subprocess
    import sys

    from helpers import PATIENCE_S

    def launch(script, *args, nproc: int = 2, env: dict | None = None) -> subprocess.CompletedProcess:
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                str(script), *map(str, args)]
        return subprocess.run(argv, cwd=ROOT, env={**os.environ, **(env or {})}, capture_output=True, text=True,
                              timeout=PATIENCE_S)

    return launch


@pytest.fixture(scope="session")
def train_process():
    """``train_process(*args, env=None)``: ``python train.py args`` in a process of its own from the
    repository root, with the environment ``env`` (default: this process's); returns the
    CompletedProcess (text, stdout and stderr captured). Its tests are in the slow tier, marked
    ``processes``."""
    import subprocess
    import sys

    from helpers import PATIENCE_S

    def launch(*args, env: dict | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "train.py", *map(str, args)], cwd=ROOT,
                              env=dict(os.environ) if env is None else env, capture_output=True, text=True,
                              timeout=PATIENCE_S)

    return launch


@pytest.fixture(scope="session")
def warm_python():
    """One warm interpreter for the session (tests/warm_python.py): ``warm_python.run(args)`` runs
    ``python ARGS`` as a process of its own, forked from a server that imported torch and the
    package once; ``warm_python.python`` is its shim and ``warm_python.env()`` puts it first on PATH.
    For tests that start many short commands; a test of how the interpreter itself starts (closed
    streams, import resolution, a process's own memory) runs ``sys.executable`` instead."""
    from warm_python import WarmPython

    with WarmPython() as warm:
        yield warm
