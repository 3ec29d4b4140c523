"""Hugging Face Llama and Qwen3 folders: import into our decoder, export a ``standard`` decoder back
(as Llama, or as Qwen3 when it has per-head q/k norm).

A folder holds ``config.json`` and ``model.safetensors`` or shards with an index (see
``safetensors_io``). Import reads the config into ``ModelArgs`` (``hf_config``), builds the
model without initialising it (meta device, then uninitialised storage) and streams the
weights in shard by shard (``loading``): peak memory is the model plus one shard.
Routing parameters of a routing model built on the backbone (``residual = "attn_res"``)
are not in a Llama checkpoint; they keep their init, which is the exact identity for delta
routing (gates 0, MHAR_SPEC section 1.4).
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from mhar_titan.models.args import ModelArgs
from mhar_titan.models.model import Transformer, rope_cos_sin

from .hf_config import ConversionError, args_from_hf_config, hf_config_from_args, read_json, write_json
from .loading import _full, load_streamed
from .names import backbone_hf_name, backbone_target
from .safetensors_io import ShardedWriter

CONFIG = "config.json"
BACKBONE_FIELDS = (
    "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "norm_eps", "rope_theta", "rope_scaling",
    "rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_seq_len", "qk_norm",
    "tie_embeddings",
)
"""ModelArgs fields a Llama checkpoint fixes (the rope scaling fields only matter with rope_scaling)."""


def is_hf_folder(path: str | os.PathLike) -> bool:
    """Whether ``path`` looks like a Hugging Face model folder (a ``config.json`` inside)."""
    return (Path(path) / CONFIG).is_file()


def hf_args(folder: str | os.PathLike, **overrides) -> ModelArgs:
    """``ModelArgs`` from ``folder/config.json`` (see ``hf_config.args_from_hf_config``)."""
    return args_from_hf_config(read_json(Path(folder) / CONFIG), **overrides)


def check_backbone(folder_args: ModelArgs, model_args: ModelArgs, folder) -> None:
    """Raise ConversionError naming every backbone field on which the model differs from the
    checkpoint (e.g. a [model] flavor that is not the checkpoint's shape)."""
    diffs = []
    for name in BACKBONE_FIELDS:
        if name.startswith("rope_") and name not in ("rope_theta", "rope_scaling") and folder_args.rope_scaling is None:
            continue
        ours, theirs = getattr(model_args, name), getattr(folder_args, name)
        if ours != theirs:
            diffs.append(f"{name}: checkpoint {theirs!r}, model {ours!r}")
    if diffs:
        raise ConversionError(
            f"the model does not match the checkpoint {folder} ({Path(folder) / CONFIG}):\n  " + "\n  ".join(diffs)
            + "\nSet these [model] fields to the checkpoint's values (see mhar_titan.convert.hf_args)."
        )


def empty_model(args: ModelArgs, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> Transformer:
    """A model whose weights are uninitialised storage (to be filled by a load), with its RoPE
    tables computed and its routing parameters at their init (pseudo-queries 0, key norms 1,
    gates 0, nulls 0). No weight is written twice."""
    with torch.device("meta"):
        model = Transformer(args).to(dtype)
    model.to_empty(device=device)
    model.rope_cos, model.rope_sin = rope_cos_sin(args, device=device)
    if model.routing is not None:
        model.routing.reset_parameters()
    return model


def load_hf_weights(model: nn.Module, folder: str | os.PathLike, args: ModelArgs | None = None) -> list[str]:
    """Stream the Llama weights of ``folder`` into ``model`` (plain or FSDP2) and return the keys filled.

    ``args`` are the model's ``ModelArgs`` (default ``model.args``); the backbone fields must
    equal the checkpoint's. Routing parameters are left as they are.

    Raises:
        ConversionError: config/model mismatch, unknown or missing tensors, shape mismatch
            (all before any weight is read).
    """
    args = args if args is not None else model.args
    check_backbone(hf_args(folder), args, folder)
    return load_streamed(
        model, folder, backbone_target,
        required=lambda key: not key.startswith("routing."),
        skip=lambda name: name == "lm_head.weight" and args.tie_embeddings,
    )


def import_hf(folder: str | os.PathLike, dtype: torch.dtype = torch.float32, device="cpu", **overrides) -> Transformer:
    """The model of a Hugging Face Llama folder (its ``args`` derived from ``config.json``,
    with ``overrides``), weights streamed in. See ``load_hf_weights`` for the errors."""
    args = hf_args(folder, **overrides)
    model = empty_model(args, dtype, device)
    load_hf_weights(model, folder, args)
    return model


def export_hf(model: Transformer, folder: str | os.PathLike, dtype: torch.dtype | None = None,
              max_shard_bytes: int = 5 * 2**30) -> list[Path]:
    """Write a ``standard`` decoder as a Hugging Face Llama folder, or a Qwen3 one when it has
    q/k norm (``config.json`` and safetensors shards of at most ``max_shard_bytes``), that
    ``AutoModelForCausalLM.from_pretrained`` loads with the stock architecture. Tensors are
    gathered and written one at a time (FSDP2 shards are gathered with ``full_tensor``; call on
    every rank, only rank 0 should pass a folder it writes to).

    Raises:
        ConversionError: a routing model (use ``mhar_format.export_mhar``).
    """
    args = model.args
    if args.residual != "standard":
        raise ConversionError(
            f"a {args.residual!r} model has no stock transformers architecture; export it with "
            "mhar_titan.convert.export_mhar (our own model type, loaded with trust_remote_code=True) instead; from the "
            "command line, python -m mhar_titan.convert export ... --format mhar (or --format auto)"
        )
    out_dtype = dtype or next(model.parameters()).dtype
    config = hf_config_from_args(args, dtype=str(out_dtype).removeprefix("torch."))
    writer = ShardedWriter(folder, max_shard_bytes)
    for key, value in model.state_dict().items():
        name = backbone_hf_name(key)
        if name is None:
            raise ConversionError(f"parameter {key} has no Hugging Face Llama/Qwen3 name")
        writer.add(name, _full(value).to(out_dtype))
    paths = writer.close()
    write_json(Path(folder) / CONFIG, config)
    return paths

