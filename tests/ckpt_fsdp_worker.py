"""Checkpoint checks on a debug-flavor MHAR model under FSDP2 (gloo), one phase per launch.

    torchrun --nproc_per_node=W tests/ckpt_fsdp_worker.py PHASE OUT_DIR

Phases (run in this order by tests/test_checkpoint_dist.py):
  save2   (W=2) SIGUSR1 to rank 1 only: should_stop() is true on both ranks. Then
          train 3 steps with activation-checkpointed blocks, save step 3 to
          OUT/a and dump the full model+optimizer state; then at step 4 a sync
          save to OUT/sync and an async save (slow writer, dedicated gloo group) to
          OUT/a while steps 5-6 run; writes OUT/save2.json with what it saw.
  load1   (W=1) resume OUT/a at step 3, compare every tensor with the dump; save
          step 3 at W=1 to OUT/b with its own dump.
  load2   (W=2) resume OUT/b and compare with its dump.
  kill    (no torchrun) save step 2, then block inside the save of step 4 (the test
          SIGKILLs the process once OUT/blocked exists).
  resume  (no torchrun) restart after the kill: must resume from step 2.
"""
from __future__ import annotations

import gc
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from mhar_titan.checkpoint import CheckpointConfig, CheckpointManager
from mhar_titan.preemption import PreemptionHandler
from mhar_titan.models.args import ModelArgs
from mhar_titan.models.model import Transformer

VOCAB, SEQ, GLOBAL_BATCH = 512, 16, 4
ARGS = dict(vocab_size=VOCAB, max_seq_len=SEQ, residual="attn_res", routing_heads=2)


class TrainState:
    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = state["step"]


class SlowWriter(dcp.FileSystemWriter):
    """Sleeps before writing its shard, so an async save stays in flight for a while."""

    def __init__(self, path, delay):
        super().__init__(path)
        self.delay = delay

    def write_data(self, plan, planner):
        time.sleep(self.delay)
        return super().write_data(plan, planner)


class BlockingWriter(dcp.FileSystemWriter):
    """Writes part of the checkpoint, tells the test, then hangs until it is killed."""

    def __init__(self, path, flag: Path):
        super().__init__(path)
        self.flag = flag

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)
        future.wait()
        self.flag.write_text("blocked")
        while True:
            time.sleep(1)


def build(world: int, seed: int = 0):
    torch.manual_seed(seed)
    model = Transformer(ModelArgs.from_flavor("debug", **ARGS))
    model.init_weights()
    if world > 0:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for i, block in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(block)
            fully_shard(model.layers[i], mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    return model, opt, sched, TrainState()


def train_step(model, opt, sched, state, rank, world):
    g = torch.Generator().manual_seed(1000 + state.step)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g)
    local = tokens.chunk(world)[rank]
    logits = model(local[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), local[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sched.step()
    state.step += 1


def full_state(model, opt) -> dict:
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"model": msd, "optimizer": osd}


def tensors(tree, prefix=""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from tensors(v, f"{prefix}{k}.")
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from tensors(v, f"{prefix}{i}.")
    elif isinstance(tree, torch.Tensor):
        yield prefix[:-1], tree


def compare_full(got: dict, want: dict) -> list[str]:
    """Names of tensors that are not bitwise equal (empty list: all equal)."""
    g, w = dict(tensors(got)), dict(tensors(want))
    bad = sorted(set(g) ^ set(w))
    bad += [k for k in w if k in g and not torch.equal(g[k], w[k])]
    return bad


def manager(out: Path, parts, **cfg):
    model, opt, sched, state = parts
    writer = cfg.pop("writer", None)
    return CheckpointManager(CheckpointConfig(enable=True, **cfg), out, model=model, optimizer=opt,
                             lr_scheduler=sched, train_state=state, fingerprint={"model": ARGS},
                             storage_writer_factory=writer)


def main():
    phase, out = sys.argv[1], Path(sys.argv[2])
    logging.basicConfig(level=logging.INFO, format=f"[%(levelname)s] %(message)s")
    torch.set_num_threads(1)
    if phase in ("kill", "resume"):
        return single_process(phase, out)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    parts = build(world)
    model, opt, sched, state = parts
    report = {}
    if phase == "save2":
        # Only rank 1 is signalled; should_stop() must answer yes on rank 0 as well.
        preempt = PreemptionHandler()
        report["stop_before_signal"] = preempt.should_stop()
        if rank == 1:
            os.kill(os.getpid(), signal.SIGUSR1)
        report["stop_after_signal"] = preempt.should_stop()
        report["rank0_received"] = preempt.received is not None
        preempt.restore()
        ckpt = manager(out / "a", parts, interval=1000)
        for _ in range(3):
            train_step(*parts, rank, world)
        ckpt.save(3, force=True)
        dump = full_state(model, opt)
        if rank == 0:
            torch.save(dump, out / "a_full.pt")
            report["lr_at_3"] = sched.get_last_lr()
        train_step(*parts, rank, world)
        sync = manager(out / "sync", parts, interval=4)
        sync.save(4)
        slow = CheckpointManager(
            CheckpointConfig(enable=True, interval=4, async_mode="async"), out / "a", model=model, optimizer=opt,
            lr_scheduler=sched, train_state=state, fingerprint={"model": ARGS},
            storage_writer_factory=lambda p: SlowWriter(p, delay=3.0))
        started = time.perf_counter()
        slow.save(4)
        in_flight_during = []
        for _ in range(2):  # steps 5 and 6 run while step 4 is being written
            train_step(*parts, rank, world)
            in_flight_during.append(not slow._in_flight[3].done())
        report["steps_done_in_flight"] = in_flight_during
        report["seconds_before_close"] = time.perf_counter() - started
        slow.close()
        report["step4_complete"] = (out / "a" / "checkpoints" / "step-4" / "complete.json").is_file()
        report["keys"] = sorted(dict(tensors(get_state_dict(model, opt)[0])))
    elif phase in ("load1", "load2"):
        src = out / ("a" if phase == "load1" else "b")
        ckpt = manager(src, parts, load_step=3)
        report["loaded_step"] = ckpt.load()
        want = torch.load(src / ".." / f"{src.name}_full.pt", weights_only=False)
        report["mismatched"] = compare_full(full_state(model, opt), want)
        report["n_tensors"] = len(dict(tensors(want)))
        report["train_state_step"] = state.step
        report["lr"] = sched.get_last_lr()
        if phase == "load1":
            manager(out / "b", parts, interval=1000).save(3, force=True)
            dump = full_state(model, opt)
            if rank == 0:
                torch.save(dump, out / "b_full.pt")
    if rank == 0:
        (out / f"{phase}.json").write_text(json.dumps(report))
    del model, opt, sched, parts
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def single_process(phase: str, out: Path):
    parts = build(world=0)
    if phase == "kill":
        ckpt = manager(out, parts, interval=2, writer=None)
        flag = out / "blocked"
        for step in (1, 2, 3, 4):
            train_step(*parts, 0, 1)
            if step == 4:  # the save of step 4 hangs inside DCP's write
                ckpt._writer_factory = lambda p: BlockingWriter(p, flag)
            ckpt.save(step)
    else:
        ckpt = manager(out, parts, interval=2)
        step = ckpt.load()
        report = {"resumed_step": step, "train_state_step": parts[3].step}
        for s in (step + 1, step + 2):
            train_step(*parts, 0, 1)
            ckpt.save(s)
        ckpt.close()
        report["step4_complete"] = (out / "checkpoints" / "step-4" / "complete.json").is_file()
        (out / "resume.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
