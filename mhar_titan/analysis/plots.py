"""matplotlib set-up shared by the analysis figures (headless Agg backend, imported on demand)
and the one way they are written to disk."""
from __future__ import annotations

import pathlib

from mhar_titan.files import atomic_path


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


def new_figure(rows: int, cols: int, panel_size: tuple[float, float], dpi: int = 100, **kwargs):
    """(figure, flat list of rows x cols Axes) with constrained layout; panel_size in inches;
    ``kwargs`` go to ``plt.subplots`` (e.g. ``height_ratios``, ``sharex``)."""
    plt = pyplot()
    fig, axes = plt.subplots(rows, cols, figsize=(panel_size[0] * cols, panel_size[1] * rows), dpi=dpi,
                             layout="constrained", squeeze=False, **kwargs)
    return fig, list(axes.flat)


def save_figure(fig, path: str | pathlib.Path, dpi: int) -> pathlib.Path:
    """Write ``fig`` at ``path`` (format from the suffix, PNG without one) all-or-nothing
    (``files.atomic_path``), its folders created, without version metadata (the same data give
    the same bytes); returns the path."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fmt = path.suffix.lstrip(".") or "png"
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=dpi, format=fmt, metadata={"Software": None} if fmt == "png" else None)
    return path
