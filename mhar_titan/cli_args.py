"""What every command line of the project shares: its parser and the checks of its flags.

* ``ArgumentParser``: argparse's, but a bad command line ends in one line on stderr,
  ``PROG: error: argument --flag: what is wrong (see PROG --help)``, and exit status 2 (argparse's
  own usage block is left out; ``--help`` prints it).
* argparse ``type=`` functions that check a flag's value while the command line is parsed, so a
  bad value stops the command before anything is loaded, with the flag's name:
  ``positive_int``, ``non_negative_int``, ``positive_float``, ``non_negative_float``,
  ``probability`` (in (0, 1]), ``device`` (a torch device this machine has: ``cuda`` on a CPU-only
  torch is refused) and ``escaped_text``.

``escaped_text`` reads backslash escapes, so that a shell's ``--stop "\\n\\n"`` (the shell passes the
four characters backslash, n, backslash, n) means two newlines: ``\\n`` (newline), ``\\t`` (tab),
``\\r`` (carriage return), ``\\\\`` (one backslash), ``\\xHH`` and ``\\uHHHH`` (that code point, hex).
A backslash before any other character stays as it is. ``$'\\n\\n'`` (bash's own quoting) passes
real newlines, which are kept.

``run_command(main, *args)`` is every entry point's ``__main__`` block (``python -m mhar_titan.*``,
``train.py``, ``scripts/``, ``bench/``): it exits with ``main``'s status, and when the output is piped
into a reader that stops early (``python -m mhar_titan.models | head -1``) it ends quietly instead of
with a BrokenPipeError traceback. A Ctrl-C that aborts a command (``KeyboardInterrupt``; the
trainer's second one) ends it with one line instead of a traceback: the ``Interrupted`` line the
command raised (the trainer says what was last saved), else ``PROG: interrupted (Ctrl-C)``; then
the process dies of SIGINT, as Python's own exit after an uncaught ``KeyboardInterrupt`` does (a
shell loop running it stops too).

This module imports nothing of the project (torch only inside ``device``), so every command can use it.
"""
from __future__ import annotations

import argparse
import math
import os
import re
import signal
import sys
from typing import Callable, NoReturn, Optional

__all__ = ["run_command", "Interrupted", "BROKEN_PIPE_EXIT", "ArgumentParser", "positive_int", "non_negative_int", "positive_float", "non_negative_float",
           "probability", "device", "escaped_text", "cuda_unavailable_reason"]


BROKEN_PIPE_EXIT = 1
"""The exit status of a command whose stdout reader went away (Python's recipe; a shell pipeline such as
``| head -1`` reports the last command's status, so its user sees 0 unless ``set -o pipefail``)."""


def _stdout_reader_gone() -> bool:
    """Whether stdout is a pipe or socket whose reading end is closed (poll says POLLERR or POLLHUP).
    Where poll cannot tell (no ``select.poll``, stdout not a file descriptor), True: Python's recipe."""
    import select

    try:
        fd = sys.__stdout__.fileno()
        poller = select.poll()
    except (AttributeError, ValueError, OSError):
        return True
    poller.register(fd, select.POLLOUT)
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))


class Interrupted(KeyboardInterrupt):
    """A Ctrl-C that aborted a command, with the one line ``run_command`` prints for it ("" for none:
    the trainer's ranks other than 0, whose rank 0 says it)."""

    def __init__(self, line: str):
        super().__init__(line)
        self.line = line


def _interrupted(main: Callable, error: KeyboardInterrupt) -> NoReturn:
    """Print the abort's one line on stderr, then die of SIGINT (exit status -2 to a parent, 130 in a shell)."""
    if isinstance(error, Interrupted):
        line = error.line
    else:
        module = getattr(main, "__module__", "") or ""
        prog = f"python -m {module.removesuffix('.__main__')}" if module.startswith("mhar_titan") else \
            os.path.basename(sys.argv[0] or "command")
        line = f"{prog}: interrupted (Ctrl-C)"
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass
    if line and sys.stderr is not None:
        print(line, file=sys.stderr, flush=True)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)
    sys.exit(128 + signal.SIGINT)  # where SIGINT does not end the process (it is ignored)


def run_command(main: Callable[..., Optional[int]], *args) -> NoReturn:
    """Run a command's ``main(*args)`` and exit with the status it returns (None: 0); every entry point's
    ``__main__`` block is ``run_command(main)``.

    Output piped into a reader that stops early (``| head -1``) makes the next write to stdout raise
    BrokenPipeError, inside ``main`` or at the final flush. The command then ends without a traceback,
    with exit status ``BROKEN_PIPE_EXIT`` (1): stdout is pointed at ``os.devnull`` so that the
    interpreter's last flush of what is still buffered does not fail again (the recipe of Python's
    ``signal`` docs, "Note on SIGPIPE"). A BrokenPipeError while stdout's reader is still there (a
    socket, a subprocess's stdin) is raised as any other error.

    A ``KeyboardInterrupt`` (Ctrl-C) ends the command with one line (module docstring) and SIGINT.

    Raises:
        SystemExit: always, with ``main``'s status.
    """
    try:
        code = main(*args)
        if sys.stdout is not None:  # None where the command started with stdout closed (``>&-``)
            sys.stdout.flush()  # what is still buffered fails here, inside the handler, not at shutdown
    except KeyboardInterrupt as e:  # Ctrl-C: one line, not a traceback
        _interrupted(main, e)
    except BrokenPipeError:
        if not _stdout_reader_gone():
            raise
        if sys.__stdout__ is not None:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.__stdout__.fileno())
            os.close(devnull)
        code = BROKEN_PIPE_EXIT
    sys.exit(code)


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors are one line (``PROG: error: MESSAGE (see PROG --help)``)
    on stderr with exit status 2. Its subcommand parsers are of the same class."""

    def error(self, message: str):  # noqa: D401 (argparse's hook)
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def number(text: str) -> float:
    """Any finite number (a plot's axis limit)."""
    return _number(text)


def positive_int(text: str) -> int:
    """An integer >= 1 (a count: tokens, batches, sequences per batch)."""
    value = _integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer (1 or more), got {text}")
    return value


def non_negative_int(text: str) -> int:
    """An integer >= 0 (a step, a number of few-shot examples)."""
    value = _integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0 (a size, a rate)."""
    value = _number(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    """A finite number >= 0 (a temperature: 0 = greedy)."""
    value = _number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value


def probability(text: str) -> float:
    """A number in (0, 1] (top-p, a utilisation)."""
    value = _number(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {text}")
    return value


def cuda_unavailable_reason() -> str | None:
    """Why ``cuda`` cannot be used here (a CPU-only torch build, or no GPU visible), or None when it can."""
    import torch

    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return f"this torch ({torch.__version__}) is a CPU-only build"
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible to this process (driver, CUDA_VISIBLE_DEVICES?)"
    return None


def device(text: str) -> str:
    """A torch device this machine has: ``cpu``, ``cuda``, ``cuda:N`` (N below the GPU count) or
    ``mps``; returned as torch spells it. ``cuda`` on a CPU-only torch, or without a visible GPU, is
    refused with the reason."""
    import torch

    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device: use cpu, cuda, cuda:N or mps") from None
    if dev.type == "cuda":
        why = cuda_unavailable_reason()
        if why is not None:
            raise argparse.ArgumentTypeError(f"{text}: {why}; use --device cpu")
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise argparse.ArgumentTypeError(f"{text}: this machine has {count} CUDA device(s), cuda:0 to "
                                             f"cuda:{count - 1}")
    elif dev.type == "mps":
        if not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
            raise argparse.ArgumentTypeError(f"{text}: MPS is not available on this machine; use --device cpu")
    elif dev.type != "cpu":
        raise argparse.ArgumentTypeError(f"{text}: the commands run on cpu, cuda, cuda:N or mps")
    return str(dev)


_ESCAPE = re.compile(r"\\(\\|n|t|r|x[0-9A-Fa-f]{2}|u[0-9A-Fa-f]{4})")
_SIMPLE = {"\\": "\\", "n": "\n", "t": "\t", "r": "\r"}


def escaped_text(text: str) -> str:
    """``text`` with its backslash escapes read (``\\n``, ``\\t``, ``\\r``, ``\\\\``, ``\\xHH``,
    ``\\uHHHH``; any other backslash stays). Non-ASCII text is kept as it is."""
    return _ESCAPE.sub(lambda m: _SIMPLE.get(m.group(1)) or chr(int(m.group(1)[1:], 16)), text)
