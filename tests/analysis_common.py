"""Shared by test_analysis*.py, test_eval*.py and test_generate*.py: tiny models and PNG checks."""
import numpy as np
import torch

from mhar_titan.models import ModelArgs, Transformer


def tiny_args(**overrides) -> ModelArgs:
    """A 2-layer d=32 decoder at the gpt2 vocabulary (so the real tokenizer fits)."""
    base = dict(dim=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=64, vocab_size=50_304, max_seq_len=64)
    return ModelArgs(**{**base, **overrides})


def tiny_model(seed: int = 0, random_queries: bool = False, **overrides) -> Transformer:
    """Initialised in eval mode; ``random_queries`` draws N(0, 1) pseudo-queries and key norms
    around 1 so that routing is far from uniform."""
    torch.manual_seed(seed)
    model = Transformer(tiny_args(**overrides))
    model.init_weights()
    if random_queries:
        with torch.no_grad():
            model.routing.query.normal_()
            model.routing.key_norm.uniform_(0.5, 1.5)
    return model.eval()


def tokens(args: ModelArgs, batch: int = 2, length: int = 12, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50_257, (batch, length), generator=g)


def read_png(path) -> np.ndarray:
    """The PNG's pixels as (height, width, 3) floats in [0, 1]."""
    from PIL import Image

    return np.asarray(Image.open(path).convert("RGB"), dtype=np.float64) / 255.0


def assert_not_blank(path) -> None:
    """The image has many distinct colours and is not one flat colour."""
    pixels = read_png(path)
    assert pixels.shape[0] > 100 and pixels.shape[1] > 100
    assert pixels.std() > 0.05
    assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 20
