"""torchrun worker for test_kernels_model.py (no tests here): 2-rank FSDP2 + full AC with
routing_kernel="triton" vs the single-process eager model on the full batch.

Usage: torchrun --nproc_per_node=2 tests/kernels_fsdp_worker.py OUT_DIR
Writes OUT_DIR/ok_<variant> on rank 0 for each variant that matches (fp32, 2e-4), whose every
fused routing call read the micro-batch's one depth buffer and kept its contract under FSDP2's
prefetching and the recompute (`depth_buffer_probe.check_order`: the last forward reader wrote each
gradient row first, the others added, each row was handed on after every reader, recomputed blocks
wrote the same values into their slots), and every block's FSDP2 post-backward ran inside the
backward (not deferred to the root's final callback, which would keep every block's parameters
unsharded to the end of the backward).
"""
from __future__ import annotations

import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")  # before mhar_kernels is imported (CPU)


def main(out_dir: str) -> None:
    import gc
    import pathlib

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    from test_kernels_model import VARIANTS, activation_checkpoint, build_pair, loss_and_grads, _strip
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    from depth_buffer_probe import check_order, recording
    from mhar_titan.parallel import apply_ac, apply_fsdp

    # Probes (the real functions still run): what the fused calls did with the depth buffer
    # (`recording`, per variant), and where each FSDP2 parameter group's post-backward is called from.
    in_backward: dict = {}
    post_backward = FSDPParamGroup.post_backward

    def recording_post_backward(group, *unused):
        in_backward.setdefault(id(group), torch._C._current_autograd_node() is not None)  # the first call
        return post_backward(group, *unused)

    FSDPParamGroup.post_backward = recording_post_backward

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    tokens = torch.randint(0, 512, (2 * world, 9), generator=torch.Generator().manual_seed(1))
    for variant in VARIANTS:
        eager, fused = build_pair(variant)
        loss_e, grads_e = loss_and_grads(eager, tokens)
        apply_ac(fused, activation_checkpoint("full"))
        apply_fsdp(fused, mesh, torch.float32, torch.float32, "default")
        in_backward.clear()
        local = tokens[2 * rank : 2 * rank + 2]  # equal shards: the mean of local means is the global mean
        with recording() as log:
            logits = fused(local[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), local[:, 1:].flatten())
            loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        ok = abs(total.item() / world - loss_e.item()) <= 2e-4 * abs(loss_e.item())
        worst = ("loss", abs(total.item() / world - loss_e.item()))
        try:
            counts = check_order(log)
            assert counts["buffers"] == 1 and counts["shared"] > 0, counts
        except AssertionError as error:
            ok, worst = False, ("depth buffer", str(error))
        blocks = [group for layer in fused.layers for group in layer._get_fsdp_state()._fsdp_param_groups]
        if not all(in_backward.get(id(group)) for group in blocks):
            ok, worst = False, ("post-backward outside the backward", [in_backward.get(id(g)) for g in blocks])
        for name, p in fused.named_parameters():
            g = p.grad.full_tensor()
            ge = grads_e[_strip(name)]
            err = ((g - ge).norm() / ge.norm().clamp_min(1e-6)).item()
            if err >= 2e-4:
                ok, worst = False, (name, err)
        print(f"rank {rank} variant {variant}: {'OK' if ok else 'MISMATCH'} worst={worst}", flush=True)
        if ok and rank == 0:
            (pathlib.Path(out_dir) / f"ok_{variant}").touch()
        del eager, fused, logits, loss, log
        gc.collect()
    del mesh
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
