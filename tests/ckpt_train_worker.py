"""End-to-end checkpoint checks with the real Trainer, several runs per launch.

    torchrun --nproc_per_node=W tests/ckpt_train_worker.py PHASE OUT CORPUS

Each run is ``Trainer(load_config(None, argv))`` exactly as ``train.py`` builds it,
then ``train()``; runs of one launch share the process group (the Trainer reuses
an initialised one), so many resumes cost one interpreter start. Saves at extra
steps are requested through ``CheckpointManager.save(..., force=True)``: the
interval stays 1000, so the LR schedule and the data order are those of a plain
run. Results (JSONL rows, what was loaded) go to OUT/PHASE.json on rank 0; the
assertions are in tests/test_checkpoint_e2e.py.

Phases, in order: ``one`` (W=1), ``two`` (W=2), ``three`` (W=1).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import threading
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from ckpt_writers import gated_writer
from helpers import read_metrics
from mhar_titan.checkpoint import CheckpointConfig, CheckpointManager
from mhar_titan.config import load_config
from mhar_titan.preemption import PreemptionHandler
from mhar_titan.train import Trainer

FAMILIES = {
    "baseline": ["--model.residual", "standard"],
    "attnres": ["--model.residual", "attn_res", "--model.routing_heads", "1"],
    "mhar": ["--model.residual", "attn_res", "--model.routing_heads", "8"],
    "dense": ["--model.residual", "dense"],  # depth connections: their sharded weights resume too
    "mudd": ["--model.residual", "mudd"],
}
STEPS, WARMUP = 20, 10


# The SIGTERM runs of test_checkpoint_e2e.py read with data-loader workers (the workers must
# not die of a stop signal before the trainer saves): 2 workers in one process, 1 per torchrun rank.
SIG1_ARGS = ["--training.steps", "40", "--data.num_workers", "2"]
SIG2_ARGS = ["--training.steps", "40", "--data.num_workers", "1"]


def base_args(out: Path, corpus: Path, name: str) -> list[str]:
    return [
        "--config", "train_configs/debug_mhar.toml",
        "--job.dump_folder", str(out), "--job.name", name,
        "--data.files", json.dumps([str(corpus / "train-*.parquet")]), "--data.validation_files", "[]",
        "--validation.enable", "false",
        "--training.local_batch_size", "1", "--training.global_batch_size", "2", "--training.seq_len", "16",
        "--training.steps", str(STEPS), "--lr_scheduler.warmup_steps", str(WARMUP),
        "--debug.deterministic", "true", "--metrics.log_freq", "1",
        "--checkpoint.enable", "true", "--checkpoint.interval", "1000", "--checkpoint.keep_latest_k", "0",
    ]


def rows(out: Path, name: str) -> list[dict]:
    return read_metrics(out / name)


def full_state(model, optimizer) -> dict:
    msd, osd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
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


class Runner:
    def __init__(self, out: Path, corpus: Path):
        self.out, self.corpus = out, corpus
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.report: dict = {}

    def trainer(self, name: str, extra: list[str] = ()) -> Trainer:
        return Trainer(load_config(None, base_args(self.out, self.corpus, name) + list(extra)))

    def run(self, name: str, extra: list[str] = (), save_at=(), dump_at=None, one_step=False, stop_after=None,
            trainer=None) -> dict:
        """Train ``name`` to the end; return the first and last step of this run.

        ``save_at``: extra steps to save; ``dump_at``: also write the full model+optimizer
        state of that step; ``one_step``: stop after the next step through the preemption
        path (which saves); ``stop_after``: leave the loop after that step without saving.
        """
        tr = trainer or self.trainer(name, extra)
        start = tr.state.step
        ckpt = tr.checkpointer
        plain_save = ckpt.save

        def save(step, last=False, force=False):
            if stop_after is not None and step >= stop_after:
                tr.preemption.received = signal.SIGTERM  # exits the loop after this call
                if force:
                    return False  # the preemption save: not wanted here
            done = plain_save(step, last=last, force=force or step in save_at)
            if step == dump_at:
                dump = full_state(tr.model, tr.optimizer)
                if self.rank == 0:
                    torch.save(dump, self.out / f"{name}_full_{step}.pt")
            return done

        ckpt.save = save
        if one_step:  # stop after the next step through the preemption path (save, exit the loop)
            tr.preemption.received = signal.SIGTERM
        tr.train()
        result = {"start": start, "end": tr.state.step}
        self.finish(tr)
        return result

    def watch_async(self, tr: Trainer, release: threading.Event, sync_step: int = 15) -> None:
        """Record, at each step's save call, whether an async save is still being written;
        at ``sync_step`` first save the same state synchronously to OUT/sync; at the step after
        it set ``release`` (the gate the async writer waits for)."""
        self.async_seen = []
        ckpt = tr.checkpointer
        plain_save = ckpt.save

        def save(step, last=False, force=False):
            in_flight = ckpt._in_flight
            self.async_seen.append([step, in_flight is not None and not in_flight[3].done()])
            if step == sync_step + 1:
                release.set()
            if step == sync_step:
                CheckpointManager(CheckpointConfig(enable=True, interval=1), self.out / "sync", model=tr.model,
                                  optimizer=tr.optimizer, lr_scheduler=tr.lr_scheduler, dataloader=tr.train_loader,
                                  train_state=tr.state, fingerprint=ckpt.fingerprint).save(step)
            return plain_save(step, last=last, force=force)

        tr.checkpointer.save = save

    def finish(self, tr: Trainer) -> None:
        """Trainer.close() without destroying the process group (later runs reuse it); it
        also releases the run-folder lock, so the next run may use the same folder."""
        tr.close(destroy_process_group=False)

    def resume_copy(self, src: str, step: int, name: str) -> None:
        """A new run folder holding only ``src``'s step-N checkpoint: a resume, nothing else.
        The checkpoint comes from ``src/checkpoints`` or, if ``go_back`` moved it, ``src/abandoned``."""
        if self.rank == 0:
            dst = self.out / name / "checkpoints" / f"step-{step}"
            origin = self.out / src / "checkpoints" / f"step-{step}"
            if not origin.exists():
                origin = self.out / src / "abandoned" / f"step-{step}"
            shutil.copytree(origin, dst)
        dist.barrier()

    def go_back(self, name: str, step: int) -> None:
        """Move the checkpoints after ``step`` to ``name/abandoned/`` (what checkpoint.load_step's
        error asks for): the resume at ``step`` then replaces them."""
        if self.rank == 0:
            for path in sorted((self.out / name / "checkpoints").glob("step-*")):
                if int(path.name.split("-")[1]) > step:
                    (self.out / name / "abandoned").mkdir(exist_ok=True)
                    path.rename(self.out / name / "abandoned" / path.name)
        dist.barrier()

    def compare_with_dump(self, tr: Trainer, dump: str) -> list[str]:
        got = dict(tensors(full_state(tr.model, tr.optimizer)))
        want = dict(tensors(torch.load(self.out / dump, weights_only=False)))
        bad = sorted(set(got) ^ set(want)) + [k for k in want if k in got and not torch.equal(got[k], want[k])]
        return [f"{len(want)} tensors compared"] + bad

    def expect_error(self, name: str, extra: list[str]) -> str:
        try:
            tr = self.trainer(name, extra)
        except Exception as e:  # noqa: BLE001 - the test checks the type and message
            return f"{type(e).__name__}: {e}"
        self.finish(tr)
        return "no error"

    def save(self, key: str, value) -> None:
        self.report[key] = value
        if self.rank == 0:
            (self.out / f"{PHASE}.json").write_text(json.dumps(self.report, indent=1))


def reshard(r: Runner, *, window_src: str, dump: str, doc_src: str, name: str, doc_name: str) -> None:
    """Resume runs saved at another world size: ``window_src`` step 10 (window sharding) must
    load the state dumped in ``dump`` and continue to step 13; ``doc_src`` step 2 (document
    sharding) must be refused by the data rule. Results under ``name``/``doc_name``."""
    r.resume_copy(window_src, 10, name)
    tr = r.trainer(name, FAMILIES["mhar"])
    r.save(f"{name}_loaded", [tr.state.step] + r.compare_with_dump(tr, dump))
    r.run(name, trainer=tr, stop_after=13)
    r.save(f"{name}_rows", rows(r.out, name))
    r.resume_copy(doc_src, 2, doc_name)
    r.save(doc_name, r.expect_error(doc_name, FAMILIES["mhar"] + ["--data.sharding", "document"]))


def phase_one(r: Runner) -> None:
    """1 rank: references for the 1 -> 2 reshard; restart the preempted single-process run."""
    r.run("w1_ref", FAMILIES["mhar"], save_at={10}, dump_at=10, stop_after=13)
    r.save("w1_ref", rows(r.out, "w1_ref"))
    r.run("w1_doc", FAMILIES["mhar"] + ["--data.sharding", "document"], save_at={2}, stop_after=2)
    if (r.out / "sig1").exists():  # the test's SIGTERMed `python train.py` run
        r.save("sig1_restart", r.run("sig1", SIG1_ARGS, one_step=True))
        r.save("sig1_rows", rows(r.out, "sig1"))


def phase_two(r: Runner) -> None:
    """2 ranks: should_stop agreement, resume per family (items 1, 5), async (8), reshard 1 -> 2 (2),
    compile (4), restart after SIGTERM (6)."""
    preempt = PreemptionHandler()  # only rank 1 is signalled; both ranks must stop
    if r.rank == 1:
        os.kill(os.getpid(), signal.SIGUSR1)
    r.save("should_stop", [r.rank, preempt.received is not None, preempt.should_stop()])
    preempt.restore()

    for family, args in FAMILIES.items():
        mhar = family == "mhar"
        r.run(f"{family}_ref", args, save_at={1, 9, 10, 11} if mhar else {10}, dump_at=10 if mhar else None)
        r.save(f"{family}_ref", rows(r.out, f"{family}_ref"))
        # resume in the same run folder: rows after step 10 must be replaced, not duplicated
        resume = args + ["--checkpoint.load_step", "10"]
        r.go_back(f"{family}_ref", 10)
        tr = None
        if mhar:  # also: the async save of step 15 (held until step 16 ended) must equal a sync save of that state
            tr = r.trainer("mhar_ref", resume + ["--checkpoint.async_mode", "async", "--checkpoint.interval", "5"])
            written = threading.Event()
            tr.checkpointer._writer_factory = gated_writer(written)
            r.watch_async(tr, release=written)
        r.save(f"{family}_resume10", r.run(f"{family}_ref", resume, trainer=tr))
        r.save(f"{family}_resume10_rows", rows(r.out, f"{family}_ref"))
    r.save("async", r.async_seen)
    for k in (1, 9, 11):
        r.resume_copy("mhar_ref", k, f"mhar_at{k}")
        r.save(f"mhar_at{k}", r.run(f"mhar_at{k}", FAMILIES["mhar"], stop_after=k + 2))
        r.save(f"mhar_at{k}_rows", rows(r.out, f"mhar_at{k}"))

    # reshard 1 -> 2 (window: continue exactly; document: the data rule refuses)
    reshard(r, window_src="w1_ref", dump="w1_ref_full_10.pt", doc_src="w1_doc", name="w1_to_w2",
            doc_name="w1_doc_to_w2")
    r.run("w2_doc", FAMILIES["mhar"] + ["--data.sharding", "document"], save_at={2}, stop_after=2)

    # compile (+ activation checkpointing): save, resume, save, resume; keys are the plain model's
    comp = FAMILIES["mhar"] + ["--compile.enable", "true", "--compile.backend", "aot_eager", "--training.steps", "4",
                               "--activation_checkpoint.mode", "full"]
    first = r.run("compiled", comp, save_at={2}, stop_after=2)
    second = r.run("compiled", comp, one_step=True)  # resumes at 2, saves 3 through the preemption path
    third = r.run("compiled", comp)  # resumes at 3, saves the last step 4
    meta = dcp.FileSystemReader(str(r.out / "compiled" / "checkpoints" / "step-4")).read_metadata()
    r.save("compiled", {"runs": [first, second, third], "keys": sorted(meta.state_dict_metadata),
                        "rows": rows(r.out, "compiled")})

    # restart the preempted torchrun run
    if (r.out / "sig2").exists():
        r.save("sig2_restart", r.run("sig2", SIG2_ARGS, one_step=True))
        r.save("sig2_rows", rows(r.out, "sig2"))


def phase_three(r: Runner) -> None:
    """1 rank: reshard 2 -> 1."""
    reshard(r, window_src="mhar_ref", dump="mhar_ref_full_10.pt", doc_src="w2_doc", name="w2_to_w1",
            doc_name="w2_doc_to_w1")


if __name__ == "__main__":
    PHASE = sys.argv[1]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    runner = Runner(Path(sys.argv[2]), Path(sys.argv[3]))
    {"one": phase_one, "two": phase_two, "three": phase_three}[PHASE](runner)
    dist.barrier()
    dist.destroy_process_group()
