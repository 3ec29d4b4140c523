"""One entry point for every pretrained folder kind, chosen by ``config.json``'s ``model_type``.

| model_type    | what it is                                        | reader / writer             |
|---------------|---------------------------------------------------|-----------------------------|
| ``llama``     | Hugging Face Llama (``standard`` decoder)         | ``hf_llama``                |
| ``qwen3``     | Hugging Face Qwen3 (``standard``, q/k norm)       | ``hf_llama``                |
| ``mhar_titan``| any of our models, our parameter names            | ``mhar_format``             |
| ``llama_attnres`` | the MHAR authors' Llama modeling code         | ``authors``                 |
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from mhar_titan.data.tokenizer import Tokenizer
from mhar_titan.models.args import ModelArgs
from mhar_titan.models.model import Transformer

from . import authors
from .hf_config import ConversionError, read_json, write_json
from .hf_llama import CONFIG, export_hf, import_hf, load_hf_weights
from .mhar_format import MODEL_TYPE, export_mhar, load_mhar, load_mhar_weights
from .tokenizer_files import pad_token_id, write_tokenizer_files

FORMATS = ("auto", "hf", "mhar", "authors")
"""Export formats: "hf" (a Llama folder, or Qwen3 with q/k norm: standard models), "mhar" (our
model type, loaded by transformers with trust_remote_code=True), "authors" (the authors' names
and config, routing models), "auto" (hf for standard models, mhar otherwise)."""


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


def resolve_format(args: ModelArgs, fmt: str) -> str:
    """The export format ``fmt`` ("auto" resolved: "hf" for a ``standard`` model, else "mhar") for a
    model with ``args``; checked before any weight is read.

    Raises:
        ConversionError: an unknown format, "hf" for a routing model (the message names "mhar"), or
            "authors" for a model their format cannot hold (``authors.authors_mode``).
    """
    if fmt not in FORMATS:
        raise ConversionError(f"unknown export format {fmt!r}; choose one of {FORMATS}")
    if fmt == "auto":
        return "hf" if args.residual == "standard" else "mhar"
    if fmt == "hf" and args.residual != "standard":
        raise ConversionError(f"a {args.residual!r} model has no stock transformers architecture (its depth "
                              "connection is not the standard residual), so format 'hf' cannot hold it; use format "
                              "'mhar' (--format mhar, or the default --format auto): our own model type, which "
                              "transformers loads with trust_remote_code=True")
    if fmt == "authors":
        authors.authors_mode(args)  # a model their format cannot hold is refused before any weight is read
    return fmt


def folder_kind(folder: str | os.PathLike) -> str:
    """What an exported folder is, in words, from its ``config.json``: a stock Qwen3 / Llama folder,
    a ``mhar_titan`` remote-code folder or the authors' format (what the export command prints)."""
    config = read_json(Path(folder) / CONFIG)
    kind, architecture = config.get("model_type"), (config.get("architectures") or ["?"])[0]
    if kind == MODEL_TYPE:
        return (f"a mhar_titan folder with remote code ({architecture}: AutoModelForCausalLM.from_pretrained("
                f"'{folder}', trust_remote_code=True), with mhar-titan installed)")
    if kind == authors.MODEL_TYPE:
        return f"a folder in the MHAR authors' format (model_type {kind!r}, {architecture}, their modeling code)"
    name = {"qwen3": "Qwen3", "llama": "Llama"}.get(kind, str(kind))
    return f"a stock {name} folder ({architecture}: transformers loads it without remote code)"


def export_pretrained(model: Transformer, folder: str | os.PathLike, fmt: str = "auto",
                      dtype: torch.dtype | None = None, max_shard_bytes: int = 5 * 2**30,
                      tokenizer: Tokenizer | None = None) -> list[Path]:
    """Write ``model`` as a pretrained folder in ``fmt`` (see ``FORMATS``); returns the shard paths.

    With ``tokenizer`` (the one training used) the folder also gets its tokenizer files
    (``tokenizer_files``) and ``config.json`` its ``eos_token_id``, ``pad_token_id`` (the pad token the
    tokenizer files name: eos, or a copied Hugging Face tokenizer's own: ``pad_token_id``) and
    ``bos_token_id`` when there is one, and ``generation_config.json`` the same ids and the embedding's padding rows as ``suppress_tokens`` (``generation_config``), so
    ``AutoTokenizer`` encodes as training did and ``generate()`` stops at the end of text and draws
    only ids the tokenizer knows.

    Raises:
        ConversionError: an unknown format, a model the format cannot hold (``resolve_format``), or a tokenizer with
            more ids than the model's vocab_size (checked before anything is written).
    """
    fmt = resolve_format(model.args, fmt)
    if tokenizer is not None and tokenizer.n_vocab > model.args.vocab_size:
        raise ConversionError(f"tokenizer {tokenizer.name!r} has {tokenizer.n_vocab} ids but the model's vocab_size "
                              f"is {model.args.vocab_size}: it is not the tokenizer this model was trained with")
    writer = {"hf": export_hf, "mhar": export_mhar, "authors": authors.export_authors}[fmt]
    paths = writer(model, folder, dtype, max_shard_bytes)
    if tokenizer is not None:
        write_tokenizer_files(tokenizer, folder, model.args.max_seq_len)
        config = read_json(Path(folder) / CONFIG)
        config["eos_token_id"] = tokenizer.eos_id
        config["pad_token_id"] = pad_token_id(folder, tokenizer)  # eos, or a copied tokenizer's own pad token
        if getattr(tokenizer, "bos_id", None) is not None:
            config["bos_token_id"] = tokenizer.bos_id
        write_json(Path(folder) / CONFIG, config)
        write_json(Path(folder) / GENERATION_CONFIG, generation_config(config, tokenizer.n_vocab, model.args.vocab_size))
    return paths


GENERATION_CONFIG = "generation_config.json"


def generation_config(config: dict, n_vocab: int, vocab_size: int) -> dict:
    """transformers' generation defaults of an export: the eos / pad / bos ids of ``config`` and,
    when the embedding has more rows than the tokenizer has ids, ``suppress_tokens`` for the
    padding rows [n_vocab, vocab_size) (ids the tokenizer cannot decode), so that ``generate()``
    never draws them, as ``generate_batch(..., n_vocab=...)`` does not."""
    out = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
    if n_vocab < vocab_size:
        out["suppress_tokens"] = list(range(n_vocab, vocab_size))
    return out
