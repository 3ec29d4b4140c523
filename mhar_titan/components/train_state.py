"""The trainer's own counters (saved in every checkpoint) and the training-health guard."""
from __future__ import annotations

import dataclasses
from typing import Optional


class TrainingHealthError(RuntimeError):
    """Too many consecutive non-finite steps: the run stops (exit code 1)."""


@dataclasses.dataclass
class TrainState:
    """Step and token counters, non-finite step counts and the W&B run id; a Stateful
    object (``state_dict`` / ``load_state_dict``) saved as the checkpoint's ``train_state``."""

    step: int = 0
    tokens_seen: int = 0
    nonfinite_skipped: int = 0
    consecutive_nonfinite: int = 0
    wandb_id: Optional[str] = None
    source_tokens: dict = dataclasses.field(default_factory=dict)
    """Training tokens per data-mixture source (name -> tokens; empty for one source)."""
    unfinished: list = dataclasses.field(default_factory=list)
    """Evaluations of ``step`` ("validation", "eval") a stop signal ended before they finished: the
    resumed run does them first, so its metrics are those of a run never stopped."""

    def state_dict(self) -> dict:
        self.settled_source_tokens()
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict) -> None:
        self._pending = None
        for key, value in state.items():
            if hasattr(self, key):
                setattr(self, key, value)

    def sync_from_rank0(self, world_size: int) -> None:
        """Give every rank rank 0's ``wandb_id`` (set only where the W&B run lives); a collective
        when ``world_size > 1``.

        Every rank saves ``train_state`` under one checkpoint key and DCP keeps one
        copy, not necessarily rank 0's, so the train state must be equal on all ranks.
        """
        if world_size > 1:
            import torch.distributed as dist

            box = [self.wandb_id]
            dist.broadcast_object_list(box, src=0)
            self.wandb_id = box[0]

    def __post_init__(self):
        self._pending = None  # (names, windows not yet in source_tokens (a device tensor), seq_len)

    def add_source_windows(self, names: list[str], windows, seq_len: int) -> None:
        """Count a step's windows per mixture source: ``windows`` int64 ``(len(names),)``, on any
        device; added to ``source_tokens`` (x ``seq_len``) only when read (``settled_source_tokens``,
        ``state_dict``), so counting needs no host read."""
        if self._pending is None:
            self._pending = (list(names), windows.clone(), seq_len)
        else:
            self._pending[1].add_(windows)

    def settled_source_tokens(self) -> dict:
        """``source_tokens`` with every counted window in it (one host read when some are pending)."""
        if self._pending is not None:
            names, windows, seq_len = self._pending
            for name, n in zip(names, windows.tolist()):
                self.source_tokens[name] = self.source_tokens.get(name, 0) + int(n) * seq_len
            self._pending = None
        return self.source_tokens

    def count_step(self, finite: bool, tokens: int) -> None:
        """Advance by one optimizer step of ``tokens`` tokens; a non-finite one is counted as skipped."""
        self.step += 1
        self.tokens_seen += tokens
        if finite:
            self.consecutive_nonfinite = 0
        else:
            self.nonfinite_skipped += 1
            self.consecutive_nonfinite += 1

    def check_health(self, max_consecutive_nonfinite: int) -> None:
        """Raise ``TrainingHealthError`` after ``max_consecutive_nonfinite`` non-finite steps in a row."""
        if self.consecutive_nonfinite >= max_consecutive_nonfinite:
            first = self.step - self.consecutive_nonfinite + 1
            raise TrainingHealthError(
                f"stopping at step {self.step}: {self.consecutive_nonfinite} consecutive steps "
                f"(steps {first}-{self.step}) had a non-finite loss or gradient norm "
                f"(training.max_consecutive_nonfinite = {max_consecutive_nonfinite}); "
                f"lower optimizer.lr or check the data"
            )
