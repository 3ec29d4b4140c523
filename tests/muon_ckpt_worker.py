"""Muon checkpoints: exact resume on 2 ranks and resharding to 1 and 3 (tests/test_muon_checkpoint.py).

    torchrun --nproc_per_node=W tests/muon_ckpt_worker.py PHASE OUT

``two`` (W=2): run ``straight`` trains 6 steps with Muon, saving at steps 3 and 6; run ``resumed``
starts from a copy of its step-3 checkpoint and trains steps 4 to 6. ``one`` (W=1) and ``three``
(W=3): a run starts from the same step-3 copy and trains step 4. Every loading run writes the full
(gathered) model and optimizer state it loaded to OUT/state_<PHASE>.pt and its losses to
OUT/<PHASE>.json (rank 0).
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch.distributed as dist
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

sys.path.insert(0, str(Path(__file__).resolve().parent))
from helpers import read_metrics  # noqa: E402
from train_common import debug_cfg  # noqa: E402

from mhar_titan.train import Trainer  # noqa: E402

ARGS = ["--optimizer.name=Muon", "--optimizer.muon_ns_dtype=float32", "--training.local_batch_size=1",
        "--training.global_batch_size=6", "--checkpoint.enable=true", "--checkpoint.interval=3",
        "--checkpoint.keep_latest_k=0", "--debug.deterministic=true"]


def run(out: Path, name: str, steps: int, dump: str | None = None) -> list[float]:
    trainer = Trainer(debug_cfg(out, name, *ARGS, f"--training.steps={steps}"))
    if dump is not None:
        msd, osd = get_state_dict(trainer.model, trainer.optimizer,
                                  options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if dist.get_rank() == 0:
            torch.save({"model": msd, "optimizer": osd, "step": trainer.state.step}, out / f"state_{dump}.pt")
    trainer.train()
    trainer.close(destroy_process_group=False)
    return [r["loss"] for r in read_metrics(out / name) if "loss" in r]


def from_step3(out: Path, name: str) -> None:
    if dist.get_rank() == 0:
        shutil.copytree(out / "straight" / "checkpoints" / "step-3", out / name / "checkpoints" / "step-3")
    dist.barrier()


def main(phase: str, out: str) -> None:
    out = Path(out)
    dist.init_process_group("gloo")  # the Trainers reuse it
    result = {}
    if phase == "two":
        result["straight"] = run(out, "straight", 6)
        from_step3(out, "resumed")
        result["resumed"] = run(out, "resumed", 6, dump="two")
    else:
        from_step3(out, phase)
        result["continued"] = run(out, phase, 4, dump=phase)
    if dist.get_rank() == 0:
        (out / f"{phase}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
