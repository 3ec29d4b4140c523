"""The Trainer (the training loop) and ``main()``.

``python train.py --config train_configs/NAME.toml [--section.key=value ...]``
runs in one process; under ``torchrun --nproc_per_node=N`` (and ``--nnodes``)
the same command trains data-parallel with FSDP2.

One optimizer step:

1. fetch the step's ``grad_accum`` micro-batches and all-reduce the number of
   target tokens (labels != -100) over micro-batches and ranks: ``n_global``;
2. per micro-batch: ``loss_sum`` = summed token cross-entropy; backward of
   ``loss_sum / n_global * dp_world``. FSDP2 averages gradients over the ranks
   (divides by ``dp_world``), so the summed gradient equals that of the mean
   loss over all ``n_global`` tokens: exact for any accumulation, world size and
   ignored labels. (We do not use ``set_gradient_divide_factor``: it makes FSDP2
   use PREMUL_SUM, which gloo lacks.)
3. global gradient norm (and per group: routing pseudo-queries, gates, the
   rest), clipping; a non-finite loss or norm skips the step (counted), and
   ``training.max_consecutive_nonfinite`` consecutive ones stop the run;
4. AdamW step, LR schedule step, checkpoint, preemption check.
"""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import gc
import json
import logging
import math
import os
import pathlib
import sys
import warnings
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mhar_titan.checkpoint import CheckpointError, CheckpointManager, step_folders
from mhar_titan.config import ConfigError, JobConfig, batch_geometry, load_config, resolve_model_args, to_toml
from mhar_titan.data import DataError, DataStateError, ManifestError, TokenizerFileError, build_tokenizer
from mhar_titan.data.loader import build_train_loader, build_validation_loader
from mhar_titan.metrics import MetricsLogger, Throughput, flops_per_token, mfu, peak_flops, peak_memory_gib
from mhar_titan.models.model import Transformer, routing_entropy
from mhar_titan.optim import build_lr_scheduler, build_optimizer, clip_grad_norm_by_group
from mhar_titan.launch_env import LaunchEnvError
from mhar_titan.parallel import build_model, init_distributed
from mhar_titan.preemption import PreemptionHandler

logger = logging.getLogger("mhar_titan")

IGNORE_INDEX = -100


class RunFolderError(RuntimeError):
    """The run folder is in use by another training, or holds a run this start would overwrite."""


class TrainingHealthError(RuntimeError):
    """Too many consecutive non-finite steps: the run stops."""


@dataclasses.dataclass
class TrainState:
    """The trainer's own counters; saved in every checkpoint (a Stateful object)."""

    step: int = 0
    tokens_seen: int = 0
    nonfinite_skipped: int = 0
    consecutive_nonfinite: int = 0
    wandb_id: Optional[str] = None

    def state_dict(self) -> dict:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            if hasattr(self, key):
                setattr(self, key, value)


# Fields of ModelArgs that do not change the weights: a checkpoint resumes across them.
RESUMABLE_MODEL_FIELDS = ("routing_kernel", "max_seq_len", "routing_group_size")


# Fields of ModelArgs added after checkpoints existed, with the value that gives the older models:
# left out of the fingerprint at that value, so those checkpoints still resume.
LEGACY_MODEL_DEFAULTS = {"routing_layout": "clean", "routing_head_layout": "contiguous", "routing_head_layout_seed": 0}


def checkpoint_fingerprint(model_args, tokenizer_name: str) -> dict:
    """What must match between a checkpoint and the run resuming it: the model arguments that
    shape or define the weights (not ``RESUMABLE_MODEL_FIELDS``, nor ``LEGACY_MODEL_DEFAULTS``
    fields at their legacy value) and the tokenizer."""
    args = {k: v for k, v in dataclasses.asdict(model_args).items()
            if k not in RESUMABLE_MODEL_FIELDS and not (k in LEGACY_MODEL_DEFAULTS and v == LEGACY_MODEL_DEFAULTS[k])}
    return {"model_args": args, "tokenizer": tokenizer_name}


def _target_count(labels: torch.Tensor) -> torch.Tensor:
    return (labels != IGNORE_INDEX).sum()


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy (nats) of (B, T, V) logits against (B, T) labels; -100 is ignored."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")


class Trainer:
    """Builds everything from a validated ``JobConfig`` and runs the loop (``train()``)."""

    def __init__(self, cfg: JobConfig):
        self.cfg = cfg
        self.env = env = init_distributed(cfg)
        self.device = env.device
        torch.manual_seed(cfg.debug.seed)
        if cfg.debug.deterministic:
            if env.device.type == "cuda":
                os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)

        t = cfg.training
        self.global_batch_size, self.grad_accum = batch_geometry(cfg, env.world_size)

        self.run_dir = pathlib.Path(cfg.job.dump_folder) / cfg.job.name
        self._run_lock = None
        if env.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        self._on_rank0(self._lock_run_dir)
        try:
            self._build()
        except BaseException:
            self._unlock_run_dir()
            raise

    def _build(self) -> None:
        """Model, data, optimizer, checkpoint load, metrics sinks (config.toml is written by ``train()``)."""
        cfg, env, t = self.cfg, self.env, self.cfg.training
        self.tokenizer = build_tokenizer(cfg.data)
        self.model_args = resolve_model_args(cfg, self.tokenizer.n_vocab)

        self.model = build_model(Transformer, self.model_args, cfg, env)
        self.optimizer = build_optimizer(self.model, cfg.optimizer)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.lr_scheduler, t.steps)
        self.loss_fn = token_loss_sum
        if cfg.compile.enable and "loss" in cfg.compile.components:
            self.loss_fn = torch.compile(token_loss_sum, backend=cfg.compile.backend)

        self.train_loader = build_train_loader(
            cfg.data, self.tokenizer, dp_rank=env.rank, dp_world=env.world_size,
            local_batch_size=t.local_batch_size, seq_len=t.seq_len, seed=cfg.debug.seed,
        )
        self.val_loader = None
        if cfg.validation.enable:
            v = cfg.validation
            self.val_loader = build_validation_loader(
                cfg.data, self.tokenizer, dp_rank=env.rank, dp_world=env.world_size,
                local_batch_size=v.local_batch_size if v.local_batch_size > 0 else t.local_batch_size,
                seq_len=t.seq_len, steps=v.steps,
            )

        self.flops = flops_per_token(self.model_args, t.seq_len)
        self.peak_flops = peak_flops(self.device)
        self.state = TrainState()
        self.checkpointer = None
        if cfg.checkpoint.enable:
            self.checkpointer = CheckpointManager(
                cfg.checkpoint, self.run_dir, model=self.model, optimizer=self.optimizer,
                lr_scheduler=self.lr_scheduler, dataloader=self.train_loader, train_state=self.state,
                fingerprint=checkpoint_fingerprint(self.model_args, self.tokenizer.name),
            )
            self.state.step = self.checkpointer.load()
        if self.state.step == 0:
            self._on_rank0(self._refuse_existing_run)
        if env.rank == 0:
            self._truncate_metrics(self.state.step)
        self.metrics = MetricsLogger(cfg.metrics, self.run_dir, env.rank, run_name=cfg.job.name,
                                     config=cfg.to_dict(), wandb_id=self.state.wandb_id)
        self.state.wandb_id = self.metrics.wandb_id or self.state.wandb_id
        self._sync_rank0_state()
        self.preemption = PreemptionHandler()
        self.losses: list[float] = []  # per-step training loss of this process's run (for tests)
        self._log(self.state.step, self._startup_summary(), console_only=True)

    # ------------------------------------------------------------------ helpers

    def _on_rank0(self, fn) -> None:
        """Run the check ``fn`` on rank 0 and raise its ``RunFolderError`` on every rank."""
        error = None
        if self.env.rank == 0:
            try:
                fn()
            except RunFolderError as e:
                error = e
        if self.env.world_size > 1:
            box = [error]
            dist.broadcast_object_list(box, src=0)
            error = box[0]
        if error is not None:
            raise error

    def _lock_run_dir(self) -> None:
        """Hold an exclusive ``flock`` on ``<run_dir>/.lock`` until ``close()`` (the OS drops it
        if the process dies), so two trainings cannot write one run folder at once.

        Raises:
            RunFolderError: another process holds the lock.
        """
        handle = open(self.run_dir / ".lock", "a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            raise RunFolderError(
                f"another training is running in {self.run_dir} (it holds {self.run_dir / '.lock'}); "
                "wait for it to finish, or use another --job.name"
            ) from None
        self._run_lock = handle

    def _unlock_run_dir(self) -> None:
        if self._run_lock is not None:
            self._run_lock.close()  # closing the file releases the flock
            self._run_lock = None

    def _refuse_existing_run(self) -> None:
        """A fresh start (no checkpoint restored) must not mix with a run already in the folder.

        Raises:
            RunFolderError: the folder holds metrics rows or checkpoint folders.
        """
        metrics = self.run_dir / self.cfg.metrics.jsonl_file
        found = []
        if metrics.is_file() and metrics.read_text().strip():
            found.append(metrics.name)
        if step_folders(self.run_dir / self.cfg.checkpoint.folder):
            found.append(f"{self.cfg.checkpoint.folder}/step-N")
        if found:
            why = ("no complete checkpoint to resume from" if self.cfg.checkpoint.enable
                   else "checkpoint.enable = false, so nothing is resumed")
            raise RunFolderError(
                f"{self.run_dir} already holds a run ({', '.join(found)}) and this start would overwrite it "
                f"({why}); start a fresh run with another --job.name, or delete or move {self.run_dir}"
            )

    def _save_config(self) -> None:
        """Write the resolved config to ``job.save_config_file``; a differing one from an earlier
        start of this run (a resume with changed settings) is kept as ``<stem>.prev.toml``."""
        path = self.run_dir / self.cfg.job.save_config_file
        text = to_toml(self.cfg)
        if path.is_file() and path.read_text() != text:
            path.replace(path.with_name(f"{path.stem}.prev{path.suffix}"))
        path.write_text(text)
        if self.cfg.job.print_config:
            print(text, flush=True)

    def _sync_rank0_state(self) -> None:
        """Give every rank rank 0's ``wandb_id`` (set only where the W&B run lives).

        Every rank saves ``train_state`` under one checkpoint key and DCP keeps one
        copy, not necessarily rank 0's, so the train state must be equal on all ranks.
        """
        if self.env.world_size > 1:
            box = [self.state.wandb_id]
            dist.broadcast_object_list(box, src=0)
            self.state.wandb_id = box[0]

    def _startup_summary(self) -> dict:
        n_params = sum(p.numel() for p in self.model.parameters())
        a = self.model_args
        return {
            "event": "start", "flavor": self.cfg.model.flavor, "residual": a.residual,
            "routing_heads": a.resolved_routing_heads if a.residual == "attn_res" else 0,
            "params": n_params, "ranks": self.env.world_size, "device": str(self.device),
            "global_batch": self.global_batch_size, "grad_accum": self.grad_accum,
            "flops_per_token": self.flops.total, "routing_flops_per_token": self.flops.routing,
            "run_dir": str(self.run_dir),
        }

    def _log(self, step: int, row: dict, console_only: bool = False) -> None:
        if self.env.rank != 0:
            return
        if console_only:
            print(f"[mhar_titan] step {step}: " + " ".join(f"{k}={v}" for k, v in row.items()), flush=True)
        else:
            self.metrics.log(step, row)

    def _truncate_metrics(self, step: int) -> None:
        """On resume from ``step``, drop JSONL rows written after it by the interrupted run."""
        path = self.run_dir / self.cfg.metrics.jsonl_file
        if not path.exists():
            return
        rows = [line for line in path.read_text().splitlines() if line.strip()]
        kept = [line for line in rows if json.loads(line).get("step", 0) <= step]
        if len(kept) != len(rows):
            path.write_text("".join(line + "\n" for line in kept))

    def _next_micro_batches(self, it) -> list[tuple[torch.Tensor, torch.Tensor]]:
        batches = []
        for _ in range(self.grad_accum):
            try:
                x, y = next(it)
            except StopIteration:
                raise RuntimeError(
                    f"the training data ran out at step {self.state.step + 1}; set data.infinite = true "
                    "or lower training.steps"
                ) from None
            batches.append((x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)))
        return batches

    def _all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.env.world_size > 1:
            dist.all_reduce(t)
        return t

    # ------------------------------------------------------------------ one step

    def train_step(self, micro_batches) -> tuple[float, torch.Tensor, dict]:
        """Forward/backward over the micro-batches and the gradient norm; no optimizer step.

        Returns (global mean loss over target tokens in nats, total grad norm, group norms).
        """
        n_local = sum(_target_count(y) for _, y in micro_batches).to(self.device, torch.float32)
        n_global = self._all_reduce_sum(n_local.clone()).clamp_min(1.0)
        forced = (self.state.step + 1) in self.cfg.debug.force_nonfinite_loss_steps
        loss_total = torch.zeros((), device=self.device)
        for x, y in micro_batches:
            loss_sum = self.loss_fn(self.model(x), y)
            if forced:  # debug: poison this step to exercise the non-finite guard
                loss_sum = loss_sum * float("nan")
            (loss_sum / n_global * self.env.world_size).backward()
            loss_total += loss_sum.detach()
        loss = (self._all_reduce_sum(loss_total) / n_global).item()
        grad_norm, group_norms = clip_grad_norm_by_group(self.model, self.cfg.training.max_norm)
        return loss, grad_norm, group_norms

    @torch.no_grad()
    def validate(self) -> float:
        """Mean loss (nats per target token) over the validation batches, all ranks together."""
        total = torch.zeros(2, device=self.device)
        for x, y in self.val_loader:
            x, y = x.to(self.device), y.to(self.device)
            total[0] += self.loss_fn(self.model(x), y)
            total[1] += _target_count(y)
        total = self._all_reduce_sum(total)
        return (total[0] / total[1].clamp_min(1)).item()

    @torch.no_grad()
    def _routing_entropy(self, tokens: torch.Tensor) -> Optional[float]:
        """Mean depth-softmax entropy on one sequence; None for the baseline.

        Runs outside the root's forward, so the root FSDP unit (routing parameters,
        embedding) is unsharded explicitly around the call. Compiled blocks run
        eagerly here: a no-grad call would otherwise compile a second set of graphs.
        """
        if self.model_args.residual != "attn_res":
            return None
        self.model.unshard()
        try:
            with torch.compiler.set_stance("force_eager"):
                return routing_entropy(self.model, tokens[:1])
        finally:
            self.model.reshard()

    # ------------------------------------------------------------------ the loop

    def _profiler(self):
        p = self.cfg.profiling
        if not p.enable_profiling:
            return contextlib.nullcontext(None)
        folder = self.run_dir / p.save_traces_folder
        rank = self.env.rank

        def on_trace_ready(prof):
            out = folder / f"iteration_{self.state.step}"
            out.mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(out / f"rank{rank}_trace.json"))

        warmup = 1 if p.profile_freq > 1 else 0
        schedule = torch.profiler.schedule(wait=max(p.profile_freq - warmup - 1, 0), warmup=warmup, active=1)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        return torch.profiler.profile(activities=activities, schedule=schedule, on_trace_ready=on_trace_ready)

    def _memory_snapshot(self, step: int) -> None:
        p = self.cfg.profiling
        if not (p.enable_memory_snapshot and self.device.type == "cuda" and step % p.profile_freq == 0):
            return
        out = self.run_dir / p.save_memory_snapshot_folder / f"iteration_{step}"
        out.mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(out / f"rank{self.env.rank}_memory_snapshot.pickle"))

    def train(self) -> TrainState:
        """Run from the current step to ``training.steps``; returns the final train state.

        Raises:
            TrainingHealthError: ``training.max_consecutive_nonfinite`` consecutive non-finite steps.
        """
        cfg, t = self.cfg, self.cfg.training
        if cfg.profiling.enable_memory_snapshot and self.device.type == "cuda":
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        tokens_per_step = self.global_batch_size * t.seq_len
        if self.state.step >= t.steps:
            self._log(self.state.step, {
                "event": "nothing_to_do",
                "message": f"resumed at step {self.state.step} and training.steps = {t.steps}: raise "
                           "--training.steps to continue, or start a fresh run with another --job.name "
                           f"(or delete or move {self.run_dir} first)",
            }, console_only=True)
            return self.state
        if self.env.rank == 0:
            self._save_config()
        throughput = Throughput()
        it = iter(self.train_loader)
        gc.disable()  # collected every training.gc_freq steps instead
        try:
            self.model.train()
            with self._profiler() as prof:
                while self.state.step < t.steps:
                    step = self.state.step + 1
                    micro = self._next_micro_batches(it)
                    loss, grad_norm, group_norms = self.train_step(micro)
                    finite = math.isfinite(loss) and bool(torch.isfinite(grad_norm))
                    if finite:
                        self.optimizer.step()
                        self.state.consecutive_nonfinite = 0
                    else:
                        self.state.nonfinite_skipped += 1
                        self.state.consecutive_nonfinite += 1
                    self.optimizer.zero_grad(set_to_none=True)
                    lr = self.lr_scheduler.get_last_lr()[0]
                    self.lr_scheduler.step()
                    self.state.step = step
                    self.state.tokens_seen += tokens_per_step
                    throughput.add(tokens_per_step)
                    self.losses.append(loss)

                    if not finite:
                        logger.warning("step %d: non-finite loss %s or grad norm %s; step skipped (%d in a row)",
                                       step, loss, grad_norm.item(), self.state.consecutive_nonfinite)
                    if not finite or step % cfg.metrics.log_freq == 0 or step == 1 or step == t.steps:
                        self._log_step(step, loss, grad_norm, group_norms, lr, throughput, micro[0][0])
                    if self.val_loader is not None and (step % cfg.validation.freq == 0 or step == t.steps):
                        self._log(step, {"val_loss": self.validate()})
                    if self.state.consecutive_nonfinite >= t.max_consecutive_nonfinite:
                        first = step - self.state.consecutive_nonfinite + 1
                        raise TrainingHealthError(
                            f"stopping at step {step}: {self.state.consecutive_nonfinite} consecutive steps "
                            f"(steps {first}-{step}) had a non-finite loss or gradient norm "
                            f"(training.max_consecutive_nonfinite = {t.max_consecutive_nonfinite}); "
                            f"lower optimizer.lr or check the data"
                        )
                    if self.checkpointer is not None:
                        self.checkpointer.save(step, last=step == t.steps)
                    if prof is not None:
                        prof.step()
                    self._memory_snapshot(step)
                    if step % t.gc_freq == 0:
                        gc.collect(1)
                    if self.preemption is not None and self.preemption.should_stop():
                        if self.checkpointer is not None:
                            self.checkpointer.save(step, force=True)
                        self._log(step, {"event": "preempted", "signal": str(self.preemption.received)},
                                  console_only=True)
                        break
        finally:
            gc.enable()
        return self.state

    def _log_step(self, step, loss, grad_norm, group_norms, lr, throughput, tokens) -> None:
        tps = throughput.rate()
        tps_dev = tps / self.env.world_size
        row = {
            "loss": loss,
            "grad_norm": grad_norm.item(),
            **{f"grad_norm/{k}": v.item() for k, v in group_norms.items()},
            "lr": lr,
            "tokens_per_s": tps,
            "tokens_per_s_per_device": tps_dev,
            "tflops_per_device": self.flops.total * tps_dev / 1e12,
            "mfu": mfu(self.flops.total, tps_dev, self.peak_flops),
            "routing_flops_share": self.flops.routing / self.flops.total,
            "peak_mem_gib": peak_memory_gib(self.device),
            "routing_entropy": self._routing_entropy(tokens),
            "tokens_seen": self.state.tokens_seen,
            "nonfinite_skipped": self.state.nonfinite_skipped,
        }
        self._log(step, row)

    # ------------------------------------------------------------------ exit

    def close(self, destroy_process_group: bool = True) -> None:
        """Wait for checkpoints, close sinks, free FSDP state, then destroy the process group.

        Freeing the FSDP modules and optimizer (and collecting) before
        ``destroy_process_group`` avoids an intermittent SIGABRT at exit of 2-rank gloo runs
        (gloo worker threads still holding tensors at interpreter shutdown).
        """
        if self.checkpointer is not None:
            self.checkpointer.close()
        self.metrics.close()
        if self.preemption is not None:
            self.preemption.restore()
        self._unlock_run_dir()
        for name in ("checkpointer", "optimizer", "lr_scheduler", "model", "train_loader", "val_loader", "loss_fn"):
            setattr(self, name, None)
        self.env.mesh = None
        gc.collect()
        if dist.is_initialized():
            dist.barrier()
            if destroy_process_group:
                dist.destroy_process_group()


# Errors in the job's inputs found while building the Trainer: reported in one line, exit code 2.
SETUP_ERRORS = (ConfigError, RunFolderError, FileNotFoundError, LaunchEnvError, CheckpointError, DataError, DataStateError,
                ManifestError, TokenizerFileError)


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point: ``python train.py --config FILE [--section.key=value ...]``.

    Returns the exit code: 0 on success (also after a preemption); 2 for a bad config
    (nothing is built), launch environment, checkpoint (e.g. made for another model) or
    data (message on stderr, process group torn down); 1 when the run stops for
    training health.
    """
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # torchdata 0.11 calls a torch API that torch 2.13 deprecated; harmless, and printed once per worker.
    warnings.filterwarnings("ignore", message=".*set_vital.*")
    argv = sys.argv[1:] if argv is None else argv
    try:
        cfg = load_config(None, argv)
        batch_geometry(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    except (ConfigError, FileNotFoundError) as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    try:
        trainer = Trainer(cfg)
    except SETUP_ERRORS as e:
        print(f"cannot start training: {type(e).__name__}: {e}", file=sys.stderr)
        if dist.is_initialized():
            dist.destroy_process_group()
        return 2
    try:
        trainer.train()
    except TrainingHealthError as e:
        print(f"training stopped: {e}", file=sys.stderr)
        return 1
    finally:
        trainer.close()
    return 0
