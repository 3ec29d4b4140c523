"""The run folder ``<job.dump_folder>/<job.name>/``: one training at a time, no silent overwrite.

``RunFolder`` owns what the trainer does to the folder itself (checkpoints and metric
sinks write inside it on their own):

* ``lock()``: an exclusive ``flock`` on ``<run_dir>/.lock`` held until ``unlock()``
  (the OS drops it if the process dies), so two trainings cannot write one folder;
* ``refuse_existing_run()``: a fresh start (no checkpoint restored) must not mix with
  a run already in the folder;
* ``truncate_metrics(step)``: on resume, drop metric rows the interrupted run wrote
  after the restored step;
* ``save_config()``: the resolved config, keeping a differing earlier one as
  ``<stem>.prev.toml``.

The checks run on rank 0; ``on_rank0`` raises their ``RunFolderError`` on every rank.
"""
from __future__ import annotations

import fcntl
import json
import pathlib
from typing import Callable, Optional

from mhar_titan.checkpoint.layout import step_folders
from mhar_titan.config import JobConfig, to_toml
from mhar_titan.errors import UserError


class RunFolderError(UserError, RuntimeError):
    """The run folder is in use by another training, or holds a run this start would overwrite."""


def on_rank0(rank: int, world_size: int, check: Callable[[], None]) -> None:
    """Run ``check`` on rank 0 and raise its ``RunFolderError`` on every rank (a collective
    when ``world_size > 1``: call it on every rank)."""
    error = None
    if rank == 0:
        try:
            check()
        except RunFolderError as e:
            error = e
    if world_size > 1:
        import torch.distributed as dist

        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise error


class RunFolder:
    """The run folder of the job ``cfg``: ``<cfg.job.dump_folder>/<cfg.job.name>``."""

    def __init__(self, cfg: JobConfig):
        self.cfg = cfg
        self.path = pathlib.Path(cfg.job.dump_folder) / cfg.job.name
        self._lock: Optional[object] = None

    @property
    def metrics_file(self) -> pathlib.Path:
        return self.path / self.cfg.metrics.jsonl_file

    def lock(self) -> None:
        """Create the folder and hold an exclusive ``flock`` on ``<path>/.lock`` until ``unlock()``.

        Raises:
            RunFolderError: another process holds the lock.
        """
        self.path.mkdir(parents=True, exist_ok=True)
        handle = open(self.path / ".lock", "a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            raise RunFolderError(
                f"another training is running in {self.path} (it holds {self.path / '.lock'}); "
                "wait for it to finish, or use another --job.name"
            ) from None
        self._lock = handle

    def unlock(self) -> None:
        """Release the lock (closing the file releases the flock); a no-op when not held."""
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def refuse_existing_run(self) -> None:
        """Refuse a fresh start into a folder that already holds a run.

        Raises:
            RunFolderError: the folder holds metrics rows or checkpoint folders.
        """
        found = []
        if self.metrics_file.is_file() and self.metrics_file.read_text().strip():
            found.append(self.metrics_file.name)
        if step_folders(self.path / self.cfg.checkpoint.folder):
            found.append(f"{self.cfg.checkpoint.folder}/step-N")
        if found:
            why = ("no complete checkpoint to resume from" if self.cfg.checkpoint.enable
                   else "checkpoint.enable = false, so nothing is resumed")
            raise RunFolderError(
                f"{self.path} already holds a run ({', '.join(found)}) and this start would overwrite it "
                f"({why}); start a fresh run with another --job.name, or delete or move {self.path}"
            )

    def truncate_metrics(self, step: int) -> None:
        """On resume from ``step``, drop JSONL rows written after it by the interrupted run."""
        if not self.metrics_file.exists():
            return
        rows = [line for line in self.metrics_file.read_text().splitlines() if line.strip()]
        kept = [line for line in rows if json.loads(line).get("step", 0) <= step]
        if len(kept) != len(rows):
            self.metrics_file.write_text("".join(line + "\n" for line in kept))

    def save_config(self) -> None:
        """Write the resolved config to ``job.save_config_file``; a differing one from an earlier
        start of this run (a resume with changed settings) is kept as ``<stem>.prev.toml``."""
        path = self.path / self.cfg.job.save_config_file
        text = to_toml(self.cfg)
        if path.is_file() and path.read_text() != text:
            path.replace(path.with_name(f"{path.stem}.prev{path.suffix}"))
        path.write_text(text)
        if self.cfg.job.print_config:
            print(text, flush=True)
