"""DCP storage writers for the checkpoint tests (shared by tests/test_checkpoint.py and the workers)."""
from __future__ import annotations

import threading
from typing import Callable

import torch.distributed.checkpoint as dcp

from helpers import PATIENCE_S


class GatedWriter(dcp.FileSystemWriter):
    """``FileSystemWriter`` that writes only once ``gate`` is set: keeps an async save in flight
    until the test has seen what it wants to see, however slow the machine (an event, not a
    delay). Waits at most ``PATIENCE_S`` (a hang guard), then writes anyway."""

    def __init__(self, path: str, gate: threading.Event) -> None:
        super().__init__(path)
        self.gate = gate

    def write_data(self, plan, planner):
        self.gate.wait(PATIENCE_S)
        return super().write_data(plan, planner)


def gated_writer(gate: threading.Event) -> Callable[[str], GatedWriter]:
    """A ``storage_writer_factory`` for ``CheckpointManager`` whose writers wait for ``gate``."""
    return lambda path: GatedWriter(path, gate)
