"""Say each thing once in a launch of N ranks: a user's error, a Python warning, a hub retry.

``report_user_error(prefix, error)`` prints a ``UserError`` (bad config, data, checkpoint, launch
environment, memory fit) the way a person wants to read it from N ranks: global rank 0 prints its
line; another rank prints its own only where it says something else (for example the one rank
whose data file is bad); a rank whose message is rank 0's, or is quoted in rank 0's (the "rank k
could not start: ..." every rank raises after ``components.ranks.agree_on_setup``), prints nothing.
The ranks compare messages through the launch's key-value store (torchrun's agent store at
``MASTER_ADDR:MASTER_PORT``, which exists before any process group: config errors are compared
too): each failing rank publishes its message, and no failing rank leaves before all have said
what differs (at most ``WAIT_S``), so torchrun, which stops the others when one exits, cuts nothing. Measured numbers
(decimals: the memory each rank measured) do not count as a difference. One process, or a launch
without a store: the line is printed as before.

``quiet_other_ranks()``: Python warnings and log records below ERROR print on rank 0 only (every rank
meets the same library warning and the same config warning: one is enough; ranks other than 0 still
print errors), and a library logger with its own handler (huggingface_hub, datasets) is not printed a
second time by the root logger's handler.

``HubRetries``: huggingface_hub retries a failed request on its own, logging two warnings per retry
(the error, then "Retrying in 2s [Retry 2/5]"); the filter turns them into one line per request
naming it, the error and how many retries huggingface_hub makes, and drops the rest, so an
unreachable hub reads as one counted line (the run's own error follows when the retries are spent).

The exit itself (exit 2 without torchrun's ``ChildFailedError`` traceback) is ``mhar_titan.torchrun``'s.
"""
from __future__ import annotations

import datetime
import logging
import os
import re
import sys
import warnings
from typing import Optional

WAIT_S = 15.0
"""Seconds a failing rank waits for rank 0's message, and rank 0 for the other failing ranks'."""

_KEY = "mhar_titan/user_error"


def _rank_world() -> tuple[int, int]:
    return int(os.environ.get("RANK", "0") or 0), int(os.environ.get("WORLD_SIZE", "1") or 1)


def _store():
    """A client of the launch's store (torchrun's agent store), or None outside torchrun."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    try:
        from torch.distributed import TCPStore

        return TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=WAIT_S),
                        wait_for_workers=False)
    except Exception:  # no store to compare with: every rank prints, as before
        return None


def _same(text: str) -> str:
    """A message with its measured decimals masked (ranks measure their own free memory)."""
    return re.sub(r"\d+\.\d+", "#", text)


def _prefix() -> str:
    """Keys of this launch attempt (torchrun reuses its store across restarts)."""
    return f"{_KEY}/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def report_user_error(line: str, stream=None) -> bool:
    """Print ``line`` (one line naming a user's error) once for the launch (module docstring).

    Call it after global rank 0 wrote the exit status (``exit_status``): no rank leaves this
    function before rank 0 has printed, so when the first rank exits (and torchrun stops the
    others) the status already says ``bad_input``. Returns True when this process printed the
    line. Never raises: a store that cannot be reached means the line is printed here.
    """
    stream = stream or sys.stderr
    rank, world = _rank_world()
    store = _store() if world > 1 else None
    if store is None:
        print(line, file=stream, flush=True)
        return True
    prefix, wait = _prefix(), datetime.timedelta(seconds=WAIT_S)
    try:
        store.set(f"{prefix}/{rank}", line)
        if rank == 0:
            first, said = line, True
        else:
            try:
                store.wait([f"{prefix}/0/said"], wait)
                first = store.get(f"{prefix}/0").decode()
            except Exception:  # rank 0 did not fail: this rank's error is news
                first = None
            said = first is None or (_same(line) != _same(first)
                                     and _same(line.split(": ", 1)[-1]) not in _same(first))
        if said:
            print(line if rank == 0 else f"[rank {rank}] {line}", file=stream, flush=True)
        store.set(f"{prefix}/{rank}/said", "1")
        if first is not None:  # every failing rank has said its piece before any leaves (torchrun then stops the rest)
            try:
                store.wait([f"{prefix}/{r}/said" for r in range(world)], wait)
            except Exception:
                pass  # a rank that did not fail says nothing
        return said
    except Exception:
        print(line, file=stream, flush=True)
        return True


class _PrintedByLibrary(logging.Filter):
    """For the root logger's handlers: drop a record that a logger on its way up already printed
    with a handler of its own (huggingface_hub and datasets add one), so it is not printed twice."""

    def filter(self, record: logging.LogRecord) -> bool:
        logger = logging.getLogger(record.name)
        while logger is not None and logger is not logging.root:
            if logger.handlers:
                return False
            if not logger.propagate:
                return True
            logger = logger.parent
        return True


class HubRetries(logging.Filter):
    """For huggingface_hub's HTTP logger: one line per request that needs retries (module docstring)."""

    THROWN = re.compile(r"^(?:'(?P<error>.*)'|HTTP Error (?P<status>\d+)) thrown while requesting (?P<what>\S+ \S+)$",
                        re.S)
    RETRY = re.compile(r"\[Retry (?P<k>\d+)/(?P<n>\d+)\]")

    def __init__(self):
        super().__init__()
        self.last: Optional[tuple[str, str]] = None  # (request, error) of the last failure
        self.announced: set[str] = set()
        self.retries: dict[str, int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        thrown = self.THROWN.match(text)
        if thrown:
            self.last = (thrown["what"], thrown["error"] or f"HTTP {thrown['status']}")
            return False
        retry = self.RETRY.search(text)
        if retry is None or self.last is None:
            return True
        what, error = self.last
        self.retries[what] = self.retries.get(what, 0) + 1
        if what in self.announced:
            return False
        self.announced.add(what)
        record.msg, record.args = (f"hub: {what} failed ({error}); huggingface_hub retries it up to {retry['n']} "
                                   "times, further failures of this request are counted, not printed"), None
        return True


def quiet_other_ranks() -> None:
    """Warnings on rank 0 only; no second copy of a library's own log lines; huggingface_hub's
    retries as one line per request (`HubRetries`). Call after the root logger is configured."""
    rank, _ = _rank_world()
    if rank != 0:  # the same warnings as rank 0's: its errors still print (and user errors, `report_user_error`)
        warnings.simplefilter("ignore")
        logging.root.setLevel(logging.ERROR)
    for handler in logging.root.handlers:
        if not any(isinstance(f, _PrintedByLibrary) for f in handler.filters):
            handler.addFilter(_PrintedByLibrary())
    one_line_hub_retries()


def one_line_hub_retries() -> None:
    """huggingface_hub's retries of a request as one line (`HubRetries`), for every command that
    may reach the hub (training's hub data, lm-eval's task data)."""
    http = logging.getLogger("huggingface_hub.utils._http")
    if not any(isinstance(f, HubRetries) for f in http.filters):
        http.addFilter(HubRetries())
