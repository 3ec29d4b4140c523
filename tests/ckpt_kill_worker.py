"""A training process killed (SIGKILL) in the middle of a checkpoint save, then restarted.

    python tests/ckpt_kill_worker.py kill OUT     # saves step 2, then hangs inside the save of step 4
    python tests/ckpt_kill_worker.py resume OUT   # must resume from step 2 and name the skipped folder

The model is the debug-flavor MHAR decoder (small vocabulary) with AdamW, a warmup
schedule and a train state; batches are seeded by step. ``kill`` swaps in a storage
writer that writes this rank's data file, creates OUT/blocked and then blocks, so the
test can SIGKILL the process while step-4 has data but no DCP metadata and no marker.
"""
from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F

from mhar_titan.checkpoint import CheckpointConfig, CheckpointManager
from mhar_titan.models.args import ModelArgs
from mhar_titan.models.model import Transformer

VOCAB, SEQ, BATCH = 512, 16, 2
ARGS = dict(vocab_size=VOCAB, max_seq_len=SEQ, residual="attn_res", routing_heads=2)


class TrainState:
    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = state["step"]


class BlockingWriter(dcp.FileSystemWriter):
    """Writes its data file, tells the test, then hangs until the process is killed."""

    def __init__(self, path, flag: Path):
        super().__init__(path)
        self.flag = flag

    def write_data(self, plan, planner):
        super().write_data(plan, planner).wait()
        self.flag.write_text("blocked")
        while True:
            time.sleep(1)


def main():
    phase, out = sys.argv[1], Path(sys.argv[2])
    logging.basicConfig(level=logging.INFO, format="[%(levelname)s] %(message)s")
    torch.manual_seed(0)
    model = Transformer(ModelArgs.from_flavor("debug", **ARGS))
    model.init_weights()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    state = TrainState()
    ckpt = CheckpointManager(CheckpointConfig(enable=True, interval=2), out, model=model, optimizer=opt,
                             lr_scheduler=sched, train_state=state, fingerprint={"model": ARGS})
    start = ckpt.load()
    for step in range(start + 1, start + 3) if phase == "resume" else (1, 2, 3, 4):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(step))
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        state.step = step
        if phase == "kill" and step == 4:  # the save of step 4 hangs inside DCP's write
            ckpt._writer_factory = lambda path: BlockingWriter(path, out / "blocked")
        ckpt.save(step)
    ckpt.close()
    if phase == "resume":
        report = {"resumed_step": start, "lr_after": sched.get_last_lr(),
                  "step4_complete": (out / "checkpoints" / "step-4" / "complete.json").is_file()}
        (out / "resume.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
