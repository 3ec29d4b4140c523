"""One entry point for every pretrained folder kind, chosen by ``config.json``'s ``model_type``.

| model_type    | what it is                                        | reader / writer             |
|---------------|---------------------------------------------------|-----------------------------|
| ``llama``     | Hugging Face Llama (``standard`` decoder)         | ``hf_llama``                |
| ``mhar_titan``| any of our models, our parameter names            | ``mhar_format``             |
| ``llama_attnres`` | the MHAR authors' Llama modeling code         | ``authors``                 |
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from mhar_titan.models.model import Transformer

from . import authors
from .hf_config import ConversionError, read_json
from .hf_llama import CONFIG, export_hf, import_hf, load_hf_weights
from .mhar_format import MODEL_TYPE, export_mhar, load_mhar, load_mhar_weights

FORMATS = ("auto", "hf", "mhar", "authors")
"""Export formats: "hf" (Llama folder, standard models), "mhar" (our model type), "authors"
(the authors' names and config, routing models), "auto" (hf for standard models without
qk-norm, mhar otherwise)."""


def folder_model_type(folder: str | os.PathLike) -> str:
    """``model_type`` of ``folder/config.json`` (ConversionError when there is none)."""
    path = Path(folder) / CONFIG
    if not path.is_file():
        raise ConversionError(f"{folder} is not a pretrained model folder (no {CONFIG})")
    return str(read_json(path).get("model_type"))


def load_pretrained(folder: str | os.PathLike, dtype: torch.dtype = torch.float32, device="cpu",
                    **overrides) -> Transformer:
    """The model of a pretrained folder of any supported kind (module table), streamed in.

    ``overrides`` replace ModelArgs fields (e.g. max_seq_len; for a Llama folder also the
    routing fields of a routing model built on its backbone)."""
    kind = folder_model_type(folder)
    if kind == MODEL_TYPE:
        return load_mhar(folder, dtype, device, **overrides)
    if kind == authors.MODEL_TYPE:
        return authors.import_authors(folder, dtype, device, **overrides)
    return import_hf(folder, dtype, device, **overrides)


def load_pretrained_weights(model: Transformer, folder: str | os.PathLike, args=None) -> list[str]:
    """Stream a pretrained folder's weights into a built model (plain or FSDP2); returns the keys
    filled. A Llama folder fills the backbone and leaves routing parameters as they are."""
    kind = folder_model_type(folder)
    if kind == MODEL_TYPE:
        return load_mhar_weights(model, folder, args)
    if kind == authors.MODEL_TYPE:
        return authors.load_authors_weights(model, folder)
    return load_hf_weights(model, folder, args)


def export_pretrained(model: Transformer, folder: str | os.PathLike, fmt: str = "auto",
                      dtype: torch.dtype | None = None, max_shard_bytes: int = 5 * 2**30) -> list[Path]:
    """Write ``model`` as a pretrained folder in ``fmt`` (see ``FORMATS``); returns the shard paths."""
    if fmt not in FORMATS:
        raise ConversionError(f"unknown export format {fmt!r}; choose one of {FORMATS}")
    if fmt == "auto":
        fmt = "hf" if model.args.residual == "standard" and not model.args.qk_norm else "mhar"
    writer = {"hf": export_hf, "mhar": export_mhar, "authors": authors.export_authors}[fmt]
    return writer(model, folder, dtype, max_shard_bytes)
