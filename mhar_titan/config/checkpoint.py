"""``[checkpoint]`` settings (TorchTitan v0.2.2 names), their validation and the checkpoint errors.

Imports nothing heavy (no torch): the job config parser imports this module.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from mhar_titan.errors import UserError


class CheckpointError(UserError, RuntimeError):
    """A checkpoint cannot be used (missing, incomplete, wrong kind, bad config, unsafe content)."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint was made for a different model, tokenizer or optimizer setup."""


COMPONENTS = ("model", "optimizer", "lr_scheduler", "dataloader", "train_state", "rng", "ema")
"""Parts of the train state; any of them can be named in ``exclude_from_loading``."""

ASYNC_MODES = ("disabled", "async")
EXPORT_DTYPES = ("float32", "bfloat16", "float16")
"""``checkpoint.export_dtype`` choices: names of torch dtypes (``getattr(torch, name)``)."""


@dataclass
class CheckpointConfig:
    """``[checkpoint]``: DCP save/load of the whole train state (TorchTitan v0.2.2 names)."""

    enable: bool = False
    """Save checkpoints and resume from the newest complete one in the run folder."""
    folder: str = "checkpoints"
    """Sub-folder of the run folder that holds the ``step-N`` checkpoints."""
    interval: int = 500
    """Save every this many steps (the last step and a preemption always save); <= 0: only those."""
    keep_latest_k: int = 10
    """Keep the k newest complete checkpoints, delete older ones; 0 keeps all. The newest
    complete one is never deleted."""
    load_step: int = -1
    """Step to resume from; -1 means the newest complete checkpoint. A step older than the
    newest complete checkpoint is refused (the error names the newer folders to move away)."""
    async_mode: str = "disabled"
    """"disabled" (save blocks the step) or "async" (``dcp.async_save`` on a dedicated gloo
    group; the next save or ``close()`` waits for it). The last step and a preemption always
    save synchronously."""
    initial_load_path: Optional[str] = None
    """A ``step-N`` folder (of another run, or a converted model), or a pretrained folder with a
    ``config.json`` (Hugging Face Llama, ``mhar_titan``, the authors' format; weights streamed in
    by ``mhar_titan.convert``), loaded when the run folder has no complete checkpoint yet; None:
    start from the random init. Loaded with ``enable = false`` too (a run that starts from it
    and saves nothing)."""
    initial_load_model_only: bool = True
    """Load only the model from ``initial_load_path`` (step counts from 0); False loads the
    whole train state and continues at its step."""
    exclude_from_loading: list[str] = field(default_factory=list)
    """Parts not restored on resume: any of model, optimizer, lr_scheduler, dataloader,
    train_state, rng, ema (e.g. ["dataloader"] to switch data sets)."""
    last_save_model_only: bool = False
    """Save only the model (cast to ``export_dtype``) at the last step: a smaller export that
    cannot be resumed from (load it through ``initial_load_path``)."""
    export_dtype: str = "float32"
    """dtype of the model-only last save: "float32", "bfloat16" or "float16"."""

    def validate(self) -> None:
        """Raise ``CheckpointError`` naming the first invalid key of ``[checkpoint]``."""
        if self.async_mode not in ASYNC_MODES:
            raise CheckpointError(f"checkpoint.async_mode must be one of {ASYNC_MODES}, got {self.async_mode!r}")
        if self.export_dtype not in EXPORT_DTYPES:
            raise CheckpointError(
                f"checkpoint.export_dtype must be one of {EXPORT_DTYPES}, got {self.export_dtype!r}"
            )
        bad = [name for name in self.exclude_from_loading if name not in COMPONENTS]
        if bad:
            raise CheckpointError(
                f"checkpoint.exclude_from_loading has unknown part(s) {bad}; valid parts: {list(COMPONENTS)}"
            )
        if self.keep_latest_k < 0:
            raise CheckpointError(f"checkpoint.keep_latest_k must be >= 0 (0 keeps all), got {self.keep_latest_k}")
        if self.load_step < -1:
            raise CheckpointError(f"checkpoint.load_step must be -1 (newest) or a step >= 0, got {self.load_step}")
