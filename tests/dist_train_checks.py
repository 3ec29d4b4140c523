"""2-rank checks of the trainer, run by tests/test_train.py under one torchrun launch:

    torchrun --nproc_per_node=2 tests/dist_train_checks.py OUT_DIR

Writes OUT_DIR/dist.json (per-step losses with AC none/full at local batch 4, every
rank's train state with an offline W&B run, the permuted head layout's permutation as every
rank's model routes with it and the losses of a permuted run straight and resumed, the losses,
metrics rows and per-source positions of a data-mixture run straight and resumed) and
OUT_DIR/grads.pt (full unclipped gradients of one masked step at local batch 2 x accumulation 2).
The process group is shared by the runs and destroyed by the last one (clean gloo exit).
"""
import json
import os
import pathlib
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from helpers import metric_losses, read_metrics  # noqa: E402
from train_common import MIXTURE_ARGV, debug_cfg, full_grads, masked_micro_batches, source_positions  # noqa: E402

from mhar_titan.train import Trainer  # noqa: E402
from mhar_titan.models.routing_params import RoutingSettings


def main(out):
    result = {}
    for ac in ("none", "full"):
        cfg = debug_cfg(out, f"dist_{ac}", "--training.steps=5", "--training.local_batch_size=4",
                        "--training.global_batch_size=8", f"--activation_checkpoint.mode={ac}")
        trainer = Trainer(cfg)
        trainer.train()
        trainer.close(destroy_process_group=False)
        result[f"losses_{ac}"] = metric_losses(trainer.run_dir)  # written by rank 0, read there

    # Permuted head layout (issue 16): every rank draws the same permutation from the seed, whatever
    # its global RNG, also in a resumed run.
    permuted = ["--model.routing_heads=4", "--model.routing_head_layout=permuted",
                "--model.routing_head_layout_seed=9", "--training.local_batch_size=2",
                "--training.global_batch_size=4", "--checkpoint.enable=true", "--checkpoint.interval=2"]
    for name, steps in (("perm_straight", 3), ("perm_resumed", 2), ("perm_resumed", 3)):
        torch.manual_seed(1000 + dist.get_rank())  # ranks start from different global RNG states
        torch.rand(dist.get_rank() + 7)
        trainer = Trainer(debug_cfg(out, name, f"--training.steps={steps}", *permuted))
        perms = [None] * dist.get_world_size()
        dist.all_gather_object(perms, RoutingSettings.from_args(trainer.model_args).permutation.tolist())
        result.setdefault("permutations", []).append(perms)
        trainer.train()
        trainer.close(destroy_process_group=False)
        result[f"losses_{name}"] = metric_losses(trainer.run_dir)

    # A data mixture in document sharding: a 4-step run straight, and stopped at step 2 then resumed to 4.
    mixture = [*MIXTURE_ARGV, "--training.local_batch_size=2", "--training.global_batch_size=8",
               "--checkpoint.enable=true", "--checkpoint.interval=2", "--validation.enable=true",
               "--validation.freq=2", "--validation.sequences=4"]
    for name, steps in (("mix_straight", 4), ("mix_resumed", 2), ("mix_resumed", 4)):
        trainer = Trainer(debug_cfg(out, name, f"--training.steps={steps}", *mixture))
        trainer.train()
        positions = [None] * dist.get_world_size()
        dist.all_gather_object(positions, source_positions(trainer.train_loader))
        result[f"positions_{name}"] = positions
        result[f"source_tokens_{name}"] = dict(trainer.state.settled_source_tokens())
        trainer.close(destroy_process_group=False)
        result[f"losses_{name}"] = metric_losses(trainer.run_dir)
        result[f"rows_{name}"] = read_metrics(trainer.run_dir)

    cfg = debug_cfg(out, "dist_grads", "--training.steps=1", "--training.local_batch_size=2",
                    "--training.global_batch_size=8", "--training.max_norm=0", "--metrics.enable_wandb=true")
    os.environ.setdefault("WANDB_MODE", "offline")
    trainer = Trainer(cfg)
    rank, world = dist.get_rank(), dist.get_world_size()
    # the checkpoint keeps one rank's train_state: it must be rank 0's on every rank
    states = [None] * world
    dist.all_gather_object(states, trainer.state.state_dict())
    result["train_states"] = states
    assert trainer.grad_accum == 2
    loss, norm, _, _ = trainer.train_step(masked_micro_batches(trainer, rank, world))
    loss = loss.item()
    grads = full_grads(trainer.model)
    result["masked_loss"] = loss
    result["masked_grad_norm"] = norm.item()
    if rank == 0:
        torch.save(grads, pathlib.Path(out) / "grads.pt")
        (pathlib.Path(out) / "dist.json").write_text(json.dumps(result))
    trainer.close(destroy_process_group=True)


if __name__ == "__main__":
    main(sys.argv[1])
