"""Checkpoints of the MHAR authors' Llama modeling code (``model_type = "llama_attnres"``).

Their ``LlamaAttnResForCausalLM`` keeps the Llama backbone names (``names.py``) and adds, per
layer i, one set of routing tensors per sublayer site (``attn`` = our site 2i, ``mlp`` = 2i+1):

=================================================  ==============================  ==========
theirs                                             ours                            shape
=================================================  ==============================  ==========
``model.layers.{i}.{attn,mlp}_res_proj.weight``    ``routing.query`` row           (1, d)
``model.layers.{i}.{attn,mlp}_res_norm.weight``    ``routing.key_norm`` row        (d,)
``model.layers.{i}.{attn,mlp}_res_alpha``          ``routing.alpha`` row           (1,) or ()
``model.layers.{i}.{attn,mlp}_null_source``        ``routing.null_source`` row     (d,)
``model.final_res_proj.weight`` (replace modes)    ``routing.query`` row 2L        (1, d)
``model.final_res_norm.weight`` (replace modes)    ``routing.key_norm`` row 2L     (d,)
=================================================  ==============================  ==========

Their ``attnres_mode`` picks our residual path (``AUTHORS_MODES``): the delta modes map to the
paper layout (per-sublayer nulls, no final site, their timing and block sources, routing eps =
``rms_norm_eps``; plan.py), the replacement modes to the clean layout with a final site. Their
key norms use ``rms_norm_eps``, so every import sets ``routing_eps = norm_eps``. Export writes
gates with shape (1,) (what their Llama code creates).
"""
from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Optional

import torch

from mhar_titan.models.args import ModelArgs
from mhar_titan.models.model import Transformer

from .hf_config import ConversionError, args_from_hf_config, hf_config_from_args, read_json, write_json
from .hf_llama import CONFIG, empty_model
from .loading import _full, load_streamed
from .names import Target, backbone_hf_name, backbone_target
from .safetensors_io import ShardedWriter

MODEL_TYPE = "llama_attnres"
AUTHORS_MODES = {
    "delta_mh": dict(routing_mode="delta", routing_granularity="block", routing_layout="paper"),
    "delta": dict(routing_mode="delta", routing_granularity="sublayer", routing_layout="paper", routing_heads=1),
    "full": dict(routing_mode="replace", routing_granularity="sublayer", routing_heads=1),
    "full_mh": dict(routing_mode="replace", routing_granularity="sublayer"),
    "block": dict(routing_mode="replace", routing_granularity="block", routing_heads=1),
    "block_mh": dict(routing_mode="replace", routing_granularity="block"),
}
"""Their ``attnres_mode`` values this package reads, as ModelArgs fields (heads from
``attnres_num_heads`` unless fixed to 1 here)."""

_SITE = re.compile(r"^model\.layers\.(\d+)\.(attn|mlp)_(res_proj\.weight|res_norm\.weight|res_alpha|null_source)$")
_FINAL = {"model.final_res_proj.weight": "routing.query", "model.final_res_norm.weight": "routing.key_norm"}
_PARTS = {"res_proj.weight": "routing.query", "res_norm.weight": "routing.key_norm", "res_alpha": "routing.alpha",
          "null_source": "routing.null_source"}


def authors_args(config: dict, **overrides) -> ModelArgs:
    """ModelArgs of an authors' ``config.json`` (Llama fields + ``attnres_*``).

    Raises:
        ConversionError: a mode this package does not read, a delta mode without the
            ``learnable_alpha`` gate or the null sources the paper layout has, a head count
            that does not divide the width.
    """
    mode = config.get("attnres_mode")
    if mode not in AUTHORS_MODES:
        raise ConversionError(f"attnres_mode={mode!r} is not supported; supported: {sorted(AUTHORS_MODES)}")
    fields = dict(AUTHORS_MODES[mode])
    gate = config.get("attnres_gate_type", "bias")
    delta = fields["routing_mode"] == "delta"
    if delta and gate != "learnable_alpha":
        raise ConversionError(f"attnres_mode={mode!r} with attnres_gate_type={gate!r}: only the learnable_alpha gate "
                              "(our delta gate) is supported")
    if not delta and gate != "bias":
        raise ConversionError(f"attnres_mode={mode!r} with attnres_gate_type={gate!r}: replacement routing has no gate")
    nulls = bool(config.get("attnres_use_null_source")) or mode == "delta_mh"
    if nulls != delta:
        raise ConversionError(f"attnres_mode={mode!r} with attnres_use_null_source={nulls}: per-sublayer null "
                              "sources exist only in the paper (delta) layout, which needs them")
    n_layers = int(config["num_hidden_layers"])
    fields.setdefault("routing_heads", int(config.get("attnres_num_heads", 8)))
    fields["routing_block_layers"] = max(1, math.ceil(n_layers / int(config.get("attnres_num_blocks", 8))))
    backbone = args_from_hf_config({**config, "model_type": "llama"})
    fields.update(residual="attn_res", routing_null_source=nulls, routing_eps=backbone.norm_eps)
    fields.update(overrides)
    try:
        return ModelArgs(**{**vars(backbone), **fields})
    except ValueError as e:
        raise ConversionError(f"the authors' config does not give a valid model: {e}") from None


def authors_target(name: str, n_layers: int) -> Optional[Target]:
    """Our ``(key, row)`` for one of their names (backbone names included); None if unknown."""
    if name in _FINAL:
        return _FINAL[name], 2 * n_layers
    match = _SITE.match(name)
    if match:
        layer, sublayer, part = int(match.group(1)), match.group(2), match.group(3)
        return _PARTS[part], 2 * layer + (0 if sublayer == "attn" else 1)
    return backbone_target(name)


def load_authors_weights(model: Transformer, folder: str | os.PathLike) -> list[str]:
    """Stream an authors' checkpoint into a built model of the matching arguments (every
    parameter required). Raises ConversionError (names, shapes, missing tensors) before reading."""
    args = model.args
    return load_streamed(
        model, folder, lambda name: authors_target(name, args.n_layers), required=lambda key: True,
        skip=lambda name: name == "lm_head.weight" and args.tie_embeddings,
    )


def import_authors(folder: str | os.PathLike, dtype: torch.dtype = torch.float32, device="cpu",
                   **overrides) -> Transformer:
    """The model of an authors' folder (arguments from its ``config.json``), weights streamed in."""
    args = authors_args(read_json(Path(folder) / CONFIG), **overrides)
    model = empty_model(args, dtype, device)
    load_authors_weights(model, folder)
    return model


def authors_mode(args: ModelArgs) -> str:
    """Their ``attnres_mode`` for our arguments (ConversionError when there is none, or when the
    model scales its depth logits: their code has no logit scale or temperature, so it would
    route with other weights)."""
    heads = args.resolved_routing_heads
    if args.routing_logit_scale != 1.0 or args.routing_temperature != "fixed":
        raise ConversionError(
            f"the authors' format has no depth-logit scale or temperature (this model has routing_logit_scale="
            f"{args.routing_logit_scale!r}, routing_temperature={args.routing_temperature!r}): their code would "
            "route with unscaled logits; export with --format mhar (our folder, loaded with trust_remote_code=True)")
    mode = {
        ("delta", "block", "paper"): "delta_mh",
        ("delta", "sublayer", "paper"): "delta" if heads == 1 else None,
        ("replace", "sublayer", "clean"): "full_mh" if heads > 1 else "full",
        ("replace", "block", "clean"): "block_mh" if heads > 1 else "block",
    }.get((args.routing_mode, args.routing_granularity, args.routing_layout))
    if args.residual != "attn_res" or mode is None:
        raise ConversionError(
            f"no authors' mode for residual={args.residual!r}, routing_mode={args.routing_mode!r}, "
            f"granularity={args.routing_granularity!r}, layout={args.routing_layout!r}, heads={heads}: their delta "
            "modes are the paper layout (single-head at sublayer granularity)"
        )
    return mode


def export_authors(model: Transformer, folder: str | os.PathLike, dtype: torch.dtype | None = None,
                   max_shard_bytes: int = 5 * 2**30) -> list[Path]:
    """Write a routing model under the authors' names and ``config.json`` (``llama_attnres``).

    Raises:
        ConversionError: no authors' mode for the model, qk-norm, or a block size their
            ``attnres_num_blocks`` cannot express (ceil(L / blocks) must equal it).
    """
    args = model.args
    mode = authors_mode(args)
    L = args.n_layers
    n_blocks = math.ceil(L / args.routing_block_layers)
    if args.routing_granularity == "block" and math.ceil(L / n_blocks) != args.routing_block_layers:
        raise ConversionError(f"blocks of {args.routing_block_layers} layers over {L} layers cannot be written as "
                              "attnres_num_blocks (their block size is ceil(L / num_blocks))")
    out_dtype = dtype or next(model.parameters()).dtype
    writer = ShardedWriter(folder, max_shard_bytes)
    for key, value in model.state_dict().items():
        value = _full(value).to(out_dtype)
        if not key.startswith("routing."):
            writer.add(backbone_hf_name(key), value)
            continue
        part = {v: k for k, v in _PARTS.items()}[key]
        for row in range(value.shape[0]):
            tensor = value[row].reshape(1, -1) if part == "res_proj.weight" else value[row]
            if row == 2 * L:
                writer.add({v: k for k, v in _FINAL.items()}[key], tensor)
            else:
                sublayer = "attn" if row % 2 == 0 else "mlp"
                writer.add(f"model.layers.{row // 2}.{sublayer}_{part}", tensor.clone())
    paths = writer.close()
    config = {
        **hf_config_from_args(args, dtype=str(out_dtype).removeprefix("torch.")),
        "model_type": MODEL_TYPE, "architectures": ["LlamaAttnResForCausalLM"], "attnres_mode": mode,
        "attnres_num_heads": args.resolved_routing_heads, "attnres_num_blocks": n_blocks,
        "attnres_gate_type": "learnable_alpha" if args.routing_mode == "delta" else "bias",
        "attnres_use_null_source": args.routing_null_source,
    }
    write_json(Path(folder) / CONFIG, config)
    return paths
