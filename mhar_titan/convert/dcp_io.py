"""Model-only DCP checkpoints written and read by the conversion commands.

A converted model is saved like the trainer's model-only last save (``checkpoint.py``): one
DCP checkpoint with the ``model.*`` keys and a ``complete.json`` marker
(``model_only = true``, step 0), so it loads through ``checkpoint.initial_load_path``. The
marker also records the ``ModelArgs`` (under ``model_args``; the trainer's markers hold them
under ``fingerprint.model_args``) so the export command can rebuild the model.
"""
from __future__ import annotations

import dataclasses
import os
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from mhar_titan.checkpoint import MARKER
from mhar_titan.checkpoint.checks import unreadable_error
from mhar_titan.checkpoint.layout import step_folders
from mhar_titan.models.args import ModelArgs

from .hf_config import ConversionError, read_json, write_json
from .hf_llama import empty_model


def save_model_dcp(model, path: str | os.PathLike, **marker_extra) -> Path:
    """Save ``model``'s weights as a model-only DCP checkpoint at ``path`` (a new folder);
    tensors are written in the model's dtype. Returns the folder.

    Raises:
        ConversionError: ``path`` exists and is not empty.
    """
    path = Path(path)
    if path.exists() and any(path.iterdir()):
        raise ConversionError(f"{path} exists and is not empty; choose a new folder for the checkpoint")
    path.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=str(path), no_dist=True)
    dtype = next(model.parameters()).dtype
    marker = {
        "step": 0, "model_only": True, "dtype": str(dtype).removeprefix("torch."), "world_size": 1,
        "model_args": dataclasses.asdict(model.args), "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **marker_extra,
    }
    write_json(path / MARKER, marker, indent=1)
    return path


def dcp_model_args(path: str | os.PathLike, **overrides) -> ModelArgs:
    """The ``ModelArgs`` recorded in a checkpoint's marker (a converted model's ``model_args``
    or a training checkpoint's ``fingerprint.model_args``), with ``overrides``.

    Raises:
        ConversionError: no marker, or a marker without model arguments.
    """
    path = Path(path)
    if not (path / MARKER).is_file() and (path / "checkpoints").is_dir():
        steps = step_folders(path / "checkpoints")
        hint = f" (the newest: {steps[max(steps)]})" if steps else ""
        raise ConversionError(f"{path} is a run folder, not a checkpoint: pass one of its "
                              f"checkpoints/step-N folders{hint}")
    marker = read_json(path / MARKER)
    fields = marker.get("model_args") or marker.get("fingerprint", {}).get("model_args")
    if not fields:
        raise ConversionError(f"{Path(path) / MARKER} records no model arguments; cannot rebuild the model")
    known = {f.name for f in dataclasses.fields(ModelArgs)}
    return ModelArgs(**{**{k: v for k, v in fields.items() if k in known}, **overrides})


def load_model_dcp(path: str | os.PathLike, dtype: torch.dtype = torch.float32, ema: bool = True, **overrides):
    """Rebuild the model of a DCP checkpoint (args from its marker) and load its weights: the
    weight EMA (``ema.*`` keys, written when training.ema_decay > 0) when the checkpoint has one
    and ``ema`` is True, the trained weights otherwise.

    Raises:
        ConversionError: no marker, or a marker without model arguments.
        CheckpointError: the checkpoint's files cannot be read (truncated or corrupted); names the
            folder and the way out, deletes nothing.
    """
    model = empty_model(dcp_model_args(path, **overrides), dtype)
    folder = Path(path)
    try:
        saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        part = "ema" if ema and any(key.startswith("ema.") for key in saved) else "model"
        state = {part: get_model_state_dict(model)}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=str(path), no_dist=True)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - CheckpointException is a BaseException
        raise unreadable_error(folder.parent, folder, e, reader=True) from None
    return model
