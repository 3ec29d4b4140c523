"""Our own Hugging-Face-style folder for routing models (``model_type = "mhar_titan"``).

Routing models (AttnRes, MHAR, delta-MHAR) have no transformers architecture, so they are
exported as a folder that any safetensors reader can open and this package reloads:

- ``config.json``: ``{"model_type": "mhar_titan", "architectures": ["MharTitanTransformer"],
  "format_version": 1, "torch_dtype": ..., "model_args": {every ModelArgs field}}``;
- ``model.safetensors`` or shards + ``model.safetensors.index.json``, tensors named by our state
  dict keys (``tok_embeddings.weight``, ``layers.{i}.attention.wq.weight``, ``routing.query``
  (S, d), ``routing.key_norm`` (S, d), ``routing.alpha`` (S, 1), ``routing.null_source``...).

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

from .hf_config import ConversionError, read_json, write_json
from .hf_llama import CONFIG, empty_model
from .loading import _full, load_streamed
from .safetensors_io import ShardedWriter

MODEL_TYPE = "mhar_titan"
FORMAT_VERSION = 1
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
    """Write any of our models (routing or not) as a ``mhar_titan`` folder (module docstring).

    Tensors are gathered (FSDP2 ``full_tensor``) and written one shard at a time."""
    out_dtype = dtype or next(model.parameters()).dtype
    writer = ShardedWriter(folder, max_shard_bytes)
    for key, value in model.state_dict().items():
        writer.add(key, _full(value).to(out_dtype))
    paths = writer.close()
    config = {
        "model_type": MODEL_TYPE, "architectures": ["MharTitanTransformer"], "format_version": FORMAT_VERSION,
        "torch_dtype": str(out_dtype).removeprefix("torch."), "model_args": dataclasses.asdict(model.args),
    }
    write_json(Path(folder) / CONFIG, config)
    return paths


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
    return load_streamed(model, folder, lambda name: (name, None), required=lambda key: True)


def load_mhar(folder: str | os.PathLike, dtype: torch.dtype = torch.float32, device="cpu", **overrides) -> Transformer:
    """The model saved in a ``mhar_titan`` folder, weights streamed in (``overrides``: e.g.
    ``max_seq_len`` or ``routing_kernel``)."""
    args = mhar_args(folder, **overrides)
    model = empty_model(args, dtype, device)
    load_mhar_weights(model, folder, args)
    return model
