"""Progress bars for long commands (evaluation, analysis, pretokenization, data preparation).

One policy for every command: a tqdm bar with count, rate and ETA on stderr, shown only when
both stdout and stderr are terminals, so logs, pipes and CI output stay free of bar redraws.
"""
from __future__ import annotations

import sys
from typing import Iterable, Optional

from tqdm import tqdm


def interactive() -> bool:
    """True when stdout and stderr are both terminals (a person is watching)."""
    return sys.stdout.isatty() and sys.stderr.isatty()


def progress(iterable: Optional[Iterable] = None, *, total: Optional[int] = None, desc: Optional[str] = None,
             unit: str = "it") -> tqdm:
    """Wrap ``iterable`` (or count manually with ``.update(n)``) in a bar that is silent off a terminal.

    Args:
        iterable: what to iterate; None for a manual bar.
        total: number of items (default ``len(iterable)`` when it has one).
        desc: label in front of the bar.
        unit: what one item is ("batch", "token", "file", ...).
    """
    return tqdm(iterable, total=total, desc=desc, unit=unit, file=sys.stderr, disable=not interactive(),
                dynamic_ncols=True, leave=False)
