"""A trained model from a run folder or a ``step-N`` checkpoint folder, for evaluation and analysis.

The model's shape comes from the checkpoint itself: the ``complete.json`` marker of every
checkpoint records the weight-defining ``ModelArgs`` and the tokenizer (the fingerprint), so a
checkpoint loads even after the run's ``config.toml`` changed. The run's ``config.toml`` (when
present) supplies the data settings (validation files, tokenizer cache), ``max_seq_len`` and the
metrics file name. Only the weights are read (the weight EMA when there is one, else ``model.*``;
no optimizer state) through ``mhar_titan.convert.dcp_io.load_model_dcp``; model-only exports and
converted models load too. One process, no process group.
"""
from __future__ import annotations

import dataclasses
import pathlib
from typing import Optional

import torch

from mhar_titan.checkpoint import CheckpointMismatchError, read_marker
from mhar_titan.checkpoint.find import find_checkpoint, read_run_config
from mhar_titan.config import JobConfig
from mhar_titan.config.parser import job_model_args
from mhar_titan.convert.dcp_io import load_model_dcp
from mhar_titan.data import DataConfig, Tokenizer, ValidationLoader, build_tokenizer, build_validation_loader
from mhar_titan.errors import UserError
from mhar_titan.models.args import ModelArgs
from mhar_titan.models.model import Transformer

DEFAULT_MAX_SEQ_LEN = 4096
"""RoPE table length for a checkpoint whose run folder has no config.toml (max_seq_len is not
part of the fingerprint: it does not change the weights)."""

USER_ERRORS = (UserError, FileNotFoundError, ValueError)
"""Errors of the commands' inputs (paths, checkpoints, configs, data): reported in one line, exit status 2."""


@dataclasses.dataclass
class LoadedModel:
    """A model in eval mode with what it was trained with."""

    model: Transformer
    args: ModelArgs
    tokenizer: Tokenizer
    run_dir: pathlib.Path
    checkpoint: pathlib.Path
    """The ``step-N`` folder the weights came from."""
    step: int
    cfg: Optional[JobConfig]
    """The run's resolved ``config.toml``; None when the folder has none."""

    def source(self) -> dict:
        """Where the weights came from: ``{"run": run folder, "checkpoint": step-N folder, "step": N}``
        (paths as strings), what evaluation results record."""
        return {"run": str(self.run_dir), "checkpoint": str(self.checkpoint), "step": self.step}

    @property
    def data_config(self) -> DataConfig:
        """The run's ``[data]`` section (a default one naming the tokenizer when there is no config)."""
        return self.cfg.data if self.cfg is not None else DataConfig(tokenizer=self.tokenizer.name)

    @property
    def validation_data_config(self) -> DataConfig:
        """The one-source ``[data]`` whose validation files evaluations default to: the run's own, or
        for a data mixture its first source with validation files (else its first source)."""
        data = self.data_config
        if data.is_mixture:
            held_out = data.validation_configs()
            data = held_out[0][1] if held_out else data.mixture()[0].data
        return data

    def validation_batches(self, files: Optional[list[str]] = None, batch_size: Optional[int] = None,
                           seq_len: Optional[int] = None, steps: Optional[int] = None) -> ValidationLoader:
        """Held-out ``(inputs, labels)`` batches as the trainer's validation builds them.

        Defaults come from the run's config: ``data.validation_files`` (a data mixture: the first
        source with validation files, whose source keys also read ``files``),
        ``training.local_batch_size``, ``training.seq_len`` and ``validation.sequences`` (8, 512
        and 64 without a config); ``steps`` batches instead means ``steps * batch_size`` sequences.

        Raises:
            ValueError: no validation files named anywhere, or ``seq_len`` longer than the model's
                ``max_seq_len``. DataError: the files are too short.
        """
        cfg = self.cfg
        data = self.validation_data_config
        files = list(files or data.validation_files)
        if not files:
            raise ValueError(f"{self.run_dir} names no validation files (data.validation_files); pass some files")
        batch_size = batch_size or (cfg.training.local_batch_size if cfg is not None else 8)
        seq_len = seq_len or (cfg.training.seq_len if cfg is not None else 512)
        if seq_len > self.args.max_seq_len:
            raise ValueError(f"a sequence length of {seq_len} tokens (--seq-len, or the run's training.seq_len) is "
                             f"longer than the model's max_seq_len {self.args.max_seq_len}; pass --seq-len "
                             f"{self.args.max_seq_len} or less")
        sequences = steps * batch_size if steps else (cfg.validation.sequences_for(seq_len) if cfg is not None else 64)
        return build_validation_loader(
            dataclasses.replace(data, validation_files=files), self.tokenizer, dp_rank=0, dp_world=1,
            local_batch_size=batch_size, seq_len=seq_len,
            sequences=sequences)


def load_run(path: str | pathlib.Path, step: Optional[int] = None, device: str | torch.device = "cpu",
             routing_kernel: str = "eager", ema: bool = True) -> LoadedModel:
    """Build the model of a run (or checkpoint) folder, load its weights, switch to eval mode.

    Args:
        path: a run folder (``<dump_folder>/<job.name>``) or a ``step-N`` checkpoint folder (also
            a converted model's folder, ``python -m mhar_titan.convert``).
        step: checkpoint step of a run folder; None = the newest complete one.
        device: where the model goes.
        routing_kernel: ``ModelArgs.routing_kernel`` for the loaded model ("eager" gives the
            reference routing that analysis reads; "auto" uses the fused kernels on CUDA).
        ema: load the weight EMA when the checkpoint holds one (``training.ema_decay > 0``; the
            trainer validates on it too), else the trained weights.

    Raises:
        FileNotFoundError / ValueError: see ``find_checkpoint``.
        ConversionError: the checkpoint's marker records no model arguments.
        CheckpointMismatchError: the marker's tokenizer differs from the run's config.
        TokenizerFileError: the run's tokenizer files are missing (the message names the fix).
    """
    run_dir, checkpoint = find_checkpoint(path, step)
    cfg = read_run_config(run_dir)
    marker = read_marker(checkpoint) if (checkpoint / "complete.json").is_file() else {}
    tokenizer_name = ((marker.get("fingerprint") or {}).get("tokenizer") or marker.get("tokenizer")
                      or (cfg.data.tokenizer if cfg else "gpt2"))
    data_cfg = cfg.data if cfg is not None else DataConfig(tokenizer=tokenizer_name)
    if data_cfg.tokenizer != tokenizer_name:
        raise CheckpointMismatchError(f"{checkpoint} was trained with tokenizer {tokenizer_name!r} but "
                                      f"{run_dir / 'config.toml'} names {data_cfg.tokenizer!r}")
    tokenizer = build_tokenizer(data_cfg)
    max_seq_len = job_model_args(cfg).max_seq_len if cfg is not None else DEFAULT_MAX_SEQ_LEN
    model = load_model_dcp(checkpoint, ema=ema, max_seq_len=max_seq_len, routing_kernel=routing_kernel)
    model = model.to(device).eval()
    return LoadedModel(model=model, args=model.args, tokenizer=tokenizer, run_dir=run_dir, checkpoint=checkpoint,
                       step=int(marker.get("step", 0)), cfg=cfg)


def is_pretrained_folder(path: str | pathlib.Path) -> bool:
    """A pretrained model folder (``config.json`` beside the weights: a Hugging Face Llama or Qwen3
    folder, one of our ``mhar_titan`` folders, the authors' format), as the export command writes."""
    return (pathlib.Path(path) / "config.json").is_file()


def load_model(path: str | pathlib.Path, step: Optional[int] = None, device: str | torch.device = "cpu",
               routing_kernel: str = "eager") -> LoadedModel:
    """``load_run`` for a run or ``step-N`` folder; a pretrained folder (``is_pretrained_folder``) is
    streamed in through ``mhar_titan.convert.load_pretrained`` with the tokenizer of its own
    tokenizer files (``hf:<folder>``), ``step`` 0 and no run config.

    Raises:
        FileNotFoundError / ValueError: see ``find_checkpoint`` (also: a step given for a pretrained folder).
        ConversionError: the folder's config or weights cannot be read.
        TokenizerFileError: the folder has no readable tokenizer files.
    """
    from mhar_titan.convert import load_pretrained
    from mhar_titan.data.tokenizer import HF_PREFIX

    if not is_pretrained_folder(path):
        return load_run(path, step, device, routing_kernel=routing_kernel)
    if step is not None:
        raise ValueError(f"{path} is a pretrained model folder (config.json) and has no steps; drop the step ({step})")
    folder = pathlib.Path(path)
    tokenizer = build_tokenizer(DataConfig(tokenizer=f"{HF_PREFIX}{folder.resolve()}"))
    model = load_pretrained(folder, routing_kernel=routing_kernel).to(device).eval()
    return LoadedModel(model=model, args=model.args, tokenizer=tokenizer, run_dir=folder, checkpoint=folder,
                       step=0, cfg=None)
