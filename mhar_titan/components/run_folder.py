"""The run folder ``<job.dump_folder>/<job.name>/``: one training at a time, no silent overwrite.

``RunFolder`` owns what the trainer does to the folder itself (checkpoints and metric
sinks write inside it on their own):

* ``lock()``: an exclusive ``flock`` on ``<run_dir>/.lock`` held until ``unlock()``
  (the OS drops it if the process dies), so two trainings cannot write one folder;
* ``refuse_existing_run()``: a fresh start (no checkpoint restored) must not mix with
  a run already in the folder; a relaunch of the same resolved config (a job that died
  before its first complete checkpoint) starts again, the earlier metrics set aside;
* ``refuse_changed_seq_len()``: a resume at another ``training.seq_len`` is refused before
  the model is built;
* ``save_config()``: the resolved config, keeping a differing earlier one as
  ``<stem>.prev.toml``;
* ``check_writable()``: every folder the run will write (the run folder, checkpoints, the
  metrics file's folder, TensorBoard, wandb, profiler traces, memory snapshots: ``outputs()``)
  exists or can be created and can be written, checked on every rank before anything is built
  (``train.check_config``, the dry run), so an unwritable ``checkpoints/`` is not found at the
  first save, after the interval's compute.

The checks run on rank 0; ``on_rank0`` raises their ``RunFolderError`` on every rank.
"""
from __future__ import annotations

import fcntl
import logging
import pathlib
from typing import Callable, Optional

from mhar_titan.checkpoint.layout import MARKER, is_complete, read_marker, step_folders
from mhar_titan.config import ConfigError, JobConfig, to_toml
from mhar_titan.config.parser import read_toml
from mhar_titan.errors import UserError
from mhar_titan.files import OutputFolderError, WriteError, check_output_folder, write_text

logger = logging.getLogger(__name__)


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

    def outputs(self) -> list[tuple[pathlib.Path, str, bool]]:
        """(path, the setting that names it, is a folder) of everything this job writes: the run
        folder, its resolved config and metrics file, and the folders of the enabled writers
        (checkpoints: also a model-only last save; TensorBoard, wandb, profiler traces, memory
        snapshots). The trainer writes nothing outside the run folder."""
        cfg, run = self.cfg, self.path
        out = [(run, "the run folder (job.dump_folder / job.name)", True),
               (run / cfg.job.save_config_file, "job.save_config_file", False),
               (self.metrics_file, "metrics.jsonl_file", False)]
        if cfg.checkpoint.enable:
            out.append((run / cfg.checkpoint.folder, "checkpoint.folder", True))
        if cfg.metrics.enable_tensorboard:
            out.append((run / cfg.metrics.save_tb_folder, "metrics.save_tb_folder", True))
        if cfg.metrics.enable_wandb:
            out.append((run / "wandb", "the wandb folder (metrics.enable_wandb)", True))
        if cfg.profiling.enable_profiling:
            out.append((run / cfg.profiling.save_traces_folder, "profiling.save_traces_folder", True))
        if cfg.profiling.enable_memory_snapshot:
            out.append((run / cfg.profiling.save_memory_snapshot_folder, "profiling.save_memory_snapshot_folder",
                        True))
        return out

    def check_writable(self) -> None:
        """Every path of ``outputs()`` can be written: a folder exists or can be created and takes a
        file (``files.check_output_folder``), a file's folder does and the file is not a folder.
        Nothing is left behind. Run it on every rank (each writes its checkpoint shards).

        Raises:
            OutputFolderError: naming the setting, the path, the problem and the fix.
        """
        for path, setting, folder in self.outputs():
            if folder:
                check_output_folder(path, setting)
                continue
            if path.is_dir():
                raise OutputFolderError(f"{setting}: {path} is a folder, where the run writes a file; move it away "
                                        "or name another file")
            check_output_folder(path.parent, setting + "'s folder")

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

    def refuse_changed_seq_len(self) -> None:
        """Refuse, before anything is built, a resume whose ``training.seq_len`` differs from the run's.

        Applies when the folder holds a complete checkpoint whose data position would be restored
        (``checkpoint.enable``, "dataloader" not in ``checkpoint.exclude_from_loading``): the data
        loader would refuse the position only after the model was built and the checkpoint read.
        The run's seq_len is the one the checkpoint to be loaded (``load_step``, else the newest complete
        one) recorded in its marker, so the suggested value is the one the loader then accepts, also after
        newer checkpoints were moved away; for a checkpoint from before markers held it, the one in the
        run's recorded config (``job.save_config_file``, written by the last start that trained); without
        either the loader's own check still applies.

        Raises:
            RunFolderError: naming both values and the three ways on.
        """
        cfg = self.cfg
        if not cfg.checkpoint.enable or "dataloader" in cfg.checkpoint.exclude_from_loading:
            return
        complete = {s: p for s, p in step_folders(self.path / cfg.checkpoint.folder).items() if is_complete(p)}
        if not complete:
            return
        chosen = complete.get(cfg.checkpoint.load_step if cfg.checkpoint.load_step >= 0 else max(complete))
        recorded, saved = None, self.path / cfg.job.save_config_file
        try:
            recorded = read_marker(chosen).get("seq_len") if chosen is not None else None
        except (OSError, ValueError):
            pass
        if recorded is not None:
            saved = chosen / MARKER
        else:
            try:
                recorded = read_toml(saved, "run config").get("training", {}).get("seq_len")
            except ConfigError:
                return
        if isinstance(recorded, int) and recorded != cfg.training.seq_len:
            raise RunFolderError(
                f"{self.path} holds a run trained with training.seq_len = {recorded} ({saved}) and this start "
                f"has {cfg.training.seq_len}: its checkpoint's data position cannot carry over. Resume with "
                f"--training.seq_len={recorded}, start a new run (another --job.name), or set "
                "checkpoint.exclude_from_loading = [\"dataloader\"] to continue the weights on fresh data windows")

    def refuse_existing_run(self) -> None:
        """Refuse a fresh start into a folder that already holds a run, unless it is the same job.

        The same job is a start whose resolved config equals the folder's ``config.toml`` (an
        automatic requeue or the same command after a crash before the first complete
        checkpoint): it starts again, and the earlier attempt's metrics (JSONL rows,
        TensorBoard folder) are moved aside to ``<name>.aborted-<n>`` so they are kept but not
        mixed with the new run's. (Resumed runs drop later rows themselves: ``MetricsLogger``.)

        Raises:
            RunFolderError: the folder holds metrics rows or checkpoint folders of another config.
        """
        found = []
        if self.metrics_file.is_file() and self.metrics_file.read_text().strip():
            found.append(self.metrics_file.name)
        if step_folders(self.path / self.cfg.checkpoint.folder):
            found.append(f"{self.cfg.checkpoint.folder}/step-N")
        if not found:
            return
        saved = self.path / self.cfg.job.save_config_file
        if saved.is_file() and saved.read_text() == to_toml(self.cfg):
            self._set_aside_earlier_attempt()
            return
        why = ("no complete checkpoint to resume from" if self.cfg.checkpoint.enable
               else "checkpoint.enable = false, so nothing is resumed")
        raise RunFolderError(
            f"{self.path} already holds a run ({', '.join(found)}) of a different config than this start "
            f"({why}; the same config would start again); start a fresh run with another --job.name, or "
            f"delete or move {self.path}"
        )

    def _set_aside_earlier_attempt(self) -> None:
        n = 1
        while any(self.path.glob(f"*.aborted-{n}")):
            n += 1
        moved = []
        for path in (self.metrics_file, self.path / self.cfg.metrics.save_tb_folder):
            if path.exists():
                path.replace(path.with_name(f"{path.name}.aborted-{n}"))
                moved.append(path.name)
        logger.warning("run folder %s: same config and no complete checkpoint (an attempt that stopped before "
                       "its first checkpoint): starting again; earlier %s kept as *.aborted-%d",
                       self.path, ", ".join(moved) or "files", n)

    def save_config(self) -> None:
        """Write the resolved config to ``job.save_config_file``; a differing one from an earlier
        start of this run (a resume with changed settings) is kept as ``<stem>.prev.toml``.

        Both files are written all-or-nothing (``mhar_titan.files``): a full disk leaves the
        earlier config in place, never an empty or cut file.

        Raises:
            RunFolderError: a file cannot be written (disk full, read-only); nothing is lost.
        """
        path = self.path / self.cfg.job.save_config_file
        text = to_toml(self.cfg)
        try:
            earlier = path.read_text() if path.is_file() else None
            if earlier and earlier.strip() and earlier != text:  # an empty file is not kept over .prev
                write_text(path.with_name(f"{path.stem}.prev{path.suffix}"), earlier)
            if earlier != text:
                write_text(path, text)
        except WriteError as e:
            raise RunFolderError(f"cannot save the resolved config: {e}") from None
        if self.cfg.job.print_config:
            print(text, flush=True)
