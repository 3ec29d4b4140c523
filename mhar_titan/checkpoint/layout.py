"""The on-disk layout of a run's checkpoints: ``<run_dir>/<folder>/step-N/`` folders and
their completion marker ``complete.json`` (see ``mhar_titan.checkpoint.manager``).

Reading it needs neither torch nor a process group, so tools and tests that only look
at a run folder import this module alone.
"""
from __future__ import annotations

import json
import re
import shutil
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
    """A checkpoint folder is complete while DCP's metadata, our marker and every file the
    marker lists (``files``: the folder's files when it was written) are present; a folder
    that lost a file (a deletion cut short) is not."""
    return incomplete_reason(path) is None


def incomplete_reason(path: Path) -> Optional[str]:
    """Why checkpoint folder ``path`` is not complete (one phrase, for a warning), or None."""
    if not (path / MARKER).is_file():
        return f"no {MARKER}: its save did not finish"
    if not (path / ".metadata").is_file():
        return "no .metadata: DCP's save did not finish"
    try:
        files = read_marker(path).get("files", [])
    except (OSError, ValueError) as e:
        return f"its {MARKER} cannot be read ({type(e).__name__}): written partly or damaged"
    missing = [name for name in files if not (path / name).is_file()]
    return f"{MARKER} lists {len(missing)} missing file(s), e.g. {missing[0]}" if missing else None


def read_marker(path: Path) -> dict:
    """The ``complete.json`` of a checkpoint folder (step, world size, fingerprint, model_only)."""
    with open(path / MARKER) as f:
        return json.load(f)


def apply_retention(folder: Path, keep_latest_k: int) -> list[Path]:
    """Keep the ``keep_latest_k`` newest complete checkpoints of ``folder`` (0 keeps all) and drop
    incomplete folders older than the newest complete one; returns the deleted folders.

    Only folders older than the newest complete checkpoint are touched, so an in-flight
    save and the newest complete checkpoint are never deleted. Each folder's marker is
    deleted before its files.
    """
    folders = step_folders(folder)
    complete = sorted(step for step, path in folders.items() if is_complete(path))
    if not complete:
        return []
    doomed = [s for s in folders if s < complete[-1] and not is_complete(folders[s])]
    if keep_latest_k > 0:
        doomed += complete[:-keep_latest_k]
    for step in sorted(doomed):
        # the marker goes first: a deletion cut short leaves a folder that is not complete
        (folders[step] / MARKER).unlink(missing_ok=True)
        shutil.rmtree(folders[step], ignore_errors=True)
    return [folders[step] for step in sorted(doomed)]
