"""Preemption: SIGTERM / SIGUSR1 / first Ctrl-C -> finish the current step, save, exit 0.

Clusters stop jobs with SIGTERM: ``torchrun`` forwards the SIGTERM it receives
to its workers and kills them after a grace period (30 s by default); SLURM
sends a warning signal before the time limit (``--signal=B:USR1@120``, turned
into SIGTERM for ``torchrun`` by the batch script, or SIGUSR1 straight to a
single-process run). The handler only records the signal; the training loop
asks ``should_stop()`` after each step and, when it says yes, saves with
``CheckpointManager.save(step, force=True)`` and leaves the loop normally.

Ctrl-C (SIGINT) is a stop request too: the first one is treated like SIGTERM and
prints one line saying so; it also puts Python's default SIGINT handler back, so a
second Ctrl-C raises ``KeyboardInterrupt`` (abort without saving). Under ``torchrun``
the terminal's Ctrl-C reaches the workers directly and the launcher turns its own
SIGINT into SIGTERM for them, so they save the same way.

Ranks can receive the signal at slightly different times, so ``should_stop()``
all-reduces the flag (MAX) over the default process group: every rank gets
the same answer at the same step and they save the same step together.

Long work inside the loop asks too, so a signal does not wait for it: validation
(``Trainer.validate``) calls ``should_stop()`` before every forward of
``validation.local_batch_size`` sequences, and the ``[eval]`` tasks
(``components.downstream``) fold ``requested()`` into the all-reduce they make
before every forward of ``eval.local_batch_size`` sequences. Once the ranks agree,
the work stops (its partial numbers are not logged; the console says so), the
step's checkpoint is saved and the run exits 0. Bound: from the signal to the start
of the save, at most the rest of the current optimizer step or one such forward
(plus, for ``[eval]``, the building of the task being started: lm-eval's task and
request set-up, read from local files), every rank within the same forward. The
saved checkpoint is the state after that optimizer step and lists the evaluations
the signal left unfinished (``TrainState.unfinished``): the resumed run does them
first, on the same weights, then trains exactly as a run never stopped, so its
metrics are that run's.
"""
from __future__ import annotations

import logging
import os
import signal
from types import FrameType
from typing import Optional

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)

_SIGINT_NOTICE = (
    b"\nCtrl-C: finishing this step, saving a checkpoint (if checkpoint.enable) and exiting; "
    b"press Ctrl-C again to abort without saving\n"
)


class PreemptionHandler:
    """Installs handlers for ``signals`` (default SIGTERM, SIGUSR1, SIGINT) on construction.

    Must be created in the main thread (Python delivers signals there). ``restore()``
    puts the previous handlers back.
    """

    def __init__(self, signals: tuple[signal.Signals, ...] = DEFAULT_SIGNALS) -> None:
        self.received: Optional[signal.Signals] = None
        self._previous = {sig: signal.signal(sig, self._on_signal) for sig in signals}

    def _on_signal(self, signum: int, frame: Optional[FrameType]) -> None:
        # Keep the handler minimal: it may run in the middle of any Python bytecode.
        if signum == signal.SIGINT:
            if self.received is None:
                os.write(2, _SIGINT_NOTICE)  # os.write, not print: safe inside a signal handler
            signal.signal(signal.SIGINT, signal.default_int_handler)  # the next Ctrl-C aborts
        if self.received is None or signum != signal.SIGINT:
            self.received = signal.Signals(signum)

    def requested(self) -> bool:
        """Whether this rank has received a stop signal (no collective: for work that agrees
        across ranks by its own collective, ``components.downstream.EvalBudget``)."""
        return self.received is not None

    def should_stop(self) -> bool:
        """Whether any rank has received a stop signal; the same answer on every rank.

        Distributed: one all-reduce of a 1-element tensor on the default group (on the
        current CUDA device under NCCL). Call it at the same point of every step on all ranks.
        """
        flag = self.received is not None
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return flag
        device = torch.device("cpu")
        if dist.get_backend() == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        t = torch.tensor([1.0 if flag else 0.0], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        stop = bool(t.item() > 0)
        if stop and not flag:
            logger.info("another rank received a stop signal: stopping at this step")
        return stop

    def restore(self) -> None:
        """Reinstall the handlers that were active before this one."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}
