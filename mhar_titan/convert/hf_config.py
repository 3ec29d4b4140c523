"""Hugging Face Llama / Qwen3 ``config.json`` <-> ``ModelArgs`` (the decoder shape only).

A Llama-architecture checkpoint (Llama 3/3.1, Marin-8B, ...) is our ``standard`` decoder with
``qk_norm = False``: pre-norm RMSNorm, GQA attention with rotate-half RoPE (optionally the
Llama 3.1 "llama3" frequency scaling), SwiGLU MLP, no biases. A Qwen3 checkpoint is the same
decoder with ``qk_norm = True`` (per-head RMSNorm of q and k before RoPE, eps = rms_norm_eps;
no sliding window). Both spellings of the RoPE
settings are read: transformers 4.x (``rope_theta`` + ``rope_scaling``) and 5.x
(``rope_parameters`` holding ``rope_theta`` and the scaling fields).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from mhar_titan.errors import UserError
from mhar_titan.files import write_text
from mhar_titan.models.args import ModelArgs

SUPPORTED_MODEL_TYPES = ("llama", "qwen3")
QK_NORM_MODEL_TYPE = "qwen3"
"""The transformers architecture of a standard decoder with per-head q/k RMSNorm."""


class ConversionError(UserError, ValueError):
    """A checkpoint or config cannot be converted; the message names what and how to fix it."""


def read_json(path: str | os.PathLike) -> dict:
    """A JSON file as a dict (ConversionError naming the file when missing or malformed)."""
    path = Path(path)
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise ConversionError(f"{path} does not exist") from None
    except json.JSONDecodeError as e:
        raise ConversionError(f"{path} is not valid JSON: {e}") from None


def write_json(path: str | os.PathLike, data: dict, indent: int = 2) -> None:
    """Write ``data`` as JSON to ``path`` all-or-nothing with the umask's mode (``mhar_titan.files``).

    Raises:
        WriteError: the file cannot be written (disk full, read-only); ``path`` is unchanged.
    """
    write_text(path, json.dumps(data, indent=indent))


def _rope_settings(config: dict) -> dict:
    """RoPE fields of ModelArgs from either the 4.x or the 5.x spelling."""
    params = dict(config.get("rope_parameters") or {})
    scaling = dict(config.get("rope_scaling") or {})
    theta = params.get("rope_theta", config.get("rope_theta", 10_000.0))
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    fields: dict = dict(rope_theta=float(theta), rope_scaling=None)
    if rope_type == "llama3":
        source = params if params.get("rope_type") == "llama3" else scaling
        fields.update(
            rope_scaling="llama3",
            rope_scaling_factor=float(source["factor"]),
            rope_low_freq_factor=float(source["low_freq_factor"]),
            rope_high_freq_factor=float(source["high_freq_factor"]),
            rope_original_max_seq_len=int(source["original_max_position_embeddings"]),
        )
    elif rope_type != "default":
        raise ConversionError(
            f"config.json RoPE type {rope_type!r} is not supported; supported: 'default' (no scaling) and 'llama3'"
        )
    return fields


def args_from_hf_config(config: dict, **overrides) -> ModelArgs:
    """``ModelArgs`` of the ``standard`` decoder described by a HF Llama or Qwen3 ``config.json``.

    Derived: dim, n_layers, n_heads, n_kv_heads, ffn_dim, vocab_size, norm_eps, rope_theta and
    llama3 rope scaling, tie_embeddings, max_seq_len (= max_position_embeddings); qk_norm False
    for Llama, True for Qwen3.
    ``overrides`` replace any field afterwards (e.g. ``max_seq_len=4096`` for a smaller RoPE
    table, or ``residual="attn_res"`` for a routing model built on this backbone).

    Raises:
        ConversionError: a model type other than llama / qwen3, a Qwen3 sliding window, an activation other than silu,
            attention or MLP biases, a head_dim other than hidden_size / num_attention_heads,
            an unsupported RoPE type, or a missing shape field.
    """
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConversionError(
            f"config.json model_type={model_type!r} is not supported; only Llama-architecture checkpoints "
            f"({', '.join(SUPPORTED_MODEL_TYPES)}) can be imported"
        )
    if config.get("use_sliding_window"):
        raise ConversionError("config.json use_sliding_window=true: sliding-window attention is not supported")
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise ConversionError(f"config.json hidden_act={act!r}: only 'silu' (SwiGLU) is supported")
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key):
            raise ConversionError(f"config.json {key}=true: biases are not supported by the decoder")
    try:
        dim, n_heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        fields = dict(
            dim=dim,
            n_layers=int(config["num_hidden_layers"]),
            n_heads=n_heads,
            n_kv_heads=int(config.get("num_key_value_heads") or n_heads),
            ffn_dim=int(config["intermediate_size"]),
            vocab_size=int(config["vocab_size"]),
            norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            qk_norm=model_type == QK_NORM_MODEL_TYPE,
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            max_seq_len=int(config.get("max_position_embeddings", 2048)),
            residual="standard",
            **_rope_settings(config),
        )
    except KeyError as e:
        raise ConversionError(f"config.json lacks the field {e.args[0]!r} that a Llama config has") from None
    head_dim = config.get("head_dim")
    if head_dim is not None and int(head_dim) * n_heads != dim:
        raise ConversionError(
            f"config.json head_dim={head_dim} but hidden_size / num_attention_heads = {dim // n_heads}; "
            "decoupled head dimensions are not supported"
        )
    fields.update(overrides)
    try:
        return ModelArgs(**fields)
    except (TypeError, ValueError) as e:
        raise ConversionError(f"config.json does not describe a valid decoder: {e}") from None


def hf_config_from_args(args: ModelArgs, dtype: str = "float32") -> dict:
    """A transformers ``LlamaConfig`` dict (``config.json``) for the backbone of ``args``, or a
    ``Qwen3Config`` one when ``args.qk_norm`` (Qwen3 is Llama plus the per-head q/k norms).

    Written in the transformers 4.x spelling (``rope_theta`` + ``rope_scaling``), which 5.x reads too.
    """
    qwen3 = args.qk_norm
    config = {
        "architectures": ["Qwen3ForCausalLM" if qwen3 else "LlamaForCausalLM"],
        "model_type": QK_NORM_MODEL_TYPE if qwen3 else "llama",
        "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "intermediate_size": args.ffn_dim,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": dtype,
    }
    if qwen3:
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=args.n_layers,
                      attention_dropout=0.0)
    if args.rope_scaling == "llama3":
        config["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": args.rope_scaling_factor,
            "low_freq_factor": args.rope_low_freq_factor,
            "high_freq_factor": args.rope_high_freq_factor,
            "original_max_position_embeddings": args.rope_original_max_seq_len,
        }
    return config
