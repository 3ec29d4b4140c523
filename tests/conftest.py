"""Shared test setup: offline, CPU-only, Triton through its interpreter; ``gpu`` tests need CUDA.

Environment variables must be set before torch/triton/datasets are imported,
so they live at the top of this file (pytest imports conftest first).
"""
import os

import pytest
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


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` need CUDA: skipped where none is visible (CI runs CPU-only)."""
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs CUDA (marked gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def one_thread():
    """Run the test with one intra-op thread (restored after): tiny ops gain nothing from more,
    and lose much on a busy 2-core runner. Use with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
