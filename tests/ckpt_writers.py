"""DCP storage writers for the checkpoint tests (shared by tests/test_checkpoint.py and the workers)."""
from __future__ import annotations

import time
from typing import Callable

import torch.distributed.checkpoint as dcp


class SlowWriter(dcp.FileSystemWriter):
    """``FileSystemWriter`` that sleeps ``delay_s`` seconds before writing: keeps an async save in flight."""

    def __init__(self, path: str, delay_s: float) -> None:
        super().__init__(path)
        self.delay_s = delay_s

    def write_data(self, plan, planner):
        time.sleep(self.delay_s)
        return super().write_data(plan, planner)


def slow_writer(delay_s: float) -> Callable[[str], SlowWriter]:
    """A ``storage_writer_factory`` for ``CheckpointManager`` whose writers sleep ``delay_s`` seconds."""
    return lambda path: SlowWriter(path, delay_s)
