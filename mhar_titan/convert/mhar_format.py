"""Our own Hugging-Face-style folder for routing models (``model_type = "mhar_titan"``).

Routing models (AttnRes, MHAR, delta-MHAR) have no stock transformers architecture, so they are
exported as a folder that transformers loads with ``trust_remote_code=True`` (through the
classes of ``hf_remote``, which wrap this package's model), any safetensors reader opens, and
this package reloads:

- ``config.json``: ``{"model_type": "mhar_titan", "architectures": ["MharTitanForCausalLM"],
  "auto_map": {AutoConfig, AutoModelForCausalLM -> the two files below}, "format_version": 2,
  "torch_dtype": ..., "model_args": {every ModelArgs field}}``;
- ``configuration_mhar_titan.py`` and ``modeling_mhar_titan.py`` (``REMOTE_FILES``): one import
  each, from the installed package;
- ``model.safetensors`` or shards + ``model.safetensors.index.json``, tensors named by our state
  dict keys under ``model.`` (``model.tok_embeddings.weight``, ``model.layers.{i}.attention.wq.weight``,
  ``model.routing.query`` (S, d), ``model.routing.key_norm`` (S, d), ``model.routing.alpha``
  (S, 1), ``model.routing.null_source``, ``model.routing.log_temperature`` (S, H) with a learned
  routing temperature...; ``model_args`` carries ``routing_logit_scale`` and
  ``routing_temperature``, and the remote code runs this package's forward, so the folder routes
  with the trained temperatures). Format version 1 (no ``auto_map``) stored the keys
  without the prefix; it still loads here.

Reload with ``load_mhar(folder)`` (a ``Transformer`` with the saved arguments) or
``python -m mhar_titan.convert import FOLDER OUT`` (a DCP checkpoint for training).
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

from mhar_titan.models.args import WEIGHT_NEUTRAL_FIELDS, ModelArgs
from mhar_titan.models.model import Transformer

from mhar_titan.files import write_text

from .hf_config import ConversionError, read_json, write_json
from .hf_llama import CONFIG, empty_model
from .loading import _full, load_streamed
from .safetensors_io import ShardedWriter

MODEL_TYPE = "mhar_titan"
FORMAT_VERSION = 2
PREFIX = "model."
"""Tensor names of format 2 are the state dict keys of ``MharTitanForCausalLM``: ours under ``model.``."""
REMOTE_FILES = {
    "configuration_mhar_titan.py": (
        '"""Configuration of an exported mhar-titan model (needs the mhar-titan package: pip install '
        '\'mhar-titan[hf]\')."""\nfrom mhar_titan.convert.hf_remote import MharTitanConfig\n\n'
        '__all__ = ["MharTitanConfig"]\n'),
    "modeling_mhar_titan.py": (
        '"""An exported mhar-titan model: this package\'s Transformer behind transformers\' interface '
        '(needs the mhar-titan package: pip install \'mhar-titan[hf]\')."""\n'
        'from mhar_titan.convert.hf_remote import MharTitanConfig, MharTitanForCausalLM\n\n'
        '__all__ = ["MharTitanConfig", "MharTitanForCausalLM"]\n'),
}
AUTO_MAP = {"AutoConfig": "configuration_mhar_titan.MharTitanConfig",
            "AutoModelForCausalLM": "modeling_mhar_titan.MharTitanForCausalLM"}


def mhar_args(folder: str | os.PathLike, **overrides) -> ModelArgs:
    """The ``ModelArgs`` saved in ``folder/config.json``, with ``overrides``.

    Raises:
        ConversionError: not a ``mhar_titan`` folder, a newer format, or arguments ModelArgs rejects.
    """
    config = read_json(Path(folder) / CONFIG)
    if config.get("model_type") != MODEL_TYPE:
        raise ConversionError(f"{Path(folder) / CONFIG} has model_type={config.get('model_type')!r}, "
                              f"not {MODEL_TYPE!r}")
    if config.get("format_version", 0) > FORMAT_VERSION:
        raise ConversionError(f"{folder} uses format_version {config['format_version']}; this package reads "
                              f"up to {FORMAT_VERSION}: update mhar-titan")
    known = {f.name for f in dataclasses.fields(ModelArgs)}
    unknown = sorted(set(config["model_args"]) - known)
    if unknown:
        raise ConversionError(f"{folder}: model_args has field(s) {unknown} this version does not know")
    try:
        return ModelArgs(**{**config["model_args"], **overrides})
    except (TypeError, ValueError) as e:
        raise ConversionError(f"{folder}: invalid model_args: {e}") from None


def export_mhar(model: Transformer, folder: str | os.PathLike, dtype: torch.dtype | None = None,
                max_shard_bytes: int = 5 * 2**30) -> list[Path]:
    """Write any of our models (routing or not) as a ``mhar_titan`` folder (module docstring),
    with the two files that let transformers load it (``trust_remote_code=True``).

    Tensors are gathered (FSDP2 ``full_tensor``) and written one shard at a time."""
    out_dtype = dtype or next(model.parameters()).dtype
    writer = ShardedWriter(folder, max_shard_bytes)
    for key, value in model.state_dict().items():
        writer.add(PREFIX + key, _full(value).to(out_dtype))
    paths = writer.close()
    config = {
        "model_type": MODEL_TYPE, "architectures": ["MharTitanForCausalLM"], "auto_map": AUTO_MAP,
        "format_version": FORMAT_VERSION, "torch_dtype": str(out_dtype).removeprefix("torch."),
        "model_args": dataclasses.asdict(model.args),
    }
    write_json(Path(folder) / CONFIG, config)
    write_remote_files(folder)
    return paths


def write_remote_files(folder: str | os.PathLike) -> None:
    """Write the two files of ``REMOTE_FILES`` into ``folder`` and name them in ``config.json``'s
    ``auto_map`` (``AUTO_MAP``): what makes a folder load with ``trust_remote_code=True``, written by
    the export and again by ``MharTitanForCausalLM.save_pretrained``."""
    for name, text in REMOTE_FILES.items():
        write_text(Path(folder) / name, text)
    config = read_json(Path(folder) / CONFIG)
    if config.get("auto_map") != AUTO_MAP:
        write_json(Path(folder) / CONFIG, {**config, "auto_map": AUTO_MAP})


def load_mhar_weights(model, folder: str | os.PathLike, args: ModelArgs | None = None) -> list[str]:
    """Stream a ``mhar_titan`` folder into a built model (plain or FSDP2); every tensor is required.

    Raises:
        ConversionError: the saved arguments differ from the model's in a field that shapes or
            defines the weights (anything but ``WEIGHT_NEUTRAL_FIELDS``), or tensors do not fit.
    """
    args = args if args is not None else model.args
    saved = dataclasses.asdict(mhar_args(folder))
    ours = dataclasses.asdict(args)
    diffs = [f"{k}: folder {saved[k]!r}, model {ours[k]!r}" for k in saved
             if k not in WEIGHT_NEUTRAL_FIELDS and saved[k] != ours[k]]
    if diffs:
        raise ConversionError(f"{folder} was saved from a different model:\n  " + "\n  ".join(diffs))
    prefix = PREFIX if read_json(Path(folder) / CONFIG).get("format_version", 1) >= 2 else ""
    return load_streamed(model, folder, lambda name: (name.removeprefix(prefix), None) if name.startswith(prefix)
                         else None, required=lambda key: True)


def load_mhar(folder: str | os.PathLike, dtype: torch.dtype = torch.float32, device="cpu", **overrides) -> Transformer:
    """The model saved in a ``mhar_titan`` folder, weights streamed in (``overrides``: e.g.
    ``max_seq_len`` or ``routing_kernel``)."""
    args = mhar_args(folder, **overrides)
    model = empty_model(args, dtype, device)
    load_mhar_weights(model, folder, args)
    return model
