"""2-rank FSDP2 check of grouped routing, run by tests/test_grouped.py:

    torchrun --nproc_per_node=2 tests/grouped_fsdp_worker.py OUT_DIR

One masked, unclipped step of debug_mhar (local batch 2 x accumulation 2 per rank) with per-call
routing, and with routing_group_size 3 under activation checkpointing none and full (eager), and
full with the fused phase 1 (routing_kernel triton, through TRITON_INTERPRET=1 on CPU); rank 0
writes OUT_DIR/grouped.pt: {run: (loss, {parameter name: full gradient, fp64})} and, for the fused
run, "buffer": `depth_buffer_probe.check_order`'s counts on rank 0 (one depth buffer per
micro-batch, its contract kept under FSDP2 and the recompute), or the assertion it raised.
"""
import pathlib
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from depth_buffer_probe import check_order, recording  # noqa: E402
from train_common import debug_cfg, full_grads, masked_micro_batches  # noqa: E402

from mhar_titan.train import Trainer  # noqa: E402

RUNS = (("1", "none", "eager"), ("3", "none", "eager"), ("3", "full", "eager"), ("3", "full", "triton"))


def main(out):
    results, trainers = {}, []  # trainers stay referenced: masked_micro_batches keys iterators by id
    for k, (g, ac, kernel) in enumerate(RUNS):
        name = f"g{g}_{ac}" + ("" if kernel == "eager" else f"_{kernel}")
        cfg = debug_cfg(out, name, "--training.steps=1", "--training.local_batch_size=2",
                        "--training.global_batch_size=8", "--training.max_norm=0",
                        f"--model.routing_group_size={g}", f"--activation_checkpoint.mode={ac}",
                        f"--model.routing_kernel={kernel}")
        trainer = Trainer(cfg)
        trainers.append(trainer)
        rank, world = dist.get_rank(), dist.get_world_size()
        assert trainer.grad_accum == 2 and trainer.model.plan.group_size == int(g)
        if kernel == "triton":  # the fused phase 1 runs here (not the eager fallback)
            import mhar_kernels

            margs = trainer.model.args
            assert mhar_kernels.can_run(torch.device("cpu"), margs.dim, margs.resolved_routing_heads)
        with recording() as log:  # a probe: the real functions run
            loss, _, _, _ = trainer.train_step(masked_micro_batches(trainer, rank, world))
        if kernel == "triton":
            try:
                results["buffer"] = check_order(log)
            except AssertionError as error:
                results["buffer"] = str(error)
        del log
        loss = loss.item()
        grads = {name.replace("._checkpoint_wrapped_module", ""): grad
                 for name, grad in full_grads(trainer.model).items()}
        results[name] = (loss, grads)
        trainer.close(destroy_process_group=k == len(RUNS) - 1)
        if rank == 0 and k == len(RUNS) - 1:
            torch.save(results, pathlib.Path(out) / "grouped.pt")


if __name__ == "__main__":
    main(sys.argv[1])
