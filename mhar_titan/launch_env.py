"""Rank, local rank and device of this process, from whichever launcher started it.

torchrun sets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` (and ``LOCAL_WORLD_SIZE``);
``srun`` without torchrun sets ``SLURM_PROCID``, ``SLURM_LOCALID`` and
``SLURM_NTASKS``. Neither ``LOCAL_WORLD_SIZE`` nor ``CUDA_VISIBLE_DEVICES`` is set the
same way everywhere: SLURM may give each task one GPU (``CUDA_VISIBLE_DEVICES=3``, so
the only visible device is index 0), give every task all GPUs of its node, or set
nothing. The rule here needs neither variable:

    local_rank = LOCAL_RANK, else SLURM_LOCALID, else 0
    device     = cuda:(local_rank mod torch.cuda.device_count())

so a worker always lands on a visible device, and with all GPUs visible local rank i
gets GPU i.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional

from mhar_titan.errors import UserError


class LaunchEnvError(UserError, RuntimeError):
    """The launcher's environment variables are missing, malformed or contradictory."""


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the job."""

    rank: int
    """Global rank, 0 .. world_size - 1."""
    local_rank: int
    """Index among the processes on this node."""
    world_size: int
    source: str
    """Which launcher's variables were used: "torchrun", "slurm" or "single"."""


def _int(env: Mapping[str, str], name: str) -> Optional[int]:
    raw = env.get(name)
    if raw is None or raw == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        raise LaunchEnvError(f"environment variable {name}={raw!r} is not an integer") from None
    if value < 0:
        raise LaunchEnvError(f"environment variable {name}={value} must be >= 0")
    return value


def resolve_launch_env(env: Optional[Mapping[str, str]] = None) -> LaunchEnv:
    """Rank, local rank and world size from torchrun's variables, else SLURM's, else a single process.

    torchrun's variables win when present (a torchrun inside an ``srun`` task also sees the
    task's ``SLURM_PROCID``, which numbers nodes, not workers).

    Raises:
        LaunchEnvError: a variable is not a non-negative integer, or rank >= world size.
    """
    env = os.environ if env is None else env
    rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
    if rank is not None or world is not None:
        source = "torchrun"
        local_rank = _int(env, "LOCAL_RANK")
        if local_rank is None:
            local_rank = _int(env, "SLURM_LOCALID") or 0
    elif _int(env, "SLURM_PROCID") is not None:
        source = "slurm"
        rank, world = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS")
        local_rank = _int(env, "SLURM_LOCALID") or 0
    else:
        return LaunchEnv(rank=0, local_rank=0, world_size=1, source="single")
    rank = 0 if rank is None else rank
    world = 1 if world is None else world
    if world < 1 or rank >= world:
        raise LaunchEnvError(
            f"rank {rank} is not below world size {world} ({source} variables); "
            "check RANK/WORLD_SIZE or SLURM_PROCID/SLURM_NTASKS"
        )
    return LaunchEnv(rank=rank, local_rank=local_rank, world_size=world, source=source)


def device_index(local_rank: int, visible_devices: int) -> int:
    """Accelerator index for a local rank: ``local_rank mod visible_devices``.

    Raises:
        LaunchEnvError: no device is visible (``visible_devices < 1``).
    """
    if visible_devices < 1:
        raise LaunchEnvError(
            "no accelerator is visible to this process (CUDA_VISIBLE_DEVICES is empty or no GPU present); "
            "run on CPU or request GPUs from the scheduler"
        )
    return local_rank % visible_devices


def resolve_device(env: Optional[Mapping[str, str]] = None):
    """``torch.device`` for this process: ``cuda:<device_index>`` when CUDA is available, else CPU."""
    import torch

    if not torch.cuda.is_available():
        return torch.device("cpu")
    local_rank = resolve_launch_env(env).local_rank
    return torch.device("cuda", device_index(local_rank, torch.cuda.device_count()))
