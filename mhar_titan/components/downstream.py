"""Downstream tasks during training (``[eval]``): lm-eval tasks scored every ``eval.freq`` steps on
the training model, sharded across the data-parallel ranks, within a time budget.

The tasks run through ``mhar_titan.eval.tasks.run_tasks`` (lm-eval's ``simple_evaluate``, one task
at a time) on ``ShardedLM``, the evaluation adapter (``mhar_titan.eval.lm_eval_adapter.MharLM``)
whose scoring is split over the ranks: every log-likelihood request list is dealt round-robin
(request i to rank i mod world), padded to the same length on every rank, scored in forwards of
``eval.local_batch_size`` sequences (the same number of forwards on every rank, as FSDP needs)
and gathered, so every rank hands lm-eval every answer (lm-eval computes the metrics on local
rank 0; global rank 0 logs them). A
standalone ``python -m mhar_titan.eval lm-eval`` of the saved checkpoint therefore gives the same
accuracies and the same log-likelihoods up to float rounding of other batch shapes.

Nothing of the training changes: the model's train/eval mode is restored, the global random
generators (Python, NumPy, torch CPU and CUDA) are saved before and restored after (lm-eval's
own seeding is off; its few-shot sampler keeps its own seed), and no gradient is computed.

Time budget (``eval.time_budget_s``): before every forward the ranks agree, on rank 0's clock
(``clock``, ``time.monotonic`` unless a test passes another), whether the evaluation's time is
spent; if so the task being scored stops (its partial numbers are not logged) and the tasks after
it are skipped. A stop signal (``stop_requested``, the trainer's ``PreemptionHandler.requested``)
joins the same agreement: when any rank has one, the evaluation stops before the next forward on
every rank and ``evaluate`` returns None (nothing is logged; the trainer saves, and the resumed
run evaluates that step first). Logged per evaluation: ``eval/<task>/<metric>`` (a filter other
than lm-eval's "none" is appended as ``/<filter>``), ``eval/sequences`` (sequences scored over all
ranks), ``eval/tasks_over_budget`` and ``eval/seconds``.
"""
from __future__ import annotations

import contextlib
import logging
import math
import random
import time
from typing import Callable, Optional

import numpy as np
import torch
import torch.distributed as dist

from mhar_titan.errors import UserError
from mhar_titan.eval.lm_eval_adapter import MharLM

logger = logging.getLogger(__name__)
SCORED_OUTPUT_TYPES = ("multiple_choice", "loglikelihood", "loglikelihood_rolling")


class DownstreamEvalError(UserError, ValueError):
    """A task ``[eval]`` cannot run in training (unknown, a generation task, lm-eval missing)."""


class EvalBudget:
    """Whether an evaluation may go on, the same answer on every rank: its time is left (rank 0's
    clock) and no rank has a stop signal (``stop_requested``: this rank's flag, no collective).
    ``stopped`` says the answer was no because of a stop signal."""

    def __init__(self, seconds: Optional[float], clock: Callable[[], float], world_size: int,
                 device: torch.device, stop_requested: Optional[Callable[[], bool]] = None):
        self.seconds, self.clock, self.world_size, self.device = seconds, clock, world_size, device
        self.stop_requested = stop_requested
        self.t0 = 0.0
        self.stopped = False

    def start(self) -> None:
        self.t0 = self.clock()

    def left(self, rank: int) -> bool:
        """True while time is left (always without a budget) and no rank has a stop signal. One
        all-reduce (MAX of rank 0's "time spent" and every rank's stop flag) when world_size > 1."""
        if self.seconds is None and self.stop_requested is None:
            return True
        spent = self.seconds is not None and rank == 0 and self.clock() - self.t0 >= self.seconds
        stop = self.stopped or (self.stop_requested is not None and self.stop_requested())
        if self.world_size > 1:
            flags = torch.tensor([int(spent), int(stop)], device=self.device)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            spent, stop = flags.tolist()
        self.stopped = bool(stop)
        return not (spent or stop)


class ShardedLM(MharLM):
    """``MharLM`` whose scoring is dealt over the ranks and stops when the budget is spent.

    ``generate_until`` raises ``DownstreamEvalError`` (decoding lengths differ between requests,
    so the ranks' forwards would not line up under FSDP).
    """

    def __init__(self, model, tokenizer, batch_size: int, rank: int, world_size: int, budget: EvalBudget):
        super().__init__(model, tokenizer, batch_size=batch_size)
        self.rank_, self.world = rank, world_size
        self.budget = budget
        self.over_budget = False
        self.sequences = 0

    def _score(self, pieces, *_, **__):  # the adapter's progress label, if any: the trainer's console shows none
        n, world = len(pieces), self.world
        per_rank = math.ceil(n / world)
        local = [pieces[i] if i < n else pieces[0] for i in range(self.rank_, per_rank * world, world)]
        results: list = []
        for start in range(0, per_rank, self.batch_size):
            if self.over_budget or not self.budget.left(self.rank_):
                self.over_budget = True
                results += [(math.nan, False)] * (per_rank - start)
                break
            chunk = local[start:start + self.batch_size]
            results += super()._score(chunk)
            self.sequences += len(chunk) * world
        if world == 1:
            return results
        gathered = [None] * world
        dist.all_gather_object(gathered, results)
        out = [None] * n
        for r, rank_results in enumerate(gathered):
            for j, value in enumerate(rank_results):
                if r + j * world < n:
                    out[r + j * world] = value
        return out

    def generate_until(self, requests, disable_tqdm: bool = False):
        raise DownstreamEvalError("in-training evaluation scores log-likelihood tasks only; evaluate generation "
                                  "tasks on a checkpoint with python -m mhar_titan.eval lm-eval")


@contextlib.contextmanager
def untouched_training_state(model: torch.nn.Module):
    """Eval mode and no gradients inside; afterwards the model's mode and every global random
    generator (Python, NumPy, torch CPU and CUDA) are as they were."""
    mode = model.training
    states = (random.getstate(), np.random.get_state(), torch.get_rng_state(),
              torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None)
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(mode)
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        if states[3] is not None:
            torch.cuda.set_rng_state_all(states[3])


@contextlib.contextmanager
def quiet_lm_eval():
    """lm-eval's INFO lines (task building, request counts) off the training console; warnings stay."""
    lm_eval_logger = logging.getLogger("lm_eval")
    level = lm_eval_logger.level
    lm_eval_logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        lm_eval_logger.setLevel(level)


def metric_rows(results: dict) -> dict:
    """lm-eval's ``results["results"]`` as ``{"eval/<task>/<metric>[/<filter>]": value}`` (numbers only,
    standard errors left out)."""
    row = {}
    for task, metrics in results.get("results", {}).items():
        for key, value in metrics.items():
            if "," not in key or "_stderr" in key or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            metric, flt = key.split(",", 1)
            row[f"eval/{task}/{metric}" + ("" if flt == "none" else f"/{flt}")] = float(value)
    return row


class DownstreamEval:
    """The ``[eval]`` tasks of a run.

    Built before the model (the task names and output types are checked then, one
    ``DownstreamEvalError`` naming the task); ``evaluate(model)`` on every rank together.

    Args:
        cfg: the ``[eval]`` section (``mhar_titan.config.sections.Eval``).
        tokenizer: the run's tokenizer.
        rank, world_size, device: this rank's place in the data-parallel group.
        clock: seconds for the time budget (read on rank 0 only).
        stop_requested: whether this rank has a stop signal (``PreemptionHandler.requested``; may be
            set after construction); checked with the budget before every forward.
    """

    def __init__(self, cfg, tokenizer, rank: int, world_size: int, device: torch.device,
                 clock: Callable[[], float] = time.monotonic, stop_requested: Optional[Callable[[], bool]] = None):
        from mhar_titan.eval.tasks import task_manager

        self.cfg, self.tokenizer = cfg, tokenizer
        self.rank, self.world_size, self.device = rank, world_size, device
        self.clock = clock
        self.stop_requested = stop_requested
        self._warned: set[str] = set()  # tasks already warned of as too small (eval.tasks.few_examples)
        try:
            self.manager = task_manager(cfg.tasks, cfg.include_path, setting="eval.include_path")
            self._check_output_types()
        except (ValueError, FileNotFoundError) as e:
            raise DownstreamEvalError(f"[eval]: {e}") from None

    def _check_output_types(self) -> None:
        for name, task in self.manager.load(list(self.cfg.tasks))["tasks"].items():
            kind = getattr(task, "OUTPUT_TYPE", None)
            if kind not in SCORED_OUTPUT_TYPES:
                raise ValueError(f"task {name} is a {kind} task; in training only log-likelihood tasks run "
                                 f"({', '.join(SCORED_OUTPUT_TYPES)}): evaluate it on a checkpoint with "
                                 "python -m mhar_titan.eval lm-eval")

    def due(self, step: int, total_steps: int) -> bool:
        return step % self.cfg.freq == 0 or step == total_steps

    def evaluate(self, model: torch.nn.Module) -> Optional[dict]:
        """Score the tasks on ``model`` (every rank together); returns the metrics row (the task metrics
        only where lm-eval returns them: on local rank 0, which includes the logging rank), or None on
        every rank when a stop signal ended it (within one forward: module docstring)."""
        from mhar_titan.eval.tasks import few_examples, run_tasks

        began = time.perf_counter()
        budget = EvalBudget(self.cfg.time_budget_s, self.clock, self.world_size, self.device, self.stop_requested)
        row, over, sequences = {}, 0, 0
        with untouched_training_state(model), quiet_lm_eval():
            budget.start()
            for task in self.cfg.tasks:
                lm = ShardedLM(model, self.tokenizer, self.cfg.local_batch_size, self.rank, self.world_size, budget)
                if not budget.left(self.rank):
                    if budget.stopped:
                        return None
                    over += 1
                    continue
                results = run_tasks(lm, [task], self.manager, limit=self.cfg.limit, num_fewshot=self.cfg.num_fewshot,
                                    bootstrap_iters=0, seeded=False)
                sequences += lm.sequences
                if budget.stopped:
                    return None
                if lm.over_budget:
                    over += 1
                elif results is not None:  # lm-eval returns its results on LOCAL_RANK 0 only
                    row.update(metric_rows(results))
                    if task not in self._warned:  # once per task and run, on the logging rank
                        self._warned.add(task)
                        for warning in few_examples(results):
                            logger.warning("[eval] %s", warning)
        row.update({"eval/sequences": sequences, "eval/tasks_over_budget": over,
                    "eval/seconds": time.perf_counter() - began})
        return row
