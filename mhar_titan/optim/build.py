"""The ``[optimizer]`` section's optimizer over a model's named parameter groups (``build_optimizer``),
which optimizer updates which parameter (``optimizer_split``), and the lines the start line and the dry
run print about it.

``optimizer.name = "AdamW"`` is ``torch.optim.AdamW`` over every parameter; ``"Muon"`` is
``MuonWithAdamW``: ``ShardedMuon`` for the matrices of ``optimizer.muon_groups`` and
``torch.optim.AdamW`` for every other parameter, routing parameters always among them.
``[optimizer] no_decay`` lists the groups that get weight decay 0; the paper (MHAR_SPEC 3.1) decays
all parameters.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import re
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from mhar_titan.config.sections import Optimizer
from mhar_titan.errors import ConfigError

from .groups import clean_name, never_decayed, param_group_of
from .muon import MuonWithAdamW, ShardedMuon, muon_comm_bytes, resolved_ns_dtype

logger = logging.getLogger(__name__)


def _adamw_groups(named: list[tuple[str, nn.Parameter]], groups: dict[str, str], cfg, exempt: set[str]) -> list[dict]:
    decay = [p for n, p in named if groups[n] not in cfg.no_decay and n not in exempt]
    no_decay = [p for n, p in named if groups[n] in cfg.no_decay or n in exempt]
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


def ignored_muon_warning(cfg) -> Optional[str]:
    """The warning for ``muon_*`` settings of ``[optimizer]`` that differ from their defaults while
    ``name`` is not "Muon" (they do nothing then), naming them; None when there are none.
    ``build_optimizer`` logs it once, on rank 0."""
    if cfg.name == "Muon":
        return None
    default = Optimizer()
    ignored = [f"optimizer.{f.name} = {getattr(cfg, f.name)!r}" for f in dataclasses.fields(Optimizer)
               if f.name.startswith("muon_") and getattr(cfg, f.name) != getattr(default, f.name)]
    if not ignored:
        return None
    return (f"{', '.join(ignored)} {'is' if len(ignored) == 1 else 'are'} ignored: optimizer.name = {cfg.name!r} "
            f"uses no Muon setting; set optimizer.name = \"Muon\" to use {'it' if len(ignored) == 1 else 'them'}, "
            f"or remove {'it' if len(ignored) == 1 else 'them'}")


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

    Logs ``ignored_muon_warning`` (on rank 0): ``muon_*`` settings beside ``name = "AdamW"``.

    Raises:
        ConfigError: Muon was asked for and no parameter is a matrix of ``cfg.muon_groups``.
    """
    warning = ignored_muon_warning(cfg)
    if warning is not None and (not dist.is_initialized() or dist.get_rank() == 0):
        logger.warning(warning)
    groups = param_group_of(model)
    split = optimizer_split(model, cfg)
    muon_names = {n for n, _ in split["Muon"]}
    named = [(clean_name(n), p) for n, p in model.named_parameters() if p.requires_grad]
    adamw_named = [(n, p) for n, p in named if n not in muon_names]
    if cfg.name != "Muon":
        return _adamw(_adamw_groups(adamw_named, groups, cfg, never_decayed(model)), cfg)
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
    return MuonWithAdamW(muon, _adamw(_adamw_groups(adamw_named, groups, cfg, never_decayed(model)), cfg))


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
