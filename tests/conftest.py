"""Shared test setup: offline, CPU-only, Triton through its interpreter.

Environment variables must be set before torch/triton/datasets are imported,
so they live at the top of this file (pytest imports conftest first).
"""
import os
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]

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
