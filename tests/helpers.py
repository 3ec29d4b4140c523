"""Helpers shared by the tests and their worker scripts: the repository root, run-folder readers,
tiny models for the analysis and evaluation tests, PNG checks.

Import with ``from helpers import ...`` (pytest puts tests/ on ``sys.path``; worker
scripts run from tests/ have it as their script folder).
"""
import json
import math
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
"""The repository root."""


def read_metrics(run_dir, name: str = "metrics.jsonl") -> list[dict]:
    """The rows of a run folder's JSONL metrics file, in file order; [] when it does not exist."""
    path = pathlib.Path(run_dir) / name
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def metric_losses(run_dir) -> list[float]:
    """The training loss of every logged step, in step order (the sinks write a NaN as "nan")."""
    rows = sorted((r for r in read_metrics(run_dir) if "loss" in r), key=lambda r: r["step"])
    return [math.nan if r["loss"] == "nan" else float(r["loss"]) for r in rows]


# -- tiny models and figures (analysis, evaluation, generation tests) ------------------------

def tiny_args(**overrides):
    """``ModelArgs`` of a 2-layer d=32 decoder at the gpt2 vocabulary (the real tokenizer fits)."""
    from mhar_titan.models import ModelArgs

    base = dict(dim=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=64, vocab_size=50_304, max_seq_len=64)
    return ModelArgs(**{**base, **overrides})


def tiny_model(seed: int = 0, random_queries: bool = False, **overrides):
    """An initialised ``Transformer(tiny_args(**overrides))`` in eval mode; ``random_queries`` draws
    N(0, 1) pseudo-queries and key norms in [0.5, 1.5] so that routing is far from uniform."""
    import torch

    from mhar_titan.models import Transformer

    torch.manual_seed(seed)
    model = Transformer(tiny_args(**overrides))
    model.init_weights()
    if random_queries:
        with torch.no_grad():
            model.routing.query.normal_()
            model.routing.key_norm.uniform_(0.5, 1.5)
    return model.eval()


def random_tokens(batch: int = 2, length: int = 12, seed: int = 1):
    """(batch, length) int64 ids below the gpt2 vocabulary size, from a seeded generator."""
    import torch

    return torch.randint(0, 50_257, (batch, length), generator=torch.Generator().manual_seed(seed))


def read_png(path):
    """The PNG's pixels as a (height, width, 3) float array in [0, 1]."""
    import numpy as np
    from PIL import Image

    return np.asarray(Image.open(path).convert("RGB"), dtype=np.float64) / 255.0


def assert_not_blank(path) -> None:
    """The image is sizeable, has many distinct colours and is not one flat colour."""
    import numpy as np

    pixels = read_png(path)
    assert pixels.shape[0] > 100 and pixels.shape[1] > 100
    assert pixels.std() > 0.05
    assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 20


def decode_heatmap_cell(pixels, heat, name: str, row: int, col: int) -> float:
    """The value whose colour is at the centre of cell (row, col) of heatmap panel ``name``:
    ``pixels`` from ``read_png`` of the saved figure, ``heat`` what ``plot_routing_heatmaps``
    returned (its axes give the cell positions; the colour map is inverted by nearest colour)."""
    import numpy as np

    from mhar_titan.analysis.plots import pyplot

    x, y = heat.axes[name].transData.transform((col, row))
    rgb = pixels[int(round(pixels.shape[0] - y)), int(round(x))]
    cmap = pyplot().get_cmap(heat.cmap)
    table = cmap(np.linspace(0, 1, cmap.N))[:, :3]
    return heat.vmin + int(np.argmin(((table - rgb) ** 2).sum(1))) / (cmap.N - 1) * (heat.vmax - heat.vmin)


def site_sources(model, tokens) -> list:
    """The sources every routing site of one forward (`hidden_states(tokens)`) routes over, in
    site order, as the model's Router hands them to an observer (`Transformer.observe_routing`)."""
    seen = []
    with model.observe_routing(lambda site, sources, router: seen.append(sources)):
        model.hidden_states(tokens)
    return seen
