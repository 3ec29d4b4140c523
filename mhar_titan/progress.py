"""Progress of long commands (evaluation, analysis, pretokenization, data preparation).

One policy for every command, on stderr:

* on a terminal (stdout and stderr both terminals): a tqdm bar with count, rate and ETA, redrawn in
  place and removed when done;
* otherwise (a log file, a pipe, CI): plain lines, one at most every ``LINE_INTERVAL_S`` seconds,
  the first once the work has run ``LINE_DELAY_S`` seconds (work shorter than that prints
  nothing), and the final count when it ends, for example::

      loglikelihood: 96/400 batch (24%) [00:12<00:38, 8.0 batch/s]

  so that a job's log shows work that runs longer than a few seconds, without bar redraws.
"""
from __future__ import annotations

import sys
from typing import Iterable, Optional, TextIO

from tqdm import tqdm

LINE_INTERVAL_S = 5.0
"""Off a terminal: seconds between two progress lines of one bar (at most)."""
LINE_DELAY_S = 2.0
"""Off a terminal: a bar prints its first line once the work has run this long (seconds)."""
LINE_FORMAT = "{desc}: {n_fmt}/{total_fmt} {unit} ({percentage:.0f}%) [{elapsed}<{remaining}, {rate_fmt}]"
LINE_FORMAT_NO_TOTAL = "{desc}: {n_fmt} {unit} [{elapsed}, {rate_fmt}]"


def interactive() -> bool:
    """True when stdout and stderr are both terminals (a person is watching)."""
    return sys.stdout.isatty() and sys.stderr.isatty()


class _Lines:
    """A stream for tqdm off a terminal: each status tqdm writes (``"\\r" + status``) becomes one
    line; blank writes (the erase before a redraw) are dropped."""

    def __init__(self, stream: TextIO):
        self.stream, self.last = stream, None

    def write(self, text: str) -> None:
        line = text.replace("\r", "").strip()
        if line and line != self.last:  # the final status once (tqdm repeats it at close)
            self.stream.write(line + "\n")
            self.stream.flush()
            self.last = line

    def flush(self) -> None:
        self.stream.flush()


def progress(iterable: Optional[Iterable] = None, *, total: Optional[int] = None, desc: Optional[str] = None,
             unit: str = "it") -> tqdm:
    """Wrap ``iterable`` (or count manually with ``.update(n)``) in progress output (module docstring):
    a bar on a terminal, a line every ``LINE_INTERVAL_S`` seconds elsewhere.

    Args:
        iterable: what to iterate; None for a manual bar.
        total: number of items (default ``len(iterable)`` when it has one).
        desc: label in front of the bar.
        unit: what one item is ("batch", "token", "file", ...).
    """
    if interactive():
        return tqdm(iterable, total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True, leave=False)
    if total is None and iterable is not None and hasattr(iterable, "__len__"):
        total = len(iterable)
    bar = tqdm(iterable, total=total, desc=desc or "progress", unit=unit, file=_Lines(sys.stderr),
               bar_format=LINE_FORMAT if total else LINE_FORMAT_NO_TOTAL, mininterval=LINE_INTERVAL_S,
               maxinterval=LINE_INTERVAL_S, delay=LINE_DELAY_S, miniters=1, smoothing=0, leave=True)
    # the first line at the first item after LINE_DELAY_S, not after LINE_INTERVAL_S
    bar.last_print_t -= LINE_INTERVAL_S - LINE_DELAY_S
    return bar
