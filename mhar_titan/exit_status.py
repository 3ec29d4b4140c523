"""The trainer's exit status, written for the launch scripts: was the stop clean?

``torchrun`` exits 1 after it forwarded a preemption SIGTERM, even when every worker saved
and exited 0, so launchers cannot tell a clean preemption from a crash by exit code. The
trainer therefore writes, as it exits, one small text file of ``key=value`` lines::

    status=preempted
    exit_code=0
    step=120

``status`` is one of ``STATUSES``; a launcher that finds no file after the run (or only a
file from before it) treats the run as crashed (killed, out of memory, a bug). It is written
by global rank 0 to ``<run folder>/exit_status`` (removed when a training starts, so a crash
leaves none) and, when the environment variable
``MHAR_EXIT_STATUS_FILE`` names a file, to that file too (``slurm/train.sbatch`` and
``scripts/run_train.sh`` set it, since they do not know the run folder). Each write replaces
the file atomically. ``slurm/lib.sh`` (``next_action``) turns the status into requeue / stop.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from mhar_titan.files import write_text

ENV_VAR = "MHAR_EXIT_STATUS_FILE"
FILE_NAME = "exit_status"

STATUSES = {
    "completed": "training.steps reached (or nothing left to do): exit 0",
    "preempted": "a stop signal: the step finished, a checkpoint was saved (if enabled): exit 0, requeue",
    "bad_input": "a config, data, checkpoint, run folder or launch error the user must fix: exit 2, do not retry",
    "health": "too many consecutive non-finite steps: exit 1, do not retry",
}


def write_exit_status(run_dir: Optional[Path], status: str, exit_code: int, step: Optional[int] = None) -> None:
    """Write the status to ``run_dir / FILE_NAME`` (if ``run_dir`` exists) and to ``$MHAR_EXIT_STATUS_FILE``.

    Raises ValueError for a status not in ``STATUSES``; errors writing the files are ignored
    (the launcher then treats the run as crashed, the safe reading).
    """
    if status not in STATUSES:
        raise ValueError(f"unknown exit status {status!r}; one of {sorted(STATUSES)}")
    text = f"status={status}\nexit_code={exit_code}\n" + (f"step={step}\n" if step is not None else "")
    targets = [Path(run_dir) / FILE_NAME] if run_dir is not None and Path(run_dir).is_dir() else []
    if os.environ.get(ENV_VAR):
        targets.append(Path(os.environ[ENV_VAR]))
    for path in targets:
        try:
            write_text(path, text)
        except OSError:
            pass


def clear_exit_status(run_dir: Path) -> None:
    """Remove ``run_dir / FILE_NAME`` at the start of a training, so a crash leaves no status behind."""
    (Path(run_dir) / FILE_NAME).unlink(missing_ok=True)


def read_exit_status(path: Path) -> dict:
    """The ``key=value`` lines of a status file as a dict ({} if it does not exist)."""
    path = Path(path)
    if not path.is_file():
        return {}
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)
