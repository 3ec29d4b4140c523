"""The learning-rate schedule (MHAR_SPEC 3.1; TorchTitan's warmup-stable-decay) and its warnings.

Linear warmup to the peak over ``warmup_steps``, an optional stable phase, then a decay (linear,
sqrt or cosine) to ``min_lr_factor * peak`` at the last step (a warm-up as long as the run or
longer ends the run inside the warm-up instead, with a warning: ``WarmupStableDecay``; a decay cut
short by the warm-up is warned about too: ``schedule_warnings``).
"""
from __future__ import annotations

import logging
import math
import types

import torch

logger = logging.getLogger(__name__)


class WarmupStableDecay:
    """LR multiplier at optimizer step ``s`` (1-based), for ``LambdaLR``.

    ``s <= warmup``: ``s / warmup``. Stable (1.0) until ``decay_start``, which is
    ``warmup`` when ``decay_ratio`` is None (warmup + decay) and
    ``max(warmup, steps - round(decay_ratio * steps))`` otherwise (WSD: the decay never starts
    inside the warm-up, so a warm-up longer than ``steps - round(decay_ratio * steps)`` leaves the
    decay ``steps - warmup`` steps instead of ``round(decay_ratio * steps)``; ``decay_warning``
    says so). Then, with
    ``p = (s - decay_start) / (steps - decay_start)``, the multiplier is
    ``min_lr_factor + (1 - min_lr_factor) * d(p)`` with ``d`` = ``1 - p`` (linear),
    ``1 - sqrt(p)`` (sqrt) or ``(1 + cos(pi p)) / 2`` (cosine); it equals
    ``min_lr_factor`` at ``s = steps`` and stays there past the end, when the warm-up ends
    before the last step (``warmup < steps``).

    A warm-up as long as the run or longer (``warmup >= steps``) is kept as configured: the
    run ends inside the warm-up at ``steps / warmup`` of the peak (no decay, not
    ``min_lr_factor``), so the LR of step ``s`` does not depend on ``steps`` (a longer
    run, or a resume that raises ``training.steps``, repeats the same first steps).
    ``warmup_warning`` says so when the job is built.

    A callable object rather than a lambda, so a checkpoint records the schedule it ran
    with and a resume can tell when the config's schedule differs (``ConfigLambdaLR``).
    """

    def __init__(self, steps: int, warmup_steps: int, decay_ratio, decay_type: str, min_lr_factor: float):
        self.steps = steps
        self.warmup_steps = warmup_steps
        if decay_ratio is None:
            start = warmup_steps
        else:
            start = max(warmup_steps, steps - round(decay_ratio * steps))
        self.decay_start = min(start, steps)
        self.decay_type = decay_type
        self.min_lr_factor = min_lr_factor

    def factor(self, step: int) -> float:
        if step <= self.warmup_steps:
            return step / self.warmup_steps
        if step <= self.decay_start:
            return 1.0
        p = min(1.0, (step - self.decay_start) / max(1, self.steps - self.decay_start))
        if self.decay_type == "linear":
            d = 1.0 - p
        elif self.decay_type == "sqrt":
            d = 1.0 - math.sqrt(p)
        else:
            d = 0.5 * (1.0 + math.cos(math.pi * p))
        return self.min_lr_factor + (1.0 - self.min_lr_factor) * d

    def __call__(self, last_epoch: int) -> float:
        # LambdaLR evaluates at last_epoch = 0 before optimizer step 1.
        return self.factor(last_epoch + 1)


class ConfigLambdaLR(torch.optim.lr_scheduler.LambdaLR):
    """``LambdaLR`` whose schedule always comes from the current config.

    Loading a checkpoint restores the step counter but keeps the schedule built from the
    config, and sets the optimizer's group LRs from it (call it after loading the
    optimizer), so a resumed run with a raised ``training.steps`` stretches its decay to
    the new end from its first step. When the saved schedule differs, it says so.
    """

    def load_state_dict(self, state_dict: dict) -> None:
        state = dict(state_dict)
        saved = state.get("lr_lambdas") or [None]
        current = [fn.__dict__ if not isinstance(fn, types.FunctionType) else None for fn in self.lr_lambdas]
        if saved[0] is not None and current[0] is not None and saved[0] != current[0]:
            logger.warning(
                "the LR schedule differs from the checkpoint's (saved %s, now %s): continuing with the "
                "current config's schedule from step %s", saved[0], current[0], state.get("last_epoch"))
        state["lr_lambdas"] = current
        if len(state.get("base_lrs", ())) != len(self.base_lrs):
            # saved for another optimizer's groups (a resume that loads no optimizer state): the
            # current groups' peak LRs, from the config
            state["base_lrs"] = list(self.base_lrs)
        super().load_state_dict(state)
        # The optimizer's restored group LRs (and the saved _last_lr) come from the saved
        # schedule; recompute both from the current one. The checkpoint manager loads the
        # optimizer before the scheduler, so this is the LR the next step uses.
        self._last_lr = [base * fn(self.last_epoch) for base, fn in zip(self.base_lrs, self.lr_lambdas)]
        for group, lr in zip(self.optimizer.param_groups, self._last_lr):
            group["lr"] = lr


def warmup_warning(cfg, steps: int):
    """The warning for a warm-up that does not end before the last step (``cfg.warmup_steps >= steps``),
    else None: the run then ends at ``steps / warmup_steps`` of the peak LR, never decaying to
    ``min_lr_factor`` (``WarmupStableDecay``)."""
    if cfg.warmup_steps < steps:
        return None
    end = steps / cfg.warmup_steps
    return (f"lr_scheduler.warmup_steps = {cfg.warmup_steps} >= training.steps = {steps}: the whole run is warm-up and "
            f"ends at {end:.3g} x the peak LR, not at min_lr_factor = {cfg.min_lr_factor} x peak (no decay); set "
            f"lr_scheduler.warmup_steps below {steps} for the decay (kept as configured, so the first steps' LR "
            f"does not depend on training.steps)")


def decay_steps(cfg, steps: int) -> tuple[int, int]:
    """(steps the decay gets, steps the settings ask for) of ``WarmupStableDecay``: asked for are
    ``round(decay_ratio * steps)`` (WSD) or ``steps - warmup_steps`` (warm-up then decay); it gets
    ``steps - decay_start``."""
    got = steps - WarmupStableDecay(steps, cfg.warmup_steps, cfg.decay_ratio, cfg.decay_type,
                                    cfg.min_lr_factor).decay_start
    asked = round(cfg.decay_ratio * steps) if cfg.decay_ratio is not None else steps - cfg.warmup_steps
    return got, asked


def decay_warning(cfg, steps: int):
    """The warning for a decay shorter than the settings imply, else None: a WSD decay that the
    warm-up cuts short (``warmup_steps > steps - round(decay_ratio * steps)``: the decay starts
    when the warm-up ends), or a warm-up-then-decay schedule whose decay is shorter than its
    warm-up (``steps - warmup_steps < warmup_steps``, down to a drop from the peak to the floor in
    one step). A warm-up as long as the run is ``warmup_warning``'s case."""
    if cfg.warmup_steps >= steps:
        return None
    got, asked = decay_steps(cfg, steps)
    if cfg.decay_ratio is not None and got < asked:
        return (f"lr_scheduler.decay_ratio = {cfg.decay_ratio} asks for a decay over the last {asked} of "
                f"training.steps = {steps}, but lr_scheduler.warmup_steps = {cfg.warmup_steps} ends only at step "
                f"{cfg.warmup_steps}: the decay starts there and gets {got} step{'s' if got != 1 else ''}; lower "
                f"warmup_steps to at most {steps - asked} for the full decay")
    if cfg.decay_ratio is None and got < cfg.warmup_steps:
        return (f"lr_scheduler.warmup_steps = {cfg.warmup_steps} of training.steps = {steps} leaves the decay "
                f"{got} step{'s' if got != 1 else ''} (from the peak to min_lr_factor = {cfg.min_lr_factor} x peak), "
                f"fewer than the warm-up's; lower warmup_steps or raise training.steps")
    return None


def schedule_warnings(cfg, steps: int) -> list[str]:
    """Every warning about the ``[lr_scheduler]`` settings for a run of ``steps`` steps
    (``warmup_warning``, ``decay_warning``); the trainer logs them, the dry run prints them."""
    return [w for w in (warmup_warning(cfg, steps), decay_warning(cfg, steps)) if w is not None]


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg, steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """``LambdaLR`` with ``WarmupStableDecay`` from the ``[lr_scheduler]`` section.

    Call ``scheduler.step()`` once after every optimizer step (also after a skipped
    step, so the schedule stays aligned with the step counter). Logs ``schedule_warnings``: a
    warm-up that does not end before the last step, a decay shorter than the settings imply.
    """
    for warning in schedule_warnings(cfg, steps):
        logger.warning(warning)
    fn = WarmupStableDecay(steps, cfg.warmup_steps, cfg.decay_ratio, cfg.decay_type, cfg.min_lr_factor)
    return ConfigLambdaLR(optimizer, fn)
