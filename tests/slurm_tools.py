"""Shared helpers of the launch tests: script paths, tool checks, free ports, environments."""
from __future__ import annotations

import os
import pathlib
import shutil
import socket
import sys

import pytest

from helpers import ROOT
SCRIPTS = sorted([*ROOT.glob("slurm/*.sh"), *ROOT.glob("slurm/*.sbatch"), *ROOT.glob("scripts/*.sh")])
VENV_BIN = pathlib.Path(sys.executable).parent


def require_tool(name: str, why: str) -> str:
    """Path of `name`; skips the test when it is missing, except under CI (CI=1), where it fails."""
    path = shutil.which(name)
    if path is None:
        msg = f"{name} is not installed ({why}); install it with slurm/ci_setup.sh"
        if os.environ.get("CI"):
            pytest.fail(msg + " -- CI must provide it")
        pytest.skip(msg)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_env(**extra: str) -> dict:
    """os.environ without launcher/SLURM variables, with this venv first on PATH, plus `extra`."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "TORCHELASTIC_")) and k not in (
               "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "CUDA_VISIBLE_DEVICES", "NPROC_PER_NODE", "NNODES", "NODE_RANK", "RDZV_ENDPOINT")}
    env["PATH"] = f"{VENV_BIN}:{env.get('PATH', '')}"
    env["PYTHON"] = sys.executable
    env.update(extra)
    return env
