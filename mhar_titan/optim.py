"""AdamW with named parameter groups, and the learning-rate schedules.

Parameter groups (``param_group_of``): ``routing`` (everything under the
top-level ``model.routing`` module: pseudo-queries, key norms, gates, null
source), ``embeddings`` (``tok_embeddings``), ``norms`` (RMSNorm/LayerNorm
weights), ``biases`` and ``other``. ``[optimizer] no_decay`` lists the groups
that get weight decay 0; the paper (MHAR_SPEC 3.1) decays all parameters.

Schedule (MHAR_SPEC 3.1; TorchTitan's warmup-stable-decay): linear warmup to the
peak over ``warmup_steps``, an optional stable phase, then a decay (linear,
sqrt or cosine) to ``min_lr_factor * peak`` at the last step (a warm-up as long as the run
or longer ends the run inside the warm-up instead, with a warning: ``WarmupStableDecay``).
"""
from __future__ import annotations

import logging
import math
import types

import torch
from torch import nn

from mhar_titan.config import PARAM_GROUPS

# Wrappers that insert a path component into parameter names.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")

logger = logging.getLogger(__name__)


def clean_name(name: str) -> str:
    """Parameter name without the components added by checkpoint_wrapper / torch.compile."""
    for p in _WRAPPER_PREFIXES:
        name = name.replace(p, "")
    return name


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, (nn.RMSNorm, nn.LayerNorm)) or type(module).__name__.endswith("Norm")


def param_group_of(model: nn.Module) -> dict[str, str]:
    """Map every parameter's clean name to one of ``PARAM_GROUPS``.

    Routing wins over the other groups (the routing key norms belong to ``routing``).
    """
    norm_params = set()
    for mname, module in model.named_modules():
        if _is_norm(module):
            for pname, _ in module.named_parameters(recurse=False):
                norm_params.add(clean_name(f"{mname}.{pname}" if mname else pname))
    groups = {}
    for name, _ in model.named_parameters():
        n = clean_name(name)
        if n.startswith("routing."):
            groups[n] = "routing"
        elif n.startswith("tok_embeddings."):
            groups[n] = "embeddings"
        elif n in norm_params:
            groups[n] = "norms"
        elif n.endswith(".bias"):
            groups[n] = "biases"
        else:
            groups[n] = "other"
    return groups


def build_optimizer(model: nn.Module, cfg) -> torch.optim.AdamW:
    """AdamW over ``model``'s parameters with ``cfg.no_decay`` groups at weight decay 0.

    Args:
        model: the (possibly FSDP-sharded) model; DTensor parameters are fine.
        cfg: the ``[optimizer]`` section (``mhar_titan.config.Optimizer``).

    Returns:
        ``torch.optim.AdamW`` with up to two param groups, named in ``group["name"]``
        ("decay", "no_decay").
    """
    groups = param_group_of(model)
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if groups[clean_name(name)] in cfg.no_decay else decay).append(p)
    param_groups = [{"name": "decay", "params": decay, "weight_decay": cfg.weight_decay}]
    if no_decay:
        param_groups.append({"name": "no_decay", "params": no_decay, "weight_decay": 0.0})
    impl = {"foreach": dict(foreach=True), "fused": dict(fused=True), "for-loop": dict(foreach=False)}
    return torch.optim.AdamW(
        param_groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **impl[cfg.implementation]
    )


class WarmupStableDecay:
    """LR multiplier at optimizer step ``s`` (1-based), for ``LambdaLR``.

    ``s <= warmup``: ``s / warmup``. Stable (1.0) until ``decay_start``, which is
    ``warmup`` when ``decay_ratio`` is None (warmup + decay) and
    ``steps - round(decay_ratio * steps)`` otherwise (WSD). Then, with
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


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg, steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """``LambdaLR`` with ``WarmupStableDecay`` from the ``[lr_scheduler]`` section.

    Call ``scheduler.step()`` once after every optimizer step (also after a skipped
    step, so the schedule stays aligned with the step counter). Logs ``warmup_warning``
    when the warm-up does not end before the last step.
    """
    warning = warmup_warning(cfg, steps)
    if warning is not None:
        logger.warning(warning)
    fn = WarmupStableDecay(steps, cfg.warmup_steps, cfg.decay_ratio, cfg.decay_type, cfg.min_lr_factor)
    return ConfigLambdaLR(optimizer, fn)


# --------------------------------------------------------------------------- gradient norms

GRAD_NORM_GROUPS = ("routing_query", "routing_gate", "rest")


def grad_norm_group(clean: str) -> str:
    """Logging group of a parameter: routing pseudo-queries, delta gates (alpha), or the rest."""
    if clean.startswith("routing."):
        leaf = clean.rsplit(".", 1)[-1]
        if "query" in clean:
            return "routing_query"
        if leaf == "alpha" or ".alpha" in clean:
            return "routing_gate"
    return "rest"


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


@torch.no_grad()
def clip_grad_norm_by_group(model: nn.Module, max_norm: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Global L2 gradient norm, its split by ``GRAD_NORM_GROUPS``, and clipping.

    Works on FSDP2-sharded (DTensor) gradients: the squared norms of the local
    shards are summed over ranks with one all-reduce (of a vector of group sums).
    Gradients are scaled by ``min(1, max_norm / (total + 1e-6))`` when
    ``max_norm > 0`` and the total is finite (a non-finite step is skipped by the
    caller, so it is left untouched). Nothing is read back to the host: the choice is a
    ``torch.where`` on the device, so the call is safe inside a captured or asynchronous step.

    Returns:
        (total norm, {group: norm} for the groups that have gradients) as fp32 scalar
        tensors on the gradients' device.
    """
    import torch.distributed as dist

    grads = {g: [] for g in GRAD_NORM_GROUPS}
    sharded = False
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        sharded |= hasattr(p.grad, "to_local")
        grads[grad_norm_group(clean_name(name))].append(_local(p.grad))
    device = next((gs[0].device for gs in grads.values() if gs), torch.device("cpu"))
    sq = torch.stack([
        torch.stack([g.float().pow(2).sum() for g in gs]).sum() if gs else torch.zeros((), device=device)
        for gs in grads.values()
    ])
    if sharded and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(sq)
    # Groups without parameters (gates exist only in delta mode) are left out.
    norms = {g: sq[i].sqrt() for i, g in enumerate(GRAD_NORM_GROUPS) if grads[g]}
    total = sq.sum().sqrt()
    flat = [g for gs in grads.values() for g in gs]
    if max_norm > 0 and flat:
        # Decided on the device (no host read): a non-finite total leaves the gradients as they are.
        coef = torch.where(torch.isfinite(total), torch.clamp(max_norm / (total + 1e-6), max=1.0), 1.0)
        torch._foreach_mul_(flat, coef.to(flat[0].dtype))
    return total, norms
