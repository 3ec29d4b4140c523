"""Helpers shared by the tests and their worker scripts: the repository root, run-folder readers,
tiny models for the analysis and evaluation tests, PNG checks.

Import with ``from helpers import ...`` (pytest puts tests/ on ``sys.path``; worker
scripts run from tests/ have it as their script folder).
"""
import json
import math
import os
import pathlib
import subprocess
from contextlib import contextmanager

ROOT = pathlib.Path(__file__).resolve().parents[1]
"""The repository root."""


@contextmanager
def tmpfs(path, size, *, leave=None):
    """A real tmpfs of ``size`` (bytes, or mount's ``256k`` / ``1m``) mounted at ``path``; with
    ``leave``, filled by a file ``fill`` until the kernel answers ENOSPC, then shortened so that
    ``leave`` bytes are free (a real full disk). Unmounted at the end whatever happens; the test
    is skipped, saying why, where mounting is not allowed (it needs root with CAP_SYS_ADMIN)."""
    import pytest

    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs at {path} ({done.stderr.strip() or done.returncode}): the real "
                    "filesystem tests need root with mount permission")
    try:
        if leave is not None:
            fd = os.open(path / "fill", os.O_WRONLY | os.O_CREAT, 0o600)
            try:
                written = 0
                while True:
                    try:
                        written += os.write(fd, b"\0" * (1 << 16))
                    except OSError as e:
                        assert e.errno == 28, e  # ENOSPC: the filesystem is full
                        break
                os.ftruncate(fd, max(0, written - leave))
            finally:
                os.close(fd)
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


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


# -- tokenizer folders (conversion and export tests) --------------------------------------------

def llama3_tokenizer_folder(root, corpus: str, specials: list[str], vocab_size: int = 320):
    """A Llama-3-style tokenizer folder in ``root``: original/tokenizer.model (a tiktoken BPE of
    ``vocab_size`` ranks trained on ``corpus``), the tokenizer.json transformers converts it to,
    and tokenizer_config.json naming the special tokens (ids after the ranks; bos the first,
    eos the second). Needs transformers. Returns ``root``."""
    import base64
    import os

    from tiktoken._educational import bpe_train
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from mhar_titan.data.hf_tokenizer import LLAMA3_PATTERN

    root = pathlib.Path(root)
    (root / "original").mkdir(parents=True)
    ranks = bpe_train(corpus, vocab_size=vocab_size, pat_str=LLAMA3_PATTERN, visualise=None)
    (root / "original" / "tokenizer.model").write_text(
        "".join(f"{base64.b64encode(token).decode()} {rank}\n" for token, rank in sorted(ranks.items(), key=lambda x: x[1]))
    )
    ids = {text: len(ranks) + i for i, text in enumerate(specials)}
    saved = os.environ.get("TIKTOKEN_CACHE_DIR")
    os.environ["TIKTOKEN_CACHE_DIR"] = ""  # tiktoken would otherwise cache a copy of the file
    try:
        backend = TikTokenConverter(vocab_file=str(root / "original" / "tokenizer.model"), pattern=LLAMA3_PATTERN,
                                    extra_special_tokens=ids).converted()
    finally:
        if saved is None:
            del os.environ["TIKTOKEN_CACHE_DIR"]
        else:
            os.environ["TIKTOKEN_CACHE_DIR"] = saved
    backend.save(str(root / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": specials[0], "eos_token": specials[1],
        "added_tokens_decoder": {str(i): {"content": t, "special": True, "lstrip": False, "rstrip": False,
                                          "normalized": False, "single_word": False} for t, i in ids.items()},
    }
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    return root


def trained_like_debug(fields: dict, vocab_size: int):
    """A debug-flavor model (``ModelArgs`` ``fields`` on top, e.g. a ``FAMILIES`` row) in eval mode
    with every parameter moved off its init, routing ones included (so that greedy tokens are not
    one repeated id and delta gates are not 0); seeded, the same in every process."""
    import torch

    from mhar_titan.models import ModelArgs, Transformer

    torch.manual_seed(0)
    model = Transformer(ModelArgs.from_flavor("debug", vocab_size=vocab_size, **fields))
    model.init_weights()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.3 if name.startswith("routing.") else 0.05))
    return model.eval()
