"""Conversion commands.

    python -m mhar_titan.convert import FOLDER OUT_CHECKPOINT [--to-delta paper|clean] [--dtype bfloat16]
                                      [--max-seq-len 8192] [--routing-logit-scale S]
                                      [--routing-temperature fixed|learned]
    python -m mhar_titan.convert export RUN_OR_CHECKPOINT OUT_FOLDER [--step N] [--format auto|hf|mhar|authors]
                                      [--dtype bfloat16] [--tokenizer NAME]

``import`` reads a pretrained folder (a Hugging Face Llama folder, one of our ``mhar_titan``
folders or the authors' ``llama_attnres`` ones; streamed shard by shard) and writes a model-only
DCP checkpoint for ``checkpoint.initial_load_path``; ``--to-delta`` converts a Llama model to
delta-MHAR on the way (H = 8, blocks of 4 layers, null sources, gates 0: the same logits), with
``--routing-logit-scale`` / ``--routing-temperature`` as the ``model.`` keys of the same names
(a learned temperature starts at the scale; the gates 0 keep the logits the original's).
``export`` rebuilds the model of a DCP checkpoint (a run folder's newest complete one, or
``--step``, or a ``step-N`` / converted checkpoint folder, found as ``generate`` and ``eval`` find
it; arguments from its ``complete.json``; its weight EMA when it has one, unless ``--no-ema``) and
writes a Hugging Face Llama or Qwen3 folder (standard models), a ``mhar_titan`` folder (routing
models, loaded by transformers with ``trust_remote_code=True``) or the authors' format, always
with the tokenizer files of the tokenizer the checkpoint records (a training checkpoint's
``data.tokenizer``, an imported folder's own tokenizer) or ``--tokenizer``; its last line says
which kind of folder it wrote. Errors exit with status 2 and one message;
both refuse an output folder that exists and is not empty, is read-only or lies under a regular
file before reading anything, so an earlier conversion is never overwritten. The output is
written into a temporary sibling folder renamed to the output folder at the end: it exists only
complete, its files with the umask's mode.
"""
from __future__ import annotations

import dataclasses
import sys
from argparse import ArgumentTypeError
from pathlib import Path

import torch

from mhar_titan.checkpoint import MARKER
from mhar_titan.cli_args import ArgumentParser, non_negative_int, positive_float, positive_int, run_command
from mhar_titan.config.checkpoint import EXPORT_DTYPES
from mhar_titan.config import load_config
from mhar_titan.data import DataConfig, build_tokenizer
from mhar_titan.data.hf_tokenizer import is_hf_tokenizer_folder
from mhar_titan.data.tokenizer import HF_PREFIX, N_VOCAB, Tokenizer
from mhar_titan.errors import UserError
from mhar_titan.files import atomic_folder, check_output_folder
from mhar_titan.models.args import ROUTING_TEMPERATURES, logit_scale

from .dcp_io import dcp_model_args, load_model_dcp, save_model_dcp
from .delta import delta_fields
from .folders import FORMATS, export_pretrained, folder_kind, folder_model_type, load_pretrained, resolve_format
from .hf_config import ConversionError, read_json
from .hf_llama import hf_args


def _logit_scale(text: str) -> float | str:
    """A ``--routing-logit-scale`` value as ``model.routing_logit_scale`` takes it: a number, or the
    string "match_heads:H"; checked by ``args.logit_scale`` (argparse's one-line error, exit 2)."""
    try:
        value: float | str = float(text)
    except ValueError:
        value = text
    try:
        logit_scale(value)
    except ValueError as e:
        raise ArgumentTypeError(str(e)) from None
    return value


def _parser() -> ArgumentParser:
    parser = ArgumentParser(prog="python -m mhar_titan.convert", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="pretrained folder -> model-only DCP checkpoint")
    imp.add_argument("folder")
    imp.add_argument("out")
    imp.add_argument("--dtype", choices=EXPORT_DTYPES, default="float32", help="dtype of the written weights")
    imp.add_argument("--to-delta", choices=("paper", "clean"), default=None,
                     help="convert a Llama model to delta-MHAR in this routing layout")
    imp.add_argument("--routing-logit-scale", type=_logit_scale, default=None,
                     help="with --to-delta: the depth-logit scale, a number > 0 or match_heads:H (1/sqrt(H)); "
                          "model.routing_logit_scale")
    imp.add_argument("--routing-temperature", choices=ROUTING_TEMPERATURES, default=None,
                     help="with --to-delta: fixed, or learned (a log-temperature per site and head starting at the "
                          "scale); model.routing_temperature")
    imp.add_argument("--max-seq-len", type=positive_int, default=None,
                     help="RoPE table length (default: config.json max_position_embeddings)")
    exp = sub.add_parser("export", help="DCP checkpoint -> pretrained folder")
    exp.add_argument("checkpoint", help="run folder (newest complete checkpoint), or a checkpoints/step-N folder, "
                                        "or a converted checkpoint (python -m mhar_titan.convert import)")
    exp.add_argument("out")
    exp.add_argument("--step", type=non_negative_int, default=None, help="checkpoint step of the run folder")
    exp.add_argument("--format", choices=FORMATS, default="auto",
                     help="hf: Llama folder (standard models); mhar: our model type; authors: the authors' "
                          "names (routing models); auto: hf when possible, else mhar")
    exp.add_argument("--dtype", choices=EXPORT_DTYPES, default=None, help="dtype of the exported weights (default: float32)")
    exp.add_argument("--max-shard-gb", type=positive_float, default=5.0,
                     help="largest weight file, in GB (2**30 bytes)")
    exp.add_argument("--tokenizer", default=None,
                     help=f"the tokenizer whose files the folder gets ({', '.join(N_VOCAB)} or {HF_PREFIX}<folder>); "
                          "default: the one the checkpoint records")
    exp.add_argument("--no-ema", action="store_true",
                     help="export the trained weights even when the checkpoint holds a weight EMA (the default exports the EMA)")
    return parser


def export_checkpoint(path: str | Path, step: int | None) -> tuple[Path, Path]:
    """(run folder, checkpoint folder) of ``export``'s first argument, found as ``generate`` and
    ``eval`` find theirs (``checkpoint.find.find_checkpoint``); the checkpoint must be complete.

    Raises:
        ConversionError: no such path, no complete checkpoint (the message lists the complete
            steps), a step given with a checkpoint folder, or a checkpoint whose save never finished.
    """
    from mhar_titan.checkpoint.find import find_checkpoint

    try:
        run_dir, checkpoint = find_checkpoint(path, step)
    except (FileNotFoundError, ValueError) as e:
        raise ConversionError(str(e)) from None
    if not (checkpoint / MARKER).is_file():
        raise ConversionError(f"{checkpoint} has no {MARKER}: its save did not finish, so it is not a complete "
                              f"checkpoint; pass the run folder {run_dir} (its newest complete checkpoint) or another "
                              "step-N folder")
    return run_dir, checkpoint


def export_tokenizer(checkpoint: str | Path, name: str | None, run_dir: str | Path | None = None) -> Tokenizer:
    """The tokenizer an export writes: ``name``, else the one the checkpoint's ``complete.json``
    records (``fingerprint.tokenizer`` of a training checkpoint, ``tokenizer`` of an imported
    model), built with the run's ``[data]`` settings (tokenizer cache) when the run folder
    (default: two levels above the checkpoint) has its config.toml.

    Raises:
        ConversionError: the marker names no tokenizer (a converted folder without tokenizer files;
            the message says to pass --tokenizer).
        TokenizerFileError / HFTokenizerError: its files cannot be found or read.
    """
    checkpoint = Path(checkpoint)
    marker = read_json(checkpoint / MARKER)
    name = name or (marker.get("fingerprint") or {}).get("tokenizer") or marker.get("tokenizer")
    if not name:
        raise ConversionError(f"{checkpoint / MARKER} names no tokenizer (the model was converted from a folder "
                              "without tokenizer files); pass the one the model was trained with: "
                              f"--tokenizer {' | '.join(N_VOCAB)} | {HF_PREFIX}<folder>")
    run_config = Path(run_dir if run_dir is not None else checkpoint.parent.parent) / "config.toml"
    data = load_config(str(run_config)).data if run_config.is_file() else DataConfig()
    return build_tokenizer(dataclasses.replace(data, tokenizer=name,
                                               tokenizer_file=data.tokenizer_file if name == data.tokenizer else None))


def main(argv: list[str] | None = None) -> int:
    """Run ``import`` or ``export``; returns 0, or 2 after one line ``python -m mhar_titan.convert
    COMMAND: error: ...`` on stderr for any input error (``UserError``: a folder, checkpoint or config
    that cannot be converted), the prefix the other commands print."""
    parser = _parser()
    opts = parser.parse_args(argv)
    try:
        out = Path(opts.out)
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise ConversionError(f"{out} exists and is not empty; choose a new folder for the {opts.command}ed "
                                  "model (nothing was read or written)")
        check_output_folder(out, "output folder")  # read-only or under a file: refused before the model is read
        if opts.command == "import":
            overrides = {} if opts.max_seq_len is None else {"max_seq_len": opts.max_seq_len}
            if opts.to_delta:
                if folder_model_type(opts.folder) not in ("llama", "qwen3"):
                    raise ConversionError("--to-delta converts a Hugging Face Llama or Qwen3 folder "
                                          "(model_type llama or qwen3)")
                routing = {k: v for k, v in (("routing_logit_scale", opts.routing_logit_scale),
                                             ("routing_temperature", opts.routing_temperature)) if v is not None}
                overrides.update(delta_fields(hf_args(opts.folder), opts.to_delta, **routing))
            elif opts.routing_logit_scale is not None or opts.routing_temperature is not None:
                raise ConversionError("--routing-logit-scale and --routing-temperature set the routing of a delta-MHAR "
                                      "conversion: add --to-delta paper|clean (a folder's own routing model keeps its "
                                      "saved settings)")
            model = load_pretrained(opts.folder, getattr(torch, opts.dtype), **overrides)
            tokenizer = {"tokenizer": f"{HF_PREFIX}{Path(opts.folder).resolve()}"} \
                if is_hf_tokenizer_folder(opts.folder) else {}
            with atomic_folder(out) as tmp:  # out appears only when complete
                save_model_dcp(model, tmp, source=str(opts.folder), **tokenizer)
            print(f"wrote {out} ({sum(p.numel() for p in model.parameters()):,} parameters, {opts.dtype})")
        else:
            run_dir, checkpoint = export_checkpoint(opts.checkpoint, opts.step)
            fmt = resolve_format(dcp_model_args(checkpoint), opts.format)  # before the weights are read
            tokenizer = export_tokenizer(checkpoint, opts.tokenizer, run_dir)
            model = load_model_dcp(checkpoint, ema=not opts.no_ema)
            with atomic_folder(out) as tmp:
                paths = export_pretrained(model, tmp, fmt, getattr(torch, opts.dtype) if opts.dtype else None,
                                          int(opts.max_shard_gb * 2**30), tokenizer)
            step = read_json(checkpoint / MARKER).get("step", 0)
            print(f"wrote {out} from {checkpoint} (step {step}, {len(paths)} shard(s)): {folder_kind(out)}")
    except UserError as e:  # ConversionError, an unwritable output folder, a full disk (WriteError)
        print(f"{parser.prog} {opts.command}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    run_command(main)
