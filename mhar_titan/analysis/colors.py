"""One colour per arm in every figure: the arm -> colour mapping of the run and sweep figures.

An arm is what model a curve is, in the family table's terms (``models.args.family_name`` of the
run's resolved ``[model]``, e.g. ``"mhar H=8"`` or ``"attn_res H=1 + routing_logit_scale='match_heads:8'"``;
``RunCurves.arm``); a curve without one (a run folder without ``config.toml``) is keyed by its
name. The colour depends on the arm's name, not on the other curves of the figure, so an arm has
the same colour in every panel and every figure of ``analysis compare`` and ``experiments
results`` (the loss curves, the difference panel, the learned temperatures):

* the rows of ``FAMILIES``, in table order, take the first ``PALETTE`` colours (the baseline
  black, the colour of the difference panel's zero line, which stands for the baseline);
* any other arm (a row with keys added, a new row past the palette's reserved colours) takes the
  colour its name hashes to (SHA-1) among the colours no row reserves, so a new arm gets its own
  colour without being listed anywhere.

Two arms of one figure that hash to the same colour: the one later in name order takes the next
free colour (the same for the same set of arms); ``tests/test_analysis_figures.py`` checks that the
arms of the shipped sweeps never collide, so their colours are the same in every figure. Curves
of one arm (grid points of a sweep, runs of one family) share its colour and differ in line style
(``curve_styles``). Grey is no arm's colour: the temperature figures draw fixed scales in grey.
"""
from __future__ import annotations

import hashlib
from typing import Optional, Sequence

PALETTE = ("#000000", "#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#8C564B", "#9467BD",
           "#BCBD22", "#17BECF", "#E7298A", "#66A61E", "#A6761D", "#6A3D9A", "#1B7837", "#F781BF", "#7570B3",
           "#E41A1C", "#00008B")
"""The arm colours: Okabe and Ito's colour-blind-safe set (without its yellow), then colours of
matplotlib's tab10 and ColorBrewer's Dark2, Paired, PRGn and Set1 that differ from them; no grey."""
LINE_STYLES = ("-", "--", ":", "-.")
"""Line styles of the curves that share an arm's colour, in curve order."""
_SALT = b"mhar-arm-colour-20:"  # the shipped sweeps' arms hash to distinct colours with it (a test checks)


def _rows() -> list[str]:
    from mhar_titan.models.args import FAMILIES

    return list(FAMILIES)


def preferred_color(arm: str) -> int:
    """The ``PALETTE`` index of ``arm`` before collisions: its ``FAMILIES`` row's position, else
    the hash of its name among the indices no row reserves."""
    rows = _rows()
    if arm in rows and rows.index(arm) < len(PALETTE):
        return rows.index(arm)
    free = range(min(len(rows), len(PALETTE) - 1), len(PALETTE))
    digest = int.from_bytes(hashlib.sha1(_SALT + arm.encode()).digest()[:8], "big")
    return free[digest % len(free)]


def arm_colors(arms: Sequence[str]) -> dict[str, str]:
    """The colour of each distinct arm of one figure (a ``PALETTE`` entry), distinct while the
    figure has at most ``len(PALETTE)`` arms (more: the palette repeats)."""
    distinct = list(dict.fromkeys(arms))
    taken: dict[int, str] = {}
    out = {}
    rows = _rows()[:len(PALETTE)]
    for arm in sorted(distinct, key=lambda a: (a not in rows, a)):  # the rows' reserved colours first
        k = preferred_color(arm)
        for step in range(len(PALETTE)):
            if (k + step) % len(PALETTE) not in taken:
                k = (k + step) % len(PALETTE)
                break
        taken[k] = arm
        out[arm] = PALETTE[k]
    return {arm: out[arm] for arm in distinct}


def curve_key(name: str, arm: Optional[str]) -> str:
    """What a curve's colour is keyed by: its arm, or its name when the arm is unknown."""
    return arm if arm else name


def curve_styles(curves: Sequence[tuple[str, Optional[str]]]) -> list[tuple[str, str]]:
    """(colour, line style) of each curve, given as (name, arm): the arm's colour (``arm_colors``
    over the figure's arms), and the k-th curve of an arm the k-th of ``LINE_STYLES``."""
    keys = [curve_key(name, arm) for name, arm in curves]
    colors = arm_colors(keys)
    seen: dict[str, int] = {}
    out = []
    for key in keys:
        k = seen.get(key, 0)
        seen[key] = k + 1
        out.append((colors[key], LINE_STYLES[k % len(LINE_STYLES)]))
    return out
