"""``python -m mhar_titan.torchrun [torchrun options] train.py ...``: torchrun whose workers' user errors
end the launch with their one line and exit code 2, not with torchrun's ``ChildFailedError`` traceback.

torchrun (``torch.distributed.run``) reports a worker that exits non-zero with an error log line
per worker and a 60-line ``ChildFailedError`` traceback, also when the worker refused bad input
(config, data, checkpoint, memory fit: ``mhar_titan.errors.UserError``, exit 2) and already said
why in one line (``mhar_titan.say_once``). The workers keep exiting 2, so a failed launch is a
failure for torchrun (it stops the other workers), for a bare ``torchrun`` and for SLURM; this
runs torchrun in-process and, when the trainer's exit status (``mhar_titan.exit_status``, written
by global rank 0 as it exits) says ``bad_input``, drops torchrun's failure lines and exits 2
quietly. Ctrl-C twice (the trainer's abort: rank 0 said in one line what was saved, every worker
died of SIGINT) ends the launch with one line and exit status 130, not torchrun's tracebacks. Any
other failure (a crash, another signal, a health stop) keeps torchrun's report and exit code.

The exit status file is ``$MHAR_EXIT_STATUS_FILE`` (``scripts/run_train.sh`` and
``slurm/train.sbatch`` set it; the workers inherit it); without it a temporary file is used.
On several nodes, another node's launcher sees rank 0's status where the file is on a shared file
system (``slurm/train.sbatch`` puts it in the job's log folder); elsewhere it reports as torchrun does.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile
from pathlib import Path
from typing import Optional

from mhar_titan.exit_status import ENV_VAR, read_exit_status

USER_ERROR_EXIT = 2
ABORTED_EXIT = 128 + signal.SIGINT
"""A launch aborted by Ctrl-C: the shell's status of a process that died of SIGINT."""


class _QuietBadInput(logging.Filter):
    """Drop torchrun's "failed (exitcode: 2)" and "closing signal" lines once rank 0 recorded bad input."""

    def __init__(self, status_file: Path):
        super().__init__()
        self.status_file = status_file

    def filter(self, record: logging.LogRecord) -> bool:
        text = str(record.msg)
        if "failed (exitcode" not in text and "closing signal" not in text:
            return True
        return read_exit_status(self.status_file).get("status") != "bad_input"


def main(argv: Optional[list[str]] = None) -> int:
    """Run torchrun with ``argv`` (its own command line); returns the launch's exit code: 0, 2 when
    rank 0 recorded bad input (nothing more printed), else torchrun's (its report printed)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    made = None
    if not os.environ.get(ENV_VAR):
        fd, made = tempfile.mkstemp(prefix="mhar-exit-status.")
        os.close(fd)
        os.unlink(made)
        os.environ[ENV_VAR] = made
    status_file = Path(os.environ[ENV_VAR])
    quiet = _QuietBadInput(status_file)
    loggers = [logging.getLogger(name) for name in ("torch.distributed.elastic.multiprocessing.api",
                                                    "torch.distributed.elastic.agent.server.api")]
    for logger in loggers:
        logger.addFilter(quiet)
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if str(args.nproc_per_node).isdigit() and int(args.nproc_per_node) > 1:
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # what torchrun sets, without its four-line notice
    from torch.distributed.elastic.multiprocessing.api import SignalException

    try:
        run(args)
        return 0
    except ChildFailedError as e:
        if read_exit_status(status_file).get("status") == "bad_input":
            return USER_ERROR_EXIT  # rank 0 (and any rank with other news) printed the one line
        codes = {getattr(f, "exitcode", None) for f in getattr(e, "failures", {}).values()}
        if codes == {-signal.SIGINT}:  # every worker aborted on Ctrl-C: rank 0 said what was saved
            return ABORTED_EXIT
        raise
    except SignalException as e:  # Ctrl-C reached torchrun itself: it stopped its workers
        if e.sigval == signal.SIGINT:
            print("torchrun: interrupted (Ctrl-C); the workers were stopped", file=sys.stderr)
            return ABORTED_EXIT
        raise
    finally:
        for logger in loggers:
            logger.removeFilter(quiet)
        if made is not None:
            Path(made).unlink(missing_ok=True)


if __name__ == "__main__":
    from mhar_titan.cli_args import run_command

    run_command(main)
