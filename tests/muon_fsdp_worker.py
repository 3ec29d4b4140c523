"""Muon under FSDP2: a few optimizer steps of the real Trainer's parts, recorded for a
single-process reference (tests/test_muon.py).

    torchrun --nproc_per_node=W tests/muon_fsdp_worker.py OUT NAME [--section.key=value ...]

Runs ``training.steps`` steps as ``Trainer.train`` does them (``train_step``: forward, backward,
clipping; ``guarded_step``: optimizer and EMA; zero_grad; schedule step) and writes OUT/NAME.pt on rank 0: the model
arguments, the full initial weights, every step's global micro-batches (gathered from the ranks),
the losses and the full final weights. Asserts on every rank that each rank ends with the same
full weights (the gathered updates agree).
"""
from __future__ import annotations

import dataclasses
import pathlib
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from train_common import debug_cfg, full  # noqa: E402

from mhar_titan.components.batches import next_micro_batches  # noqa: E402
from mhar_titan.components.step_guard import guarded_step  # noqa: E402
from mhar_titan.optim import clean_name  # noqa: E402
from mhar_titan.train import Trainer  # noqa: E402


def gathered(t: torch.Tensor) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t)
    return torch.cat(parts)


def main(out: str, name: str, *overrides: str) -> None:
    trainer = Trainer(debug_cfg(out, name, *overrides))
    model = trainer.model
    initial = {clean_name(n): full(p) for n, p in model.named_parameters()}
    batches, losses = [], []
    it = iter(trainer.train_loader)
    for step in range(1, trainer.cfg.training.steps + 1):
        micro = next_micro_batches(it, trainer.grad_accum, trainer.device, step)
        batches.append([(gathered(x), gathered(y)) for x, y in micro])
        loss, _, _, finite = trainer.train_step(micro)
        guarded_step(trainer.optimizer, trainer.ema, finite)
        trainer.optimizer.zero_grad(set_to_none=True)
        trainer.lr_scheduler.step()
        losses.append(loss.item())
    final = {clean_name(n): full(p) for n, p in model.named_parameters()}
    mine = torch.cat([v.flatten() for v in final.values()])
    theirs = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(theirs, mine)
    assert all(torch.equal(mine, t) for t in theirs), "ranks disagree on the weights"
    if dist.get_rank() == 0:
        torch.save({"args": dataclasses.asdict(trainer.model_args), "initial": initial, "batches": batches,
                    "losses": losses, "final": final, "grad_accum": trainer.grad_accum},
                   pathlib.Path(out) / f"{name}.pt")
    trainer.close(destroy_process_group=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
