"""The optimizers (AdamW; Muon with AdamW) over named parameter groups, the learning-rate
schedules and grouped gradient clipping.

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

The package's modules, one job each (this module re-exports their public names, so
``from mhar_titan.optim import build_optimizer`` is the entry the trainer and the dry run use):

| module | what |
|---|---|
| ``groups`` | ``param_group_of``, ``clean_name``, the gradient-norm groups |
| ``build`` | ``build_optimizer``, ``optimizer_split``, the start line's and dry run's optimizer lines |
| ``muon`` | ``ShardedMuon``, ``MuonWithAdamW``, ``newton_schulz``, ``muon_comm_bytes`` |
| ``lr_schedule`` | ``WarmupStableDecay``, ``ConfigLambdaLR``, ``build_lr_scheduler``, the schedule warnings |
| ``clipping`` | ``clip_grad_norm_by_group`` |
"""
from .build import build_optimizer, describe_split, ignored_muon_warning, optimizer_fields, optimizer_split
from .clipping import clip_grad_norm_by_group
from .groups import GRAD_NORM_GROUPS, clean_name, grad_norm_group, param_group_of
from .lr_schedule import (ConfigLambdaLR, WarmupStableDecay, build_lr_scheduler, decay_steps, decay_warning,
                          schedule_warnings, warmup_warning)
from .muon import MuonWithAdamW, ShardedMuon, muon_comm_bytes, newton_schulz, resolved_ns_dtype

__all__ = [
    "GRAD_NORM_GROUPS", "ConfigLambdaLR", "MuonWithAdamW", "ShardedMuon", "WarmupStableDecay", "build_lr_scheduler",
    "build_optimizer", "clean_name", "clip_grad_norm_by_group", "decay_steps", "decay_warning", "describe_split",
    "grad_norm_group", "ignored_muon_warning", "muon_comm_bytes", "newton_schulz", "optimizer_fields", "optimizer_split", "param_group_of",
    "resolved_ns_dtype", "schedule_warnings", "warmup_warning",
]
