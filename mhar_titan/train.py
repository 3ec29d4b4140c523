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
4. optimizer step (AdamW, or Muon with AdamW: ``optim.build_optimizer``), weight EMA update
   (``training.ema_decay``; validation runs on the EMA weights), LR schedule step, validation
   and the ``[eval]`` downstream tasks when due (``components.downstream``), checkpoint,
   preemption check. With ``training.z_loss`` the
   summed loss of step 2 includes the z-loss (``components.loss``).

Steps 2-4 read nothing back from the device (no ``.item()``, no data-dependent shapes; the
token ids are checked on the host before the batch is copied): the loss, the gradient norm and
the non-finite flag are read once, after the optimizer step (``components.step_guard``), when
the optimizer skips a non-finite step on the device (fused AdamW); otherwise the flag is read
once before the optimizer step. ``tests/test_capture_safe.py`` holds every family to this.

The parts live with their owners: the run folder, loss, batch geometry, train state and
profiling in ``mhar_titan.components``, checkpoints in ``mhar_titan.checkpoint``, the
model build in ``mhar_titan.parallel``. ``main()`` turns every ``UserError`` (bad
config, data, checkpoint, launch environment or run folder) into exit code 2.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import os
import sys
import time
import warnings
from typing import Optional

import torch
import torch.distributed as dist

from mhar_titan.analysis.routing import routing_entropy
from mhar_titan.checkpoint import CheckpointManager, checkpoint_fingerprint, refuse_optimizer_switch
from mhar_titan.cli_args import Interrupted
from mhar_titan.components.batches import batch_geometry, next_micro_batches
from mhar_titan.components.cuda_graphs import GraphedMicroStep, check_cuda_graphs
from mhar_titan.components.downstream import DownstreamEval
from mhar_titan.components.ema import WeightEMA
from mhar_titan.components.loss import build_loss_fn, target_count
from mhar_titan.components.memory import available_memory, check_memory_fit
from mhar_titan.components.performance import (MemorySnapshots, RunTotals, build_profiler, performance_row,
                                               routing_kernel_warning, startup_fields, summary_throughput_fields)
from mhar_titan.components.ranks import agree_on_data_error, agree_on_setup, seed_global_rngs
from mhar_titan.components.run_folder import RunFolder, on_rank0
from mhar_titan.components.step_guard import guarded_step, read_step
from mhar_titan.components.train_state import TrainingHealthError, TrainState
from mhar_titan.config import JobConfig, load_config
from mhar_titan.config.help import config_help, help_request
from mhar_titan.config.parser import job_model_args
from mhar_titan.console import LOG_FORMAT, LossEMA, summary_fields
from mhar_titan.convert import load_pretrained_weights
from mhar_titan.data import build_tokenizer
from mhar_titan.data.checks import check_data_files
from mhar_titan.data.loader import build_train_loader, build_validation_sets
from mhar_titan.dryrun import build_meta_model, build_model_args, estimate_memory
from mhar_titan.errors import UserError
from mhar_titan.exit_status import clear_exit_status, write_exit_status
from mhar_titan.metrics import MetricsLogger, Throughput, flops_per_token, peak_flops, routing_temperature_metrics
from mhar_titan.models.args import ModelArgs, sized_for_tokenizer, with_document_eos
from mhar_titan.models.model import Transformer
from mhar_titan.optim import build_lr_scheduler, build_optimizer, clip_grad_norm_by_group, optimizer_fields
from mhar_titan.parallel import build_model, init_distributed
from mhar_titan.preemption import PreemptionHandler
from mhar_titan.say_once import quiet_other_ranks, report_user_error

logger = logging.getLogger("mhar_titan")


class Trainer:
    """Builds everything from a validated ``JobConfig`` and runs the loop (``train()``).

    ``model_args``: the job's ``ModelArgs`` when the caller has already resolved them for the
    tokenizer (``main()`` does, to refuse a bad ``[model]`` before anything starts); else they
    are resolved here once."""

    def __init__(self, cfg: JobConfig, model_args: Optional[ModelArgs] = None):
        self.cfg = cfg
        self.model_args = model_args
        self.env = env = init_distributed(cfg)
        self.device = env.device
        seed_global_rngs(cfg.debug.seed, cfg.debug.deterministic, env.device)
        self.global_batch_size, self.grad_accum = batch_geometry(cfg.training, env.world_size)
        self.run_folder = RunFolder(cfg)
        self.run_dir = self.run_folder.path
        self.preempted = False  # set when a stop signal ended train() (after its checkpoint)
        self.failure: Optional[BaseException] = None  # what stopped train() or close() (the summary says so)
        on_rank0(env.rank, env.world_size, self.run_folder.lock)
        if env.rank == 0:
            clear_exit_status(self.run_dir)  # this start's outcome, or none after a crash
        try:
            self._build()
        except BaseException:
            self.run_folder.unlock()
            self._release()  # free FSDP state before the process group goes (clean gloo exit)
            raise

    def _build(self) -> None:
        """Model, data, optimizer, checkpoint load, metrics sinks (config.toml is written by ``train()``)."""
        cfg, env, t = self.cfg, self.env, self.cfg.training
        # Checks that need only the config first: a resume at another seq_len, the memory estimate.
        on_rank0(env.rank, env.world_size, self.run_folder.refuse_changed_seq_len)
        agree_on_setup(self._check_memory, env.world_size)
        agree_on_setup(lambda: refuse_optimizer_switch(cfg.checkpoint, self.run_dir, cfg.optimizer.name),
                       env.world_size)
        # Inputs next, before anything expensive: every data check that needs only the config
        # and the files, the loaders and the validation set's size. All ranks agree on the outcome.
        agree_on_setup(self._build_inputs, env.world_size)
        agree_on_setup(self._build_downstream, env.world_size)  # the [eval] tasks, checked before the model
        if self.model_args is None:  # the config's, resolved when it was loaded, for this tokenizer
            self.model_args = sized_for_tokenizer(job_model_args(cfg), cfg.model, self.tokenizer.n_vocab,
                                                  cfg.data.tokenizer)
        self.model_args = with_document_eos(self.model_args, self.tokenizer.eos_id)
        self.model = build_model(Transformer, self.model_args, cfg, env)
        self.model.check_token_ids = False  # next_micro_batches checks each batch's ids on the host
        self.optimizer = build_optimizer(self.model, cfg.optimizer)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.lr_scheduler, t.steps)
        self.loss_fn = build_loss_fn(cfg.compile, t.z_loss, t.loss_path, t.loss_chunk_tokens)
        self.eval_loss_fn = build_loss_fn(cfg.compile, 0.0, t.loss_path, t.loss_chunk_tokens) \
            if t.z_loss > 0 else self.loss_fn
        self.ema = WeightEMA(self.model, t.ema_decay) if t.ema_decay > 0 else None
        self.graphed = GraphedMicroStep(self.model, self.loss_fn, self.env.world_size) if t.cuda_graphs else None
        self.flops = flops_per_token(self.model_args, t.seq_len)
        self.peak_flops = peak_flops(self.device)
        self.state = TrainState()
        self.checkpointer = None
        if cfg.checkpoint.enable or cfg.checkpoint.initial_load_path:  # loading needs no saving
            self.checkpointer = CheckpointManager(
                cfg.checkpoint, self.run_dir, model=self.model, optimizer=self.optimizer,
                lr_scheduler=self.lr_scheduler, dataloader=self.train_loader, train_state=self.state,
                fingerprint=checkpoint_fingerprint(self.model_args, self.tokenizer.name), ema=self.ema,
                pretrained_loader=load_pretrained_weights,
            )
            self.state.step = self.checkpointer.load()
        if self.ema is not None and not self.ema.loaded:
            self.ema.reset()  # start the average at the loaded (or initial) weights
        if self.state.step == 0:
            on_rank0(env.rank, env.world_size, self.run_folder.refuse_existing_run)
        self.metrics = MetricsLogger(cfg.metrics, self.run_dir, env.rank, run_name=cfg.job.name,
                                     config=cfg.to_dict(), wandb_id=self.state.wandb_id,
                                     resume_step=self.state.step if self.state.step > 0 else None,
                                     total_steps=t.steps)
        self.state.wandb_id = self.metrics.wandb_id or self.state.wandb_id
        self.state.sync_from_rank0(env.world_size)
        self.preemption = PreemptionHandler()
        if self.downstream is not None:  # a stop signal ends an [eval] pass within one forward
            self.downstream.stop_requested = self.preemption.requested
        self.started = (time.perf_counter(), self.state.step)  # for the end-of-run summary
        self.metrics.event(self.state.step, *startup_fields(
            cfg, self.model_args, self.model, env.world_size, self.device, self.global_batch_size,
            self.grad_accum, self.flops))
        self.metrics.event(self.state.step, *optimizer_fields(self.model, cfg.optimizer, env.world_size,
                                                              self.device.type))
        self.metrics.event(self.state.step, "run folder", str(self.run_dir))
        fallback = routing_kernel_warning(self.model_args, self.device)
        if fallback is not None and env.rank == 0:
            logger.warning(fallback)
        self.totals = RunTotals()  # this run's steps, for the summary
        self.loss_ema = LossEMA()  # the console's smoothed loss beside each step's batch loss

    def _check_memory(self) -> None:
        """The dry run's memory estimate per rank (``dryrun.estimate_memory``, on a meta model)
        against this rank's memory (``components.memory``), per ``training.memory_check``.

        Raises:
            MemoryFitError: the job does not fit and memory_check is "error".
        """
        cfg, env = self.cfg, self.env
        if cfg.training.memory_check == "off":
            return
        args = self.model_args or build_model_args(cfg)  # main() resolves them for the tokenizer
        estimate = estimate_memory(build_meta_model(args), cfg, env.world_size, self.device.type)
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if self.device.type == "cpu" else 1
        warning = check_memory_fit(estimate, *available_memory(self.device, local_ranks), cfg)
        if warning is not None and env.rank == 0:
            logger.warning(warning)

    def _build_inputs(self) -> None:
        """Tokenizer, data checks (``check_data_files``), train loader and validation set.

        Raises:
            UserError: a bad data file or setting (DataError names the file), a tokenizer file.
        """
        cfg, env, t = self.cfg, self.env, self.cfg.training
        self.tokenizer = build_tokenizer(cfg.data)
        check_data_files(cfg.data, dp_world=env.world_size, seed=cfg.debug.seed, validation=cfg.validation.enable)
        self.train_loader = build_train_loader(
            cfg.data, self.tokenizer, dp_rank=env.rank, dp_world=env.world_size,
            local_batch_size=t.local_batch_size, seq_len=t.seq_len, seed=cfg.debug.seed,
        )
        self.val_loader = None  # validation sets by source name ("" for one source)
        if cfg.validation.enable:
            v = cfg.validation
            self.val_loader = build_validation_sets(
                cfg.data, self.tokenizer, dp_rank=env.rank, dp_world=env.world_size,
                local_batch_size=v.local_batch_size if v.local_batch_size > 0 else t.local_batch_size,
                seq_len=t.seq_len, sequences=v.sequences_for(t.seq_len),
            )

    def _build_downstream(self) -> None:
        """The ``[eval]`` tasks (``components.downstream``); DownstreamEvalError names a task that cannot run."""
        cfg, env = self.cfg, self.env
        self.downstream = DownstreamEval(cfg.eval, self.tokenizer, env.rank, env.world_size, self.device) \
            if cfg.eval.enable else None

    def _release(self) -> None:
        """Drop the model, optimizer, loaders and EMA (and collect): FSDP state must be gone before
        ``destroy_process_group``, or 2-rank gloo runs can abort at exit (SIGABRT)."""
        for name in ("checkpointer", "optimizer", "lr_scheduler", "model", "train_loader", "val_loader", "loss_fn",
                     "eval_loss_fn", "ema", "graphed"):
            setattr(self, name, None)
        self.env.mesh = None
        gc.collect()

    # ------------------------------------------------------------------ helpers

    def _log(self, step: int, row: dict) -> None:
        if self.env.rank == 0:
            self.metrics.log(step, row)

    def _all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.env.world_size > 1:
            dist.all_reduce(t)
        return t

    # ------------------------------------------------------------------ one step

    def train_step(self, micro_batches) -> tuple[torch.Tensor, torch.Tensor, dict, torch.Tensor]:
        """Forward/backward over the micro-batches, the gradient norm and clipping; no optimizer
        step and no host read (everything stays on the device).

        Returns 0-dim tensors: (global mean loss over target tokens in nats, total grad norm,
        {group: norm}, finite: the loss and the norm are both finite).
        """
        n_local = sum(target_count(y) for _, y in micro_batches).to(self.device, torch.float32)
        n_global = self._all_reduce_sum(n_local.clone()).clamp_min(1.0)
        forced = (self.state.step + 1) in self.cfg.debug.force_nonfinite_loss_steps
        loss_total = torch.zeros((), device=self.device)
        for x, y in micro_batches:
            if self.graphed is not None:  # training.cuda_graphs (forced non-finite steps are refused with it)
                loss_total += self.graphed.step(x, y, n_global)
                continue
            loss_sum = self.model(x, y, loss_fn=self.loss_fn)
            if forced:  # debug: poison this step to exercise the non-finite guard
                loss_sum = loss_sum * float("nan")
            (loss_sum / n_global * self.env.world_size).backward()
            loss_total += loss_sum.detach()
        loss = self._all_reduce_sum(loss_total) / n_global
        grad_norm, group_norms = clip_grad_norm_by_group(self.model, self.cfg.training.max_norm)
        return loss, grad_norm, group_norms, torch.isfinite(loss) & torch.isfinite(grad_norm)

    @torch.no_grad()
    def validate(self) -> Optional[dict]:
        """``{"val_loss": mean loss}`` (nats per target token) over the validation batches, all
        ranks together; for a mixture also ``val_loss/<source>`` per source with validation
        files, ``val_loss`` then being the mean over all their target tokens. None on every rank
        when a stop signal came: the ranks agree before every forward (``preemption``)."""
        names = list(self.val_loader)
        total = torch.zeros(len(names), 2, device=self.device)
        for i, name in enumerate(names):
            for x, y in self.val_loader[name]:
                if self.preemption is not None and self.preemption.should_stop():
                    return None
                x, y = x.to(self.device), y.to(self.device)
                total[i, 0] += self.model(x, y, loss_fn=self.eval_loss_fn)
                total[i, 1] += target_count(y)
        total = self._all_reduce_sum(total)
        row = {"val_loss": (total[:, 0].sum() / total[:, 1].sum().clamp_min(1)).item()}
        if names != [""]:
            row.update({f"val_loss/{name}": (total[i, 0] / total[i, 1].clamp_min(1)).item()
                        for i, name in enumerate(names)})
        return row

    # ------------------------------------------------------------------ the loop

    def train(self) -> TrainState:
        """Run from the current step to ``training.steps``; returns the final train state.

        Raises:
            TrainingHealthError: ``training.max_consecutive_nonfinite`` consecutive non-finite steps.
        """
        try:
            return self._train()
        except BaseException as e:  # a failed save, bad data, training health: the summary says the run stopped
            self.failure = e
            raise

    def _train(self) -> TrainState:
        cfg, t = self.cfg, self.cfg.training
        snapshots = MemorySnapshots(cfg.profiling, self.run_dir, self.env.rank, self.device)
        snapshots.start()
        tokens_per_step = self.global_batch_size * t.seq_len
        if self.state.unfinished:  # the saved step's evaluations a stop signal ended: done first
            available = {"validation": self.val_loader is not None, "eval": self.downstream is not None}
            self.state.unfinished = self._evaluations(self.state.step, [n for n in self.state.unfinished
                                                                         if available.get(n)])
            if self.state.unfinished:  # stopped again: the checkpoint still lists them
                self.preempted = True
                self.metrics.event(self.state.step, "preempted", "during the resumed step's evaluations",
                                   "the checkpoint is unchanged", kind="warn")
                return self.state
        if self.state.step >= t.steps:
            self.metrics.event(
                self.state.step, "nothing to do",
                f"resumed at step {self.state.step} and training.steps = {t.steps}: raise --training.steps to "
                f"continue, or start a fresh run with another --job.name (or delete or move {self.run_dir} first)")
            return self.state
        on_rank0(self.env.rank, self.env.world_size, self.run_folder.save_config)
        throughput = Throughput()
        self.totals.start()
        it = iter(self.train_loader)
        gc.disable()  # collected every training.gc_freq steps instead
        try:
            self.model.train()
            profiler = build_profiler(cfg.profiling, self.run_dir, self.env.rank, self.device,
                                      lambda: self.state.step)
            with profiler as prof:
                while self.state.step < t.steps:
                    step = self.state.step + 1
                    micro, data_error = None, None
                    try:
                        micro = next_micro_batches(it, self.grad_accum, self.device, step,
                                                   vocab_size=self.model_args.vocab_size)
                    except UserError as e:  # a bad row met while reading (DataError naming file and row)
                        data_error = e
                    agree_on_data_error(data_error, step, self.env.rank, self.env.world_size, self.device)
                    loss_t, grad_norm_t, group_norms_t, finite_t = self.train_step(micro)
                    guarded_step(self.optimizer, self.ema, finite_t)
                    # a captured backward accumulates into the gradients' storage: keep it (zero in place)
                    self.optimizer.zero_grad(set_to_none=self.graphed is None)
                    lr = self.lr_scheduler.get_last_lr()[0]
                    self.lr_scheduler.step()
                    logged = step % cfg.metrics.log_freq == 0 or step == 1 or step == t.steps
                    # the step's one host read (group norms only on logged steps)
                    loss, grad_norm, finite, group_norms = read_step(loss_t, grad_norm_t, finite_t,
                                                                     group_norms_t if logged else None)
                    self.state.count_step(finite, tokens_per_step)
                    self._count_source_windows(t.seq_len)
                    throughput.add(tokens_per_step)
                    self.totals.step(loss, tokens_per_step)
                    self.loss_ema.update(loss)

                    if not finite:
                        logger.warning("step %d: non-finite loss %s or grad norm %s; step skipped (%d in a row)",
                                       step, loss, grad_norm, self.state.consecutive_nonfinite)
                        if not logged:
                            group_norms = {k: v.item() for k, v in group_norms_t.items()}
                    if not finite or logged:
                        self._log_step(step, loss, grad_norm, group_norms, lr, throughput, micro[0][0])
                    due = ["validation"] if self.val_loader is not None and (
                        step % cfg.validation.freq == 0 or step == t.steps) else []
                    if self.downstream is not None and self.downstream.due(step, t.steps):
                        due.append("eval")
                    self.state.unfinished = self._evaluations(step, due)  # saved with the step's checkpoint
                    self.state.check_health(t.max_consecutive_nonfinite)
                    if self.checkpointer is not None and self.checkpointer.save(step, last=step == t.steps):
                        self.metrics.flush()  # everything logged up to a checkpoint survives a crash
                    if prof is not None:
                        prof.step()
                    snapshots.after_step(step)
                    if step % t.gc_freq == 0:
                        gc.collect(1)
                    if self.preemption is not None and self.preemption.should_stop():
                        if self.checkpointer is not None:
                            self.checkpointer.save(step, force=True)
                        self.metrics.flush()
                        self.preempted = True
                        signal_name = getattr(self.preemption.received, "name", "on another rank")
                        self.metrics.event(step, "preempted", f"signal {signal_name}",
                                           "checkpoint saved" if self.checkpointer is not None else "no checkpoint",
                                           kind="warn")
                        break
        finally:
            gc.enable()
        return self.state

    def _evaluations(self, step: int, due: list[str]) -> list[str]:
        """Run the step's due evaluations in order ("validation", then "eval": the ``[eval]`` tasks)
        on the weights validation uses (the EMA when there is one), all ranks together, and log
        them. Returns those a stop signal left unfinished: the one it ended (within one forward,
        nothing of it logged) and every one after it; the same list on every rank."""
        for i, name in enumerate(due):
            with self.ema.swapped() if self.ema is not None else contextlib.nullcontext():
                row = self.validate() if name == "validation" else self.downstream.evaluate(self.model)
            if row is None:
                self.metrics.event(step, f"{'validation' if name == 'validation' else '[eval]'} stopped",
                                   "stop signal: not logged; the resumed run does it first", kind="warn")
                return due[i:]
            self._log(step, row)
        return []

    def _count_source_windows(self, seq_len: int) -> None:
        """Add this step's windows per mixture source, all ranks together, to the train state (on
        the device: read on logged steps and at checkpoints only). Nothing for one source."""
        windows = self.train_loader.take_source_windows()
        if windows is not None:
            counts = self._all_reduce_sum(torch.tensor(windows, dtype=torch.int64, device=self.device))
            self.state.add_source_windows(self.train_loader.source_names, counts, seq_len)

    def _log_step(self, step, loss, grad_norm, group_norms, lr, throughput, tokens) -> None:
        row = {
            "loss": loss,
            **({} if self.loss_ema.value is None else {"loss_ema": self.loss_ema.value}),
            "grad_norm": grad_norm,
            **{f"grad_norm/{k}": v for k, v in group_norms.items()},
            "lr": lr,
            **performance_row(throughput.rate(), self.env.world_size, self.flops, self.peak_flops, self.device),
            "routing_entropy": routing_entropy(self.model, tokens[:1]),
            **routing_temperature_metrics(self.model),
            "tokens_seen": self.state.tokens_seen,
            **{f"tokens_seen/{name}": n for name, n in self.state.settled_source_tokens().items()},
            "nonfinite_skipped": self.state.nonfinite_skipped,
        }
        self._log(step, row)

    # ------------------------------------------------------------------ exit

    def _summary(self) -> None:
        """The end-of-run summary on the console (rank 0): steps and tokens of this run, wall time,
        final and best validation loss, the newest checkpoint, where the full metrics are."""
        began, start_step = self.started
        if self.env.rank != 0 or self.state.step <= start_step:
            return
        saved = self.checkpointer.last_saved if self.checkpointer is not None else None
        if saved is not None:
            checkpoint = str(saved.relative_to(self.run_dir))
        elif not self.cfg.checkpoint.enable:
            checkpoint = "none written (checkpoint.enable = false)"
        else:  # enabled: no save was due in this run, or the last one was refused or failed (logged above)
            checkpoint = "none written in this run"
        if self.failure is not None:
            outcome = f"stopped ({type(self.failure).__name__}, below)" if isinstance(self.failure, Exception) \
                else "aborted"
        else:
            outcome = "preempted" if self.preempted else "done"
        lines = summary_fields(self.state.step, start_step, self.state.tokens_seen, time.perf_counter() - began,
                               self.state.nonfinite_skipped, self.metrics.validation_losses(),
                               str(self.run_dir), checkpoint, self.metrics.locations,
                               train_loss=self.totals.smoothed_loss(),
                               throughput=summary_throughput_fields(self.totals, self.env.world_size, self.flops,
                                                                    self.peak_flops, self.device),
                               validation_freq=self.cfg.validation.freq if self.val_loader is not None else None,
                               outcome=outcome)
        for fields in lines:
            self.metrics.event(self.state.step, *fields)

    def abort(self) -> None:
        """After a second Ctrl-C: what can be released without another rank (no collective, no
        checkpoint wait, no summary): the metrics written so far are closed, the signal handlers
        restored, the run folder unlocked. The process then ends (``cli_args.Interrupted``)."""
        try:
            self.metrics.close()
        finally:
            if self.preemption is not None:
                self.preemption.restore()
            self.run_folder.unlock()

    def close(self, destroy_process_group: bool = True) -> None:
        """Wait for checkpoints, close sinks, free FSDP state, then destroy the process group.

        Freeing the FSDP modules and optimizer (and collecting) before
        ``destroy_process_group`` avoids an intermittent SIGABRT at exit of 2-rank gloo runs
        (gloo worker threads still holding tensors at interpreter shutdown).
        """
        try:
            try:
                if self.checkpointer is not None:
                    self.checkpointer.close()  # raises CheckpointSaveError when an async save failed
            except UserError as e:
                self.failure = self.failure or e
                self._summary()  # the run stopped: the summary says so before the error is reported
                raise
            self._summary()
        finally:
            self.metrics.close()
            if self.preemption is not None:
                self.preemption.restore()
            self.run_folder.unlock()
            self._release()
            if dist.is_initialized():
                dist.barrier()
                if destroy_process_group:
                    dist.destroy_process_group()


def _is_rank0() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def aborted_line(cfg: JobConfig, trainer: Optional[Trainer], when: str) -> str:
    """The one line a training aborted by Ctrl-C prints (``cli_args.Interrupted``): when it stopped
    and what was last saved, the checkpoint the same command resumes from (the newest complete
    one of the run folder; a save cut short is not complete and is ignored)."""
    from mhar_titan.checkpoint.layout import is_complete, step_folders

    folder = RunFolder(cfg).path / cfg.checkpoint.folder
    complete = sorted(step for step, path in step_folders(folder).items() if is_complete(path)) \
        if folder.is_dir() else []
    if complete:
        saved = (f"the newest complete checkpoint is {folder / f'step-{complete[-1]}'}: the same command resumes "
                 f"from step {complete[-1]}")
    elif cfg.checkpoint.enable:
        saved = "no checkpoint is complete: the same command starts again from step 0"
    else:
        saved = "nothing was saved (checkpoint.enable = false)"
    return f"training aborted {when} (Ctrl-C): nothing more was saved; {saved}"


def _record_exit(cfg: Optional[JobConfig], status: str, code: int, step: Optional[int] = None) -> int:
    """Global rank 0 writes the exit status for the launch scripts (``mhar_titan.exit_status``); returns ``code``."""
    if int(os.environ.get("RANK", "0")) == 0:
        run_dir = RunFolder(cfg).path if cfg is not None else None
        write_exit_status(run_dir, status, code, step)
    return code


def _refuse(cfg: Optional[JobConfig], line: str, step: Optional[int] = None) -> int:
    """A user's error: record the exit status (bad_input, 2), then say ``line`` once for the launch
    (``say_once.report_user_error``: rank 0, and another rank only where its error differs); 2."""
    code = _record_exit(cfg, "bad_input", 2, step)
    report_user_error(line)
    return code


def quiet_known_warnings() -> None:
    """Silence warnings known to be harmless: torchdata 0.11 calls a torch API that torch 2.13
    deprecated (``set_vital``), printed once per loader worker."""
    warnings.filterwarnings("ignore", message=".*set_vital.*")


def check_config(cfg: JobConfig) -> ModelArgs:
    """The checks that need only the config, before anything is built, on every rank: every folder
    the run writes (``RunFolder.check_writable``), batch geometry for the launch's WORLD_SIZE and
    the model arguments for the tokenizer, which it returns. Raises UserError (ConfigError, or
    OutputFolderError for a folder that cannot be written)."""
    # every folder the run writes (run folder, checkpoints, metrics, ...) can be created and written
    RunFolder(cfg).check_writable()
    batch_geometry(cfg.training, int(os.environ.get("WORLD_SIZE", "1")))
    args = build_model_args(cfg)  # the config's, resolved when it was loaded, sized for the tokenizer
    check_cuda_graphs(cfg, args)
    return args


def run_training(cfg: JobConfig) -> TrainState:
    """Train one run from Python (a notebook or script): check ``cfg``, build the `Trainer`, run
    it to ``training.steps`` and close it (checkpoints waited for, sinks closed, the summary
    printed). Returns the final train state (``step``, ``tokens_seen``, ...).

    Raises:
        UserError: a bad config, data, checkpoint or run folder (``main`` turns it into exit 2).
        TrainingHealthError: too many consecutive non-finite steps.
    """
    quiet_known_warnings()
    trainer = Trainer(cfg, check_config(cfg))
    try:
        return trainer.train()
    finally:
        trainer.close()


def _print_help(*sections: Optional[str]) -> int:
    """``--help [SECTION ...]`` (``config.help``) on stdout (once under torchrun: rank 0); exit code 0, or 2
    with one line for an unknown section (recorded for the launch scripts: ``_record_exit``)."""
    try:
        text = config_help(*sections)
    except UserError as e:
        print(f"config error: {e}", file=sys.stderr)
        return _record_exit(None, "bad_input", 2)
    if int(os.environ.get("RANK", "0")) == 0:
        print(text)
    return _record_exit(None, "completed", 0)  # nothing left to do: a launcher does not retry


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point: ``python train.py --config FILE [--section.key=value ...]``; ``-h`` / ``--help
    [SECTION]`` prints the usage and the config's keys with their defaults and meanings.

    Returns the exit code, the same on every rank: 0 on success (also after a preemption);
    2 for any ``UserError``: a bad config or an unwritable run folder (nothing is built), launch
    environment, run folder in use, a checkpoint save that failed (disk full) or a non-finite state,
    checkpoint (e.g. made for another model) or data, found at start-up or, for a bad row met
    while reading, at any step on any rank (one line on stderr; every rank stops within the
    step); 1 when the run stops for training health. Rank 0 records the outcome as the exit
    status the launch scripts read (``mhar_titan.exit_status``); a crash records nothing.
    """
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    quiet_known_warnings()
    quiet_other_ranks()  # warnings on rank 0 only, a library's log line once, hub retries as one line
    argv = sys.argv[1:] if argv is None else argv
    if help_request(argv) is not None:  # -h, --help [SECTION ...]: the keys, from the config schema
        return _print_help(*help_request(argv))
    if not argv:  # the defaults alone name no data: say what to pass instead of failing on data.files
        print("config error: no job given: pass --config FILE (e.g. train_configs/debug_mhar.toml) and any "
              "--section.key=value overrides; python train.py --help lists the sections and keys", file=sys.stderr)
        return _record_exit(None, "bad_input", 2)
    cfg = None
    try:
        cfg = load_config(None, argv)
        model_args = check_config(cfg)
    except UserError as e:
        return _refuse(cfg, f"config error: {e}")
    try:
        trainer = Trainer(cfg, model_args)
    except UserError as e:
        if dist.is_initialized():
            dist.barrier()  # every rank refused (the checks agree): leave together
            dist.destroy_process_group()
        return _refuse(cfg, f"cannot start training: {type(e).__name__}: {e}")
    except KeyboardInterrupt:  # Ctrl-C before the stop handler was installed: nothing trained
        raise Interrupted(aborted_line(cfg, None, "during start-up") if _is_rank0() else "") from None
    status, code, refused, aborted = "completed", 0, "", False
    try:
        trainer.train()
        if trainer.preempted:
            status = "preempted"
    except KeyboardInterrupt:  # the second Ctrl-C: abort without saving (no collective, no close)
        aborted = True
    except TrainingHealthError as e:
        print(f"training stopped: {e}", file=sys.stderr)
        status, code = "health", 1
    except UserError as e:
        refused = f"training stopped: {type(e).__name__}: {e}"
        status, code = "bad_input", 2
    finally:
        try:
            if aborted:
                trainer.abort()
            else:
                trainer.close()
        except UserError as e:  # an async checkpoint save that failed (disk full) is reported at close
            refused = f"training stopped: {type(e).__name__}: {e}"
            status, code = "bad_input", 2
    if aborted:
        raise Interrupted(aborted_line(cfg, trainer, f"at step {trainer.state.step}") if _is_rank0() else "")
    if status == "bad_input":
        return _refuse(cfg, refused, trainer.state.step)
    return _record_exit(cfg, status, code, trainer.state.step)


if __name__ == "__main__":  # `python -m mhar_titan.train ...` is `python train.py ...`
    from mhar_titan.cli_args import run_command

    run_command(main)
