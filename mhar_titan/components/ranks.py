"""What every rank must agree on: the seeds of the global RNGs, and whether start-up or a step's
data fetch failed anywhere (so that all ranks stop together with exit code 2 instead of some of
them waiting in a collective until the process-group timeout)."""
from __future__ import annotations

import os
import random
from typing import Callable, Optional

import numpy as np
import torch
import torch.distributed as dist

from mhar_titan.data import DataError
from mhar_titan.errors import UserError


def seed_global_rngs(seed: int, deterministic: bool, device: torch.device) -> None:
    """Seed torch's, numpy's and Python's global RNGs with ``seed`` (they are saved in every
    checkpoint, so a resumed run continues the same streams); with ``deterministic``, make torch
    use deterministic algorithms (and cuBLAS a fixed workspace on CUDA)."""
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    if deterministic:
        if device.type == "cuda":
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)


def agree_on_setup(build: Callable[[], None], world_size: int) -> None:
    """Run ``build`` on every rank; if it raised a ``UserError`` on any rank, raise on every rank
    (that rank's own error where it happened, a ``UserError`` quoting the first failing rank's
    message elsewhere). One ``all_gather_object`` when ``world_size > 1``."""
    error: Optional[UserError] = None
    try:
        build()
    except UserError as e:
        error = e
    if world_size > 1:
        errors: list = [None] * world_size
        dist.all_gather_object(errors, None if error is None else f"{type(error).__name__}: {error}")
        failed = [(r, msg) for r, msg in enumerate(errors) if msg is not None]
        if failed and error is None:
            rank, msg = failed[0]
            raise UserError(f"rank {rank} could not start: {msg}")
    if error is not None:
        raise error


def agree_on_data_error(error: Optional[UserError], step: int, rank: int, world_size: int,
                        device: torch.device) -> None:
    """Per step, before any collective of the step: if fetching the batches failed on any rank (a
    bad row met while reading; ``error`` is this rank's), raise on every rank, so all stop within
    the step. One all-reduce of one number when ``world_size > 1``.

    Raises:
        UserError: ``error`` itself on the rank that met it; a ``DataError`` naming the failing
        rank and step elsewhere.
    """
    failed = -1 if error is None else rank
    if world_size > 1:
        box = torch.tensor([float(failed)], device=device)
        dist.all_reduce(box, op=dist.ReduceOp.MAX)
        failed = int(box.item())
    if error is not None:
        raise error
    if failed >= 0:
        raise DataError(f"rank {failed} stopped at step {step} on a data error (its message names the file "
                        "and row); every rank stops")
