"""The on-disk layout of a run's checkpoints: ``<run_dir>/<folder>/step-N/`` folders and
their completion marker ``complete.json`` (see ``mhar_titan.checkpoint.manager``).

Reading it needs neither torch nor a process group, so tools and tests that only look
at a run folder import this module alone.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional

MARKER = "complete.json"
"""Name of the completion marker inside a ``step-N`` folder, written last."""

_STEP_DIR = re.compile(r"^step-(\d+)$")


def step_of(path: Path) -> Optional[int]:
    """N of a folder named ``step-N``; None for any other name."""
    match = _STEP_DIR.match(path.name)
    return int(match.group(1)) if match else None


def step_folders(root: Path) -> dict[int, Path]:
    """``{step: path}`` of every ``step-N`` folder under ``root`` (complete or not)."""
    if not root.is_dir():
        return {}
    found = {}
    for child in root.iterdir():
        step = step_of(child)
        if step is not None and child.is_dir():
            found[step] = child
    return found


def is_complete(path: Path) -> bool:
    """A checkpoint folder is complete when both DCP's metadata and our marker exist."""
    return (path / MARKER).is_file() and (path / ".metadata").is_file()


def read_marker(path: Path) -> dict:
    """The ``complete.json`` of a checkpoint folder (step, world size, fingerprint, model_only)."""
    with open(path / MARKER) as f:
        return json.load(f)
