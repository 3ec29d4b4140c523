"""torchrun worker for test_compile_whole.py (no tests here): 2-rank FSDP2 + full AC + whole-model
compile (aot_eager) vs the single-process eager model, 5 AdamW steps.

FSDP2 averages gradients over the ranks, so the FSDP run of the mean loss over both ranks' rows
is the eager run on all rows (each rank's summed loss is scaled by 2 / all target tokens).

Usage: torchrun --nproc_per_node=2 tests/compile_fsdp_worker.py OUT_DIR
Writes OUT_DIR/ok_<family> on rank 0 for each family whose losses match (fp32, 1e-5).
"""
from __future__ import annotations

import gc
import pathlib
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from test_compile_whole import build  # noqa: E402

from mhar_titan.components.loss import build_loss_fn  # noqa: E402
from mhar_titan.config import ActivationCheckpoint, Compile  # noqa: E402
from mhar_titan.parallel import apply_ac, apply_fsdp, compile_whole_model  # noqa: E402


def main(out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    loss_fn = build_loss_fn(Compile(), 1e-4, "chunked", chunk_tokens=64)
    for family in ("baseline", "mhar H=8"):
        runs = []
        for sharded in (False, True):
            model = build(family)
            if sharded:
                apply_ac(model, ActivationCheckpoint(mode="full"))
                apply_fsdp(model, mesh, torch.float32, torch.float32, "default")
                compile_whole_model(model, "aot_eager")
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            g, losses = torch.Generator().manual_seed(1), []
            for _ in range(5):
                x = torch.randint(0, 128, (2 * world, 12), generator=g)
                y = torch.roll(x, -1, 1)
                rows = slice(2 * rank, 2 * rank + 2) if sharded else slice(None)
                loss = model(x[rows], y[rows], loss_fn=loss_fn) / y.numel() * (world if sharded else 1)
                loss.backward()
                opt.step()
                opt.zero_grad()
                total = loss.detach().clone()
                if sharded:
                    dist.all_reduce(total)
                    total /= world
                losses.append(total.item())
            runs.append(losses)
            del model, opt
            gc.collect()
        eager, fsdp = runs
        ok = all(abs(a - b) <= 1e-5 * abs(a) + 1e-6 for a, b in zip(eager, fsdp))
        print(f"rank {rank} {family}: {'OK' if ok else 'MISMATCH'} eager={eager} fsdp={fsdp}", flush=True)
        if ok and rank == 0:
            (pathlib.Path(out_dir) / f"ok_{family.replace(' ', '_')}").touch()
    del mesh
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
