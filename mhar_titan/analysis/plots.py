"""matplotlib set-up shared by the analysis figures (headless Agg backend, imported on demand)."""
from __future__ import annotations


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


def new_figure(rows: int, cols: int, panel_size: tuple[float, float], dpi: int = 100):
    """(figure, flat list of rows x cols Axes) with constrained layout; panel_size in inches."""
    plt = pyplot()
    fig, axes = plt.subplots(rows, cols, figsize=(panel_size[0] * cols, panel_size[1] * rows), dpi=dpi,
                             layout="constrained", squeeze=False)
    return fig, list(axes.flat)
