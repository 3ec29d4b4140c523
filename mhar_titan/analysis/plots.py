"""matplotlib set-up shared by the analysis figures (headless Agg backend, imported on demand),
the one way they are written to disk, and the figure file format every figure command takes
(``--format png|pdf|svg``)."""
from __future__ import annotations

import pathlib

from mhar_titan.files import atomic_path


FORMATS = ("png", "pdf", "svg")
"""Figure file formats (``--format``): PNG at the command's ``--dpi``, PDF and SVG as vectors."""
_NO_METADATA = {"png": {"Software": None}, "pdf": {"Creator": None, "Producer": None, "CreationDate": None},
                "svg": {"Creator": None, "Date": None}}
"""What each format would otherwise record of the software and the time (the same data give the same bytes)."""


def add_format_argument(parser) -> None:
    """``--format`` of an argparse parser: the figures' file format (``FORMATS``, default png)."""
    parser.add_argument("--format", choices=FORMATS, default="png",
                        help="file format of the figures: png (at --dpi), pdf or svg (vector, for a paper)")


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (no display needed).

    Raises:
        ImportError: matplotlib is not installed (names the fix).
    """
    try:
        import matplotlib
    except ImportError:
        raise ImportError("the analysis figures need matplotlib: pip install -e '.[analysis]' "
                          "(or pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


LEGEND_LINE_IN = 0.16
"""Height (inches) of one legend line at ``heatmap.FONT_PT``: what a legend below the panels adds to a figure."""


def new_figure(rows: int, cols: int, panel_size: tuple[float, float], dpi: int = 100, legend_lines: int = 0,
               **kwargs):
    """(figure, flat list of rows x cols Axes) with constrained layout; panel_size in inches, plus
    ``legend_lines`` x ``LEGEND_LINE_IN`` of height for a legend below the panels (``legend_below``);
    ``kwargs`` go to ``plt.subplots`` (e.g. ``height_ratios``, ``sharex``)."""
    plt = pyplot()
    height = panel_size[1] * rows + legend_lines * LEGEND_LINE_IN
    fig, axes = plt.subplots(rows, cols, figsize=(panel_size[0] * cols, height), dpi=dpi,
                             layout="constrained", squeeze=False, **kwargs)
    return fig, list(axes.flat)


def legend_below(fig, handles, labels, fontsize: float):
    """One legend for the whole figure, below its panels (outside every axes, so it covers no
    data; ``new_figure(legend_lines=len(labels))`` makes the room). Returns the legend."""
    return fig.legend(handles, labels, loc="outside lower center", fontsize=fontsize, frameon=False, ncols=1,
                      handlelength=2.2, labelspacing=0.25, borderaxespad=0.2)


def save_figure(fig, path: str | pathlib.Path, dpi: int) -> pathlib.Path:
    """Write ``fig`` at ``path`` (format from the suffix, one of ``FORMATS``; PNG without one)
    all-or-nothing (``files.atomic_path``), its folders created, without version or date metadata
    (the same data give the same bytes, SVG's element ids included); returns the path."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fmt = path.suffix.lstrip(".").lower() or "png"
    import matplotlib

    with atomic_path(path) as tmp, matplotlib.rc_context({"svg.hashsalt": "mhar-titan"}):
        fig.savefig(tmp, dpi=dpi, format=fmt, metadata=_NO_METADATA.get(fmt))
    return path
