"""Distributed checkpoints (DCP) of the whole train state, with exact resume.

Layout (TorchTitan v0.2.2 pattern): ``<run_dir>/<folder>/step-N/`` holds one DCP
checkpoint (``__<rank>_0.distcp`` files plus DCP's ``.metadata``) and our marker
``complete.json``, written by rank 0 *after* DCP has finished, atomically
(temporary file + rename); it lists the folder's files. A folder without the
marker, or missing a file it lists, is incomplete (a save that was killed or is
still in flight, a deletion cut short): it is never loaded, and ``load()`` warns
naming it. Retention deletes a folder's marker before its files. A save that fails (disk
full, any OS error) removes what it wrote and raises ``CheckpointSaveError``; a state holding
NaN or infinity is never saved (``guards``), so the newest complete checkpoint is always one
to resume from.

What one checkpoint holds (DCP keys):

==================  ==========================================================
``model.*``         model state dict from ``get_state_dict``: sharded DTensors
                    under FSDP2, keys of the plain model (no ``_orig_mod`` from
                    ``torch.compile``, no ``_checkpoint_wrapped_module`` from
                    activation checkpointing)
``optimizer.*``     optimizer state keyed by parameter FQN, sharded like the model
``lr_scheduler``    ``lr_scheduler.state_dict()`` (same on every rank)
``train_state``     ``train_state.state_dict()``: step, tokens seen, logger run ids
``dataloader.rank_R``  each rank's ``dataloader.state_dict()``
``rng.rank_R``      each rank's python, numpy, torch CPU (and CUDA) RNG states
``ema.*``           the weight EMA's averages (``training.ema_decay > 0``), keyed and
                    sharded like the model; a model-only last save holds the EMA
==================  ==========================================================

``initial_load_path`` may also name a pretrained folder with a ``config.json`` (Hugging
Face Llama, ``mhar_titan`` or the authors' format): the ``pretrained_loader`` the caller
passes (``mhar_titan.convert.load_pretrained_weights``) streams its weights into the built
model (a Llama backbone under a routing model leaves the routing parameters at their init:
the delta identity).

Non-tensor values are stored as ``torch.save`` bytes of plain data, one DCP byte
item each, and read back with ``weights_only=True`` (no code runs from a checkpoint).
Model and optimizer tensors reshard on load, so a checkpoint saved at world
size W loads at any other world size; per-rank items (data position, RNG) are
matched by rank, see ``CheckpointManager.load``.

``complete.json`` also records the step, the world size and the run's
*fingerprint* (model arguments, tokenizer name...). ``load()`` compares the
fingerprint and every requested key and shape against the checkpoint *before*
reading any tensor, and raises ``CheckpointMismatchError`` naming the first
differences; nothing in memory or on disk is changed in that case. Those checks
live in ``checks`` and ``fingerprint``, the folder layout in ``layout``, the encoding of
non-tensor items in ``items`` and the ``[checkpoint]`` settings in ``config``
(modules of this package).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from mhar_titan.checkpoint.checks import (check_keys, check_no_newer, check_optimizer, optimizer_kind,
                                         unreadable_error)
from mhar_titan.config.checkpoint import COMPONENTS, CheckpointConfig, CheckpointError
from mhar_titan.checkpoint.fingerprint import check_fingerprint, json_safe
from mhar_titan.checkpoint.guards import (CheckpointSaveError, nonfinite_entries, nonfinite_error, save_failure,
                                         space_warning, state_bytes)
from mhar_titan.checkpoint.items import cast_floats, decode, encode, rng_state, set_rng_state
from mhar_titan.checkpoint.layout import (
    MARKER, apply_retention, incomplete_reason, is_complete, read_marker, step_folders,
)
from mhar_titan.errors import UserError
from mhar_titan.files import write_text

logger = logging.getLogger(__name__)


@contextmanager
def _quiet_single_process():
    """DCP warns on every call without a process group; one process is a supported case here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _flatten(tree: dict) -> dict:
    """DCP's own flattening, so keys compare equal to the checkpoint's metadata keys."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    return flatten_state_dict(tree)[0]


# --------------------------------------------------------------------------- before the build

_EXCLUDE_HINT = "load the rest without it: --checkpoint.exclude_from_loading='[\"optimizer\"]'"
_MODEL_ONLY_HINT = "load the model only: --checkpoint.initial_load_model_only=true"


def _optimizer_source(cfg: CheckpointConfig, run_dir: Path) -> Optional[tuple[Path, str]]:
    """The DCP folder whose optimizer state ``CheckpointManager.load`` would restore, with the hint
    for loading without it; None when no optimizer state would be loaded."""
    if "optimizer" in cfg.exclude_from_loading:
        return None
    if cfg.enable:
        folders = {s: p for s, p in step_folders(run_dir / cfg.folder).items() if is_complete(p)}
        if cfg.load_step >= 0:
            chosen = folders.get(cfg.load_step)
        else:
            chosen = folders[max(folders)] if folders else None
        if chosen is not None:
            return None if read_marker(chosen).get("model_only") else (chosen, _EXCLUDE_HINT)
    path = Path(cfg.initial_load_path) if cfg.initial_load_path else None
    if path is None or cfg.initial_load_model_only or not (path / ".metadata").is_file():
        return None
    if (path / MARKER).is_file() and read_marker(path).get("model_only"):
        return None
    return path, _MODEL_ONLY_HINT


def refuse_optimizer_switch(cfg: CheckpointConfig, run_dir: str | os.PathLike, optimizer_name: str) -> None:
    """Refuse, before the model is built, a start that would load optimizer state saved by another
    optimizer (``optimizer.name``): the resumed run folder's checkpoint, or ``initial_load_path`` with
    ``initial_load_model_only = false``. Reads only the DCP metadata (no tensor); a checkpoint that
    cannot be read is left to ``CheckpointManager.load`` to report.

    Raises:
        CheckpointMismatchError: naming the folder, both optimizers and how to load without the state.
    """
    try:
        source = _optimizer_source(cfg, Path(run_dir))
        if source is None:
            return
        metadata = dcp.FileSystemReader(str(source[0])).read_metadata()
    except (Exception, CheckpointException):  # noqa: BLE001 - load() names an unreadable checkpoint
        return
    check_optimizer(source[0], optimizer_kind(metadata.state_dict_metadata), optimizer_name, source[1])


# --------------------------------------------------------------------------- manager


class CheckpointManager:
    """Saves and restores the train state with DCP; see the module docstring for the layout.

    Args:
        cfg: the ``[checkpoint]`` section.
        run_dir: the run folder; checkpoints go to ``run_dir / cfg.folder``.
        model: the model (plain, FSDP2-sharded, per-block compiled and/or
            activation-checkpointed; keys are always the plain model's).
        optimizer, lr_scheduler, dataloader, train_state: objects with
            ``state_dict()`` / ``load_state_dict()``; None ones are skipped.
        fingerprint: JSON-able dict describing what must match on resume (model
            args, tokenizer name); compared on every load.
        storage_writer_factory: ``path -> StorageWriter`` for DCP; default
            ``FileSystemWriter(path)``. Tests pass slow or blocking writers.
        ema: the weight EMA (``state_dict()`` / ``load_state_dict()`` keyed like the model) or None.
        pretrained_loader: ``(model, folder) -> Any`` that streams a pretrained folder's weights
            into ``model`` (the trainer passes ``mhar_titan.convert.load_pretrained_weights``);
            needed when ``initial_load_path`` names a folder with a ``config.json``.

    Raises:
        CheckpointError: invalid ``[checkpoint]`` settings.
    """

    def __init__(
        self,
        cfg: CheckpointConfig,
        run_dir: str | os.PathLike,
        *,
        model: torch.nn.Module,
        optimizer: Optional[torch.optim.Optimizer] = None,
        lr_scheduler: Any = None,
        dataloader: Any = None,
        train_state: Any = None,
        fingerprint: Optional[dict] = None,
        storage_writer_factory: Optional[Callable[[str], Any]] = None,
        ema: Any = None,
        pretrained_loader: Optional[Callable[[torch.nn.Module, Path], Any]] = None,
    ) -> None:
        cfg.validate()
        self.cfg = cfg
        self.folder = Path(run_dir) / cfg.folder
        self.model = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.dataloader = dataloader
        self.train_state = train_state
        self.ema = ema
        self.pretrained_loader = pretrained_loader
        self.fingerprint = json_safe(fingerprint or {})
        self._writer_factory = storage_writer_factory or (lambda path: dcp.FileSystemWriter(path))
        self.rank, self.world_size = _rank_world()
        self._distributed = dist.is_available() and dist.is_initialized()
        self._last_saved_step: Optional[int] = None
        self._in_flight: Optional[tuple[int, Path, bool, Any, float, int]] = None
        self._space_checked = False  # the free-space warning runs before the first save
        # Async saves run their collectives in a background thread: they need their own
        # (gloo) group so they never interleave with FSDP's collectives on the default one.
        self._async_group = None
        if cfg.enable and cfg.async_mode == "async" and self._distributed:
            self._async_group = dist.new_group(backend="gloo")

    # ------------------------------------------------------------------ saving

    def save(self, step: int, *, last: bool = False, force: bool = False) -> bool:
        """Save the train state after ``step`` when it is due; return whether a save started.

        Due when ``force`` (preemption), ``last`` (final step) or ``step`` is a multiple of
        ``interval``. A step already saved is not saved again. The last and forced saves
        are synchronous; others are async when ``async_mode = "async"``. Call on every rank.
        Before the first save, rank 0 warns when the free space cannot hold the checkpoints
        retention keeps plus this one (``guards.space_warning``).

        Raises:
            CheckpointSaveError: on every rank, when the model, optimizer or EMA state holds NaN or
                infinity (nothing is written), or when the write failed on an OS error (disk full,
                read-only folder; for an async save: at the next save or ``close()``): the message
                names the folder, the error and the bytes needed; the partly written folder is
                removed and the last complete checkpoint stays the newest.
        """
        if not self.cfg.enable:
            return False
        self._poll_async()
        due = force or last or (self.cfg.interval > 0 and step % self.cfg.interval == 0)
        if not due or step == self._last_saved_step:
            return False
        self._wait_async()
        model_only = last and self.cfg.last_save_model_only
        path = self.folder / f"step-{step}"
        state = self._state_for_save(model_only)
        self._refuse_nonfinite(state, path)
        size = state_bytes(state) * self.world_size
        if not self._space_checked and self.rank == 0:
            self._space_checked = True
            complete = sum(1 for p in step_folders(self.folder).values() if is_complete(p))
            warning = space_warning(self.folder, size, self.cfg.keep_latest_k, complete)
            if warning:
                logger.warning(warning)
        self._clear_folder(path)
        writer = self._writer_factory(str(path))
        started = time.perf_counter()
        try:
            if self.cfg.async_mode == "async" and not (last or force):
                with _quiet_single_process():
                    response = dcp.async_save(
                        state, checkpoint_id=str(path), storage_writer=writer, process_group=self._async_group,
                        no_dist=not self._distributed,
                    )
                future = getattr(response, "upload_completion", response)
                self._in_flight = (step, path, model_only, future, started, size)
                if self.rank == 0:
                    logger.info("checkpoint step-%d: async save started (staging took %.2f s)", step,
                                time.perf_counter() - started)
            else:
                with _quiet_single_process():
                    dcp.save(state, checkpoint_id=str(path), storage_writer=writer, no_dist=not self._distributed)
                self._finish(step, path, model_only, started)
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            self._failed(e, path, size)
        self._last_saved_step = step
        return True

    @property
    def last_saved(self) -> Optional[Path]:
        """The ``step-N`` folder of the newest save of this run (or the checkpoint it resumed
        from); None when nothing was saved or loaded."""
        return None if self._last_saved_step is None else self.folder / f"step-{self._last_saved_step}"

    def close(self) -> None:
        """Wait for an in-flight async save and mark it complete.

        Raises:
            CheckpointSaveError: that save failed (see ``save``).
        """
        self._wait_async()

    def _refuse_nonfinite(self, state: dict, path: Path) -> None:
        """Raise ``CheckpointSaveError`` on every rank when any rank's state holds NaN or infinity."""
        names = nonfinite_entries(state)
        count = len(names)
        if self._distributed:
            device = next(self.model.parameters()).device
            total = torch.tensor([count], device=device)
            dist.all_reduce(total)
            count = int(total.item())
        if count:
            complete = [s for s, p in step_folders(self.folder).items() if is_complete(p)]
            newest = self.folder / f"step-{max(complete)}" if complete else None
            raise nonfinite_error(path, names, count, newest)

    def _failed(self, e: BaseException, path: Path, size: int) -> None:
        """A save of ``path`` failed with ``e``: remove what it wrote (rank 0) and raise the
        ``CheckpointSaveError`` for an OS error (disk full...), else ``e`` itself."""
        error = save_failure(e, path, size)
        if self.rank == 0:
            shutil.rmtree(path, ignore_errors=True)
            logger.error("checkpoint %s: save failed, removed the partly written folder", path)
        if error is None:
            raise e
        raise error from None

    def _state_for_save(self, model_only: bool) -> dict:
        if model_only:  # the export: the weight EMA when the run keeps one
            weights = self.ema.state_dict() if self.ema is not None else get_model_state_dict(self.model)
            return {"model": cast_floats(weights, self.cfg.export_dtype)}
        if self.optimizer is not None:
            model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
            state = {"model": model_sd, "optimizer": optim_sd}
        else:
            state = {"model": get_model_state_dict(self.model)}
        for name in ("lr_scheduler", "train_state"):
            obj = getattr(self, name)
            if obj is not None:
                state[name] = encode(obj.state_dict())
        if self.dataloader is not None:
            state["dataloader"] = {f"rank_{self.rank}": encode(self.dataloader.state_dict())}
        state["rng"] = {f"rank_{self.rank}": encode(rng_state())}
        if self.ema is not None:
            state["ema"] = self.ema.state_dict()
        return state

    def _clear_folder(self, path: Path) -> None:
        """Remove a leftover folder of the same step (an incomplete save) before writing.

        Raises:
            CheckpointSaveError: on every rank, when ``path`` is a file (not the trainer's: it is
                left alone, and the last complete checkpoint stays the newest).
        """
        if path.exists() and not path.is_dir():
            raise CheckpointSaveError(f"checkpoint {path} could not be saved: a file of that name is in the checkpoint "
                                      "folder (not a checkpoint; left as it is); move it away and relaunch: the run "
                                      "resumes from its last complete checkpoint")
        if self.rank == 0 and path.exists():
            if is_complete(path):
                logger.warning("checkpoint %s exists and is replaced by a new save of that step", path)
            else:
                logger.warning("removing incomplete checkpoint folder %s before saving that step again", path)
            shutil.rmtree(path)
        if self._distributed:
            dist.barrier()

    def _finish(self, step: int, path: Path, model_only: bool, started: float) -> None:
        """Rank 0: write the marker (everything else is on disk by now), then apply retention."""
        if self.rank != 0:
            return
        marker = {
            "step": step,
            "model_only": model_only,
            "dtype": self.cfg.export_dtype if model_only else None,
            "world_size": self.world_size,
            "fingerprint": self.fingerprint,
            "seq_len": (getattr(self.dataloader, "layout", None) or {}).get("seq_len"),  # of its data position
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "files": sorted(p.name for p in path.iterdir() if p.is_file()),
        }
        write_text(path / MARKER, json.dumps(marker, indent=1))  # atomic: the marker is whole or absent
        logger.info("checkpoint step-%d saved to %s in %.2f s%s", step, path, time.perf_counter() - started,
                    " (model only)" if model_only else "")
        for doomed in apply_retention(self.folder, self.cfg.keep_latest_k):
            logger.info("checkpoint retention: deleted %s", doomed)

    def _poll_async(self) -> None:
        if self._in_flight is not None and self._in_flight[3].done():
            self._wait_async()

    def _wait_async(self) -> None:
        if self._in_flight is None:
            return
        step, path, model_only, future, started, size = self._in_flight
        self._in_flight = None
        try:
            future.result()  # re-raises a failed save
            self._finish(step, path, model_only, started)
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            self._failed(e, path, size)

    # ------------------------------------------------------------------ loading

    def load(self) -> int:
        """Restore the train state; return the step to continue after (0: fresh start).

        Picks ``step-<load_step>`` or, with ``load_step = -1``, the newest complete
        checkpoint, warning about every incomplete folder it skips. With none, loads
        ``initial_load_path`` if set. Per-rank parts (data position, RNG) come from the
        same rank of the saved run; a rank the saved run did not have gets rank 0's data
        state (the loader decides whether it can continue at the new world size) and keeps
        its fresh RNG. Call on every rank.

        Raises:
            CheckpointError: ``load_step`` names a missing, incomplete or model-only checkpoint,
                or one older than the newest complete checkpoint; or a non-tensor item is not
                plain data (a pickle that could run code); or the chosen checkpoint's files cannot
                be read (truncated or corrupted): the message names the folder and the previous
                complete step to fall back to, and nothing is deleted.
            CheckpointMismatchError: fingerprint, keys or shapes differ; nothing is loaded.
        """
        if not self.cfg.enable:  # nothing saved here to resume; an initial checkpoint still loads
            return self._load_initial() if self.cfg.initial_load_path else 0
        path = self._choose_checkpoint()
        if path is not None:
            marker = read_marker(path)
            if marker.get("model_only"):
                raise CheckpointError(
                    f"{path} is a model-only export (checkpoint.last_save_model_only) and cannot be resumed "
                    f"from; load its weights with checkpoint.initial_load_path={path} instead"
                )
            parts = [p for p in COMPONENTS if p not in self.cfg.exclude_from_loading]
            self._load_from(path, parts, marker)
            self._last_saved_step = marker["step"]
            return int(marker["step"])
        if self.cfg.initial_load_path:
            return self._load_initial()
        return 0

    def _load_initial(self) -> int:
        """Load ``checkpoint.initial_load_path``: a pretrained folder, or a DCP checkpoint (model only
        unless ``initial_load_model_only`` is false). Returns the step to continue after."""
        path = Path(self.cfg.initial_load_path)
        if (path / "config.json").is_file() and not (path / ".metadata").is_file():
            # a pretrained folder (Hugging Face Llama, mhar_titan, the authors'): streamed into the model
            if self.pretrained_loader is None:
                raise CheckpointError(f"checkpoint.initial_load_path={path} is a pretrained folder (config.json), "
                                      "and this CheckpointManager was given no pretrained_loader")
            try:
                self.pretrained_loader(self.model, path)
            except UserError as e:
                raise CheckpointError(f"checkpoint.initial_load_path={path}: {e}") from None
            return 0
        if not path.is_dir():
            raise CheckpointError(f"checkpoint.initial_load_path={path} does not exist (or is not a folder); "
                                  "point it at a checkpoints/step-N folder or a pretrained model folder")
        if not (path / ".metadata").is_file():
            raise CheckpointError(
                f"checkpoint.initial_load_path={path} is not a DCP checkpoint folder (no .metadata)"
            )
        if (path / MARKER).is_file():
            marker = read_marker(path)
        else:
            marker = {"step": 0, "model_only": True}
        model_only = self.cfg.initial_load_model_only or marker.get("model_only", False)
        parts = ["model"] if model_only else [p for p in COMPONENTS if p not in self.cfg.exclude_from_loading]
        self._load_from(path, parts, marker)
        return 0 if model_only else int(marker["step"])

    def _choose_checkpoint(self) -> Optional[Path]:
        """Rank 0 picks the folder and tells the others, so every rank loads the same one."""
        choice: list = [None]
        if self.rank == 0:
            choice[0] = self._choose_on_rank0()
        if self._distributed:
            dist.broadcast_object_list(choice, src=0)
        if isinstance(choice[0], Exception):
            raise choice[0]
        return None if choice[0] is None else Path(choice[0])

    def _choose_on_rank0(self) -> Any:
        folders = step_folders(self.folder)
        wanted = self.cfg.load_step
        if wanted >= 0:
            if wanted not in folders or not is_complete(folders[wanted]):
                state = "incomplete" if wanted in folders else "missing"
                complete = sorted(s for s, p in folders.items() if is_complete(p))
                return CheckpointError(
                    f"checkpoint.load_step={wanted}: {self.folder / f'step-{wanted}'} is {state}; "
                    f"complete checkpoints: {complete or 'none'}"
                )
            try:
                check_no_newer(self.folder, wanted, sorted(s for s, p in folders.items() if is_complete(p)))
            except CheckpointError as e:
                return e
            return str(folders[wanted])
        for step in sorted(folders, reverse=True):
            if is_complete(folders[step]):
                return str(folders[step])
            logger.warning("skipping incomplete checkpoint folder %s (%s)", folders[step],
                           incomplete_reason(folders[step]))
        return None

    def _load_from(self, path: Path, parts: list[str], marker: dict) -> None:
        started = time.perf_counter()
        try:
            metadata = dcp.FileSystemReader(str(path)).read_metadata()
        except (Exception, CheckpointException) as e:  # noqa: BLE001
            raise unreadable_error(self.folder, path, e) from None
        if "fingerprint" in marker:
            check_fingerprint(path, marker["fingerprint"], self.fingerprint)
        state = self._state_for_load(parts, metadata, int(marker.get("world_size", 1)))
        requested = _flatten(state)
        if "optimizer" in state:
            hint = _EXCLUDE_HINT if path.parent == self.folder else _MODEL_ONLY_HINT
            check_optimizer(path, optimizer_kind(metadata.state_dict_metadata), optimizer_kind(requested), hint)
        check_keys(path, requested, metadata, has_model="model" in state)

        try:
            with _quiet_single_process():
                dcp.load(state, checkpoint_id=str(path), no_dist=not self._distributed)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - CheckpointException is a BaseException
            raise unreadable_error(self.folder, path, e) from None

        # decode every object before restoring any: an unsafe item stops the load here
        objects = {name: decode(state[name], name, path) for name in ("lr_scheduler", "train_state") if name in state}
        for name in ("dataloader", "rng"):
            if name in state:
                ((rank_key, blob),) = state[name].items()
                objects[name] = decode(blob, f"{name}.{rank_key}", path)

        if "optimizer" in state:
            set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optimizer"])
        elif "model" in state:
            set_model_state_dict(self.model, state["model"])
        if "lr_scheduler" in objects:
            self.lr_scheduler.load_state_dict(objects["lr_scheduler"])
        if "train_state" in objects:
            self.train_state.load_state_dict(objects["train_state"])
        if "dataloader" in objects:
            self.dataloader.load_state_dict(objects["dataloader"])
        if "rng" in objects:
            set_rng_state(objects["rng"])
        if "ema" in state:
            self.ema.load_state_dict(state["ema"])
        if self.rank == 0:
            logger.info("loaded checkpoint %s (%s) in %.2f s", path, ", ".join(sorted(state)),
                        time.perf_counter() - started)

    def _state_for_load(self, parts: list[str], metadata: Metadata, saved_world: int) -> dict:
        """Placeholders shaped like the current run; DCP fills them in place."""
        saved = metadata.state_dict_metadata
        state: dict = {}
        if "model" in parts and "optimizer" in parts and self.optimizer is not None:
            state["model"], state["optimizer"] = get_state_dict(self.model, self.optimizer)
        elif "model" in parts:
            state["model"] = get_model_state_dict(self.model)
        for name in ("lr_scheduler", "train_state"):
            if name in parts and getattr(self, name) is not None:
                state[name] = b""
        if "dataloader" in parts and self.dataloader is not None:
            source = self.rank if self.rank < saved_world else 0
            if f"dataloader.rank_{source}" in saved:
                state["dataloader"] = {f"rank_{source}": b""}
            else:
                state["dataloader"] = {f"rank_{self.rank}": b""}  # reported as missing by _check_keys
        if "rng" in parts:
            if f"rng.rank_{self.rank}" in saved:
                state["rng"] = {f"rank_{self.rank}": b""}
            elif self.rank == 0:
                logger.info("checkpoint has no RNG state for rank %d: keeping this run's seed", self.rank)
        if "ema" in parts and self.ema is not None:
            if any(key.startswith("ema.") for key in saved):
                state["ema"] = self.ema.state_dict()
            elif self.rank == 0:
                logger.info("checkpoint has no weight EMA: the average starts at the loaded weights")
        return state
