"""The optimizers (AdamW; Muon with AdamW) over named parameter groups, and the learning-rate schedules.

Parameter groups (``param_group_of``): ``routing`` (everything under the
top-level ``model.routing`` module: pseudo-queries, key norms, gates, null
source), ``embeddings`` (``tok_embeddings``), ``norms`` (RMSNorm/LayerNorm
weights), ``biases``, ``head`` (the untied LM head ``output``) and ``other`` (the
hidden matrices). ``[optimizer] no_decay`` lists the groups that get weight decay 0;
the paper (MHAR_SPEC 3.1) decays all parameters.

Optimizers (``build_optimizer``): ``optimizer.name = "AdamW"`` is ``torch.optim.AdamW``
over every parameter; ``"Muon"`` is ``MuonWithAdamW``: ``ShardedMuon`` (``torch.optim.Muon``
made correct for FSDP2 shards) for the matrices of ``optimizer.muon_groups`` and
``torch.optim.AdamW`` for every other parameter, routing parameters always among them.

Schedule (MHAR_SPEC 3.1; TorchTitan's warmup-stable-decay): linear warmup to the
peak over ``warmup_steps``, an optional stable phase, then a decay (linear,
sqrt or cosine) to ``min_lr_factor * peak`` at the last step (a warm-up as long as the run
or longer ends the run inside the warm-up instead, with a warning: ``WarmupStableDecay``;
a decay cut short by the warm-up is warned about too: ``schedule_warnings``).
"""
from __future__ import annotations

import logging
import math
import re
import types
from typing import Optional

import torch
from torch import nn
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

from mhar_titan.config import PARAM_GROUPS
from mhar_titan.errors import ConfigError

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
        elif n.startswith("output."):
            groups[n] = "head"
        else:
            groups[n] = "other"
    assert set(groups.values()) <= set(PARAM_GROUPS)
    return groups


def _adamw_groups(named: list[tuple[str, nn.Parameter]], groups: dict[str, str], cfg) -> list[dict]:
    decay = [p for n, p in named if groups[n] not in cfg.no_decay]
    no_decay = [p for n, p in named if groups[n] in cfg.no_decay]
    out = [{"name": "decay", "params": decay, "weight_decay": cfg.weight_decay}] if decay else []
    if no_decay:
        out.append({"name": "no_decay", "params": no_decay, "weight_decay": 0.0})
    return out


def _adamw(param_groups: list[dict], cfg) -> torch.optim.AdamW:
    impl = {"foreach": dict(foreach=True), "fused": dict(fused=True), "for-loop": dict(foreach=False)}
    return torch.optim.AdamW(
        param_groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **impl[cfg.implementation]
    )


def optimizer_split(model: nn.Module, cfg) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
    """Which parameters each optimizer updates: ``{"Muon": [(clean name, shape)], "AdamW": [...]}``
    (``cfg.name = "AdamW"``: everything under "AdamW", "Muon" empty). Frozen parameters are left out.

    Muon takes the 2-D parameters whose ``param_group_of`` group is in ``cfg.muon_groups``; the
    routing group is never among them. Works on a meta-device model (the dry run)."""
    groups = param_group_of(model)
    split: dict[str, list] = {"Muon": [], "AdamW": []}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        n = clean_name(name)
        muon = cfg.name == "Muon" and groups[n] in cfg.muon_groups and groups[n] != "routing" and p.ndim == 2
        split["Muon" if muon else "AdamW"].append((n, tuple(p.shape)))
    return split


def build_optimizer(model: nn.Module, cfg) -> torch.optim.Optimizer:
    """The ``[optimizer]`` section's optimizer over ``model``'s trainable parameters.

    Args:
        model: the (possibly FSDP-sharded) model; DTensor parameters are fine.
        cfg: the ``[optimizer]`` section (``mhar_titan.config.Optimizer``).

    Returns:
        ``name = "AdamW"``: ``torch.optim.AdamW`` with up to two param groups, named in
        ``group["name"]`` ("decay", "no_decay"). ``name = "Muon"``: ``MuonWithAdamW`` whose groups
        are "muon" (and "muon_no_decay" when ``no_decay`` names a Muon group), then AdamW's
        "decay" and "no_decay" (``optimizer_split`` says which parameter is where).

    Raises:
        ConfigError: Muon was asked for and no parameter is a matrix of ``cfg.muon_groups``.
    """
    groups = param_group_of(model)
    split = optimizer_split(model, cfg)
    muon_names = {n for n, _ in split["Muon"]}
    named = [(clean_name(n), p) for n, p in model.named_parameters() if p.requires_grad]
    adamw_named = [(n, p) for n, p in named if n not in muon_names]
    if cfg.name != "Muon":
        return _adamw(_adamw_groups(adamw_named, groups, cfg), cfg)
    muon_named = [(n, p) for n, p in named if n in muon_names]
    if not muon_named:
        raise ConfigError(f"optimizer.name = \"Muon\" but no parameter of this model is a matrix of "
                          f"optimizer.muon_groups = {cfg.muon_groups} (a tied LM head is the embedding); add \"other\"")
    decay = cfg.weight_decay if cfg.muon_weight_decay is None else cfg.muon_weight_decay
    muon_groups = [{"name": "muon", "params": [p for n, p in muon_named if groups[n] not in cfg.no_decay],
                    "weight_decay": decay},
                   {"name": "muon_no_decay", "params": [p for n, p in muon_named if groups[n] in cfg.no_decay],
                    "weight_decay": 0.0}]
    device = muon_named[0][1].device
    ns_dtype = cfg.muon_ns_dtype if cfg.muon_ns_dtype != "auto" else (
        "bfloat16" if device.type == "cuda" else "float32")
    muon = ShardedMuon(
        [g for g in muon_groups if g["params"]], lr=cfg.lr if cfg.muon_lr is None else cfg.muon_lr,
        weight_decay=decay, momentum=cfg.muon_momentum, nesterov=cfg.muon_nesterov,
        ns_coefficients=tuple(float(c) for c in cfg.muon_ns_coefficients), eps=cfg.muon_eps,
        ns_steps=cfg.muon_ns_steps, adjust_lr_fn=cfg.muon_lr_scale, ns_dtype=ns_dtype)
    return MuonWithAdamW(muon, _adamw(_adamw_groups(adamw_named, groups, cfg), cfg))


# --------------------------------------------------------------------------- Muon


def newton_schulz(update: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float,
                  dtype: torch.dtype) -> torch.Tensor:
    """Approximate orthogonalisation ``U V^T`` of a matrix ``update = U S V^T`` (its zeroth power).

    The quintic Newton-Schulz iteration of Muon (Keller Jordan, "Muon: an optimizer for hidden
    layers in neural networks", 2024; torch.optim.Muon): with ``X_0 = G / max(||G||_F, eps)``
    (``G`` transposed to be wide: rows <= cols), ``steps`` times

        A = X X^T,   X <- a X + (b A + c A A) X,

    which maps every singular value of ``X_0`` into about [0.5, 1.5] (the default coefficients
    trade exact convergence for a steep slope at zero); transposed back at the end.

    Args:
        update: (rows, cols) matrix, any float dtype.
        coefficients: (a, b, c).
        steps: iterations, 1 to 99.
        eps: floor of the Frobenius norm.
        dtype: the arithmetic: ``torch.bfloat16`` runs torch's own iteration
            (``torch.optim._muon._zeropower_via_newtonschulz``, bitwise torch.optim.Muon's); any other
            dtype runs the same iteration in that dtype.

    Returns:
        (rows, cols) matrix in ``dtype``.
    """
    if dtype == torch.bfloat16:
        return _zeropower_via_newtonschulz(update, coefficients, steps, eps)
    a, b, c = coefficients
    x = update.to(dtype)
    wide = x.size(0) <= x.size(1)
    x = x if wide else x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x if wide else x.T


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole matrix of a sharded DTensor (an all-gather over its mesh); a plain tensor as is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _like(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``full`` laid out like ``param``: this rank's slice of it when ``param`` is a DTensor (no
    communication: every rank holds ``full``), else ``full``."""
    if not hasattr(param, "device_mesh"):
        return full
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)


class ShardedMuon(torch.optim.Muon):
    """``torch.optim.Muon`` for FSDP2-sharded (DTensor ``Shard(0)``) as well as plain matrices.

    Per matrix ``W`` (rows, cols) with gradient ``g``, step size ``lr`` and weight decay ``wd``
    (torch.optim.Muon's algorithm; Jordan 2024; Liu et al., "Muon is scalable for LLM training",
    arXiv:2502.16982, section 2):

        B <- mu B + (1 - mu) g                        momentum (B = ``momentum_buffer``)
        U = (1 - mu) g + mu B   (Nesterov)  or  B
        O = NS(U)                                      ``newton_schulz``, in ``ns_dtype``
        W <- (1 - lr wd) W - lr s(rows, cols) O        decoupled weight decay, then the step

    with ``s = 0.2 sqrt(max(rows, cols))`` (``adjust_lr_fn = "match_rms_adamw"``: the update's
    RMS matches AdamW's, so AdamW's LR and weight decay carry over; Liu et al. section 2.2) or
    ``sqrt(max(1, rows / cols))`` (``"original"``, Jordan's).

    Under FSDP2 each rank holds a row slice of ``W``, ``g`` and ``B``; Newton-Schulz needs the
    whole ``U``. Every rank gathers the whole ``U`` of every matrix (one all-gather per matrix,
    in ``ns_dtype``: torch's bfloat16 iteration starts by rounding to bfloat16, so gathering
    bfloat16 loses nothing), runs the iteration on it and keeps its own slice of ``O``: the
    orthogonalisation is computed redundantly on every rank of a shard group rather than
    assigned round-robin to one rank and scattered back. Chosen because it needs no second
    collective, no owner bookkeeping and no padding for rows that do not divide evenly (DTensor
    gathers and slices any ``Shard(0)`` layout, also the ``(Replicate, Shard)`` of HSDP), and
    every rank holds the same ``O``, so the shards cannot drift apart. The price: each rank runs
    the Newton-Schulz work of the whole model (about ``6 steps (rows cols min(rows, cols) +
    min(rows, cols)^3)`` FLOPs per matrix: small beside a training step at these shapes) and
    receives ``(W - 1) / W`` of every matrix per step (``muon_comm_bytes``), where round-robin
    would receive about ``2 / W`` of it. Momentum, weight decay and the step stay on the shards.

    Args:
        params, lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps,
        adjust_lr_fn: as ``torch.optim.Muon``.
        ns_dtype: "bfloat16" (torch.optim.Muon's arithmetic) or "float32".

    Raises:
        ValueError: a parameter that is not 2-D (torch.optim.Muon's check), or a bad setting.
    """

    def __init__(self, params, *, ns_dtype: str = "bfloat16", **kwargs):
        if ns_dtype not in ("bfloat16", "float32"):
            raise ValueError(f"ns_dtype must be 'bfloat16' or 'float32', got {ns_dtype!r}")
        super().__init__(params, **kwargs)
        self.defaults["ns_dtype"] = ns_dtype
        for group in self.param_groups:
            group.setdefault("ns_dtype", ns_dtype)

    @torch.no_grad()
    def step(self, closure=None):
        """One Muon step on every matrix with a gradient (see the class docstring); call it on
        every rank of the mesh (it all-gathers)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, buffers = [], [], []
            self._init_group(group, params, grads, buffers)
            lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
            dtype = getattr(torch, group["ns_dtype"])
            for p, g, buf in zip(params, grads, buffers):
                buf.lerp_(g, 1 - mu)
                update = g.lerp(buf, mu) if group["nesterov"] else buf
                ortho = newton_schulz(_full(update.to(dtype)), group["ns_coefficients"], group["ns_steps"],
                                      group["eps"], dtype)
                p.mul_(1 - lr * wd)
                p.add_(_like(ortho, p), alpha=-_adjust_lr(lr, group["adjust_lr_fn"], p.shape))
        return loss


class MuonWithAdamW(torch.optim.Optimizer):
    """One optimizer over two: ``ShardedMuon`` for the hidden matrices, ``torch.optim.AdamW`` for
    the rest (the hybrid Muon is run as: Jordan 2024; Liu et al. 2025, section 2.3).

    Its ``param_groups`` are Muon's groups then AdamW's (the same dicts: an LR schedule sets
    both), and one ``state`` dict holds both optimizers' per-parameter state (Muon's
    ``momentum_buffer``; AdamW's ``step``, ``exp_avg``, ``exp_avg_sq``), so ``state_dict`` /
    ``load_state_dict`` and DCP's ``get_state_dict`` see one ordinary optimizer, keyed by
    parameter name and sharded like the model. ``step`` runs Muon, then AdamW.
    """

    def __init__(self, muon: ShardedMuon, adamw: torch.optim.AdamW):
        self.muon, self.adamw = muon, adamw
        super().__init__(muon.param_groups + adamw.param_groups, defaults={})
        self._share()

    def _share(self) -> None:
        k = len(self.muon.param_groups)
        self.muon.param_groups, self.adamw.param_groups = self.param_groups[:k], self.param_groups[k:]
        self.muon.state = self.adamw.state = self.state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.muon.step()
        self.adamw.step()
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._share()  # loading replaced the group dicts and the state dict


def _element_bytes(dtype: str) -> int:
    return {"bfloat16": 2, "float32": 4}[dtype]


def resolved_ns_dtype(cfg, device_type: str) -> str:
    """``optimizer.muon_ns_dtype`` with "auto" resolved for ``device_type`` (bfloat16 on CUDA)."""
    if cfg.muon_ns_dtype != "auto":
        return cfg.muon_ns_dtype
    return "bfloat16" if device_type == "cuda" else "float32"


def muon_comm_bytes(shapes: list[tuple[int, ...]], shard_world: int, ns_dtype: str) -> int:
    """Bytes each rank receives per optimizer step for Muon's all-gathers (modelled): every
    matrix's update in ``ns_dtype``, less the rank's own slice, ``numel (W - 1) / W`` elements
    for ``W = shard_world`` FSDP ranks (a ring all-gather sends as many). 0 on one rank."""
    numel = sum(math.prod(s) for s in shapes)
    return numel * (shard_world - 1) * _element_bytes(ns_dtype) // shard_world


def _pattern(name: str) -> str:
    return re.sub(r"^layers\.\d+\.", "layers.*.", name)


def describe_split(split: dict[str, list[tuple[str, tuple[int, ...]]]]) -> list[str]:
    """Lines saying which parameters each optimizer updates: per optimizer the tensor and element
    counts, then each name pattern (layer index as ``*``) with its count and shape."""
    lines = []
    for opt, entries in split.items():
        if not entries:
            continue
        numel = sum(math.prod(s) for _, s in entries)
        lines.append(f"{opt}: {len(entries)} tensors, {numel:,} parameters")
        patterns: dict[str, list] = {}
        for name, shape in entries:
            patterns.setdefault(_pattern(name), []).append(shape)
        for pattern, shapes in patterns.items():
            dims = sorted({"x".join(map(str, s)) for s in shapes})
            lines.append(f"  {pattern:<40} {len(shapes):>3} x {', '.join(dims)}")
    return lines


def optimizer_fields(model: nn.Module, cfg, shard_world: int, device_type: str) -> list[str]:
    """The console fields of the optimizer line: which optimizer updates how many tensors and
    parameters, and (Muon) the Newton-Schulz arithmetic and the modelled all-gather bytes per step
    and rank (``muon_comm_bytes``)."""
    from mhar_titan.console import count

    split = optimizer_split(model, cfg)
    fields = ["optimizer"]
    for opt, kind in (("Muon", "matrices"), ("AdamW", "tensors")):
        if split[opt]:
            numel = sum(math.prod(s) for _, s in split[opt])
            fields.append(f"{opt} {len(split[opt])} {kind}, {count(numel)} params")
    if split["Muon"]:
        dtype = resolved_ns_dtype(cfg, device_type)
        comm = muon_comm_bytes([s for _, s in split["Muon"]], shard_world, dtype)
        fields.append(f"Newton-Schulz {cfg.muon_ns_steps} x {dtype}")
        fields.append(f"all-gather {comm / 2**20:.2f} MiB/step (modelled)")
    return fields


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
