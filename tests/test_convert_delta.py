"""Conversion of an imported Llama model to delta-MHAR (issue 14, acceptance 2), in both layouts:
identical logits and first loss, then 20 steps of the recipe's re-warmup on real text."""
from __future__ import annotations

import pathlib

import pytest
import torch

from mhar_titan.config import LRScheduler, Optimizer
from mhar_titan.convert import ConversionError
from mhar_titan.convert.delta import convert_to_delta, delta_args
from mhar_titan.models import ModelArgs, Transformer
from mhar_titan.optim import build_lr_scheduler, build_optimizer

SAMPLE = pathlib.Path(__file__).resolve().parents[1] / "data" / "shakespeare" / "validation-00000-of-00001.parquet"
LAYOUTS = ["paper", "clean"]
STEPS, BATCH, SEQ = 20, 4, 64


pytestmark = pytest.mark.usefixtures("one_thread")


def llama_like(vocab_size: int) -> Transformer:
    """A Llama-shaped decoder (no qk-norm, llama3 RoPE, norm eps 1e-5, untied) with random weights."""
    args = ModelArgs(dim=64, n_layers=6, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=vocab_size, max_seq_len=SEQ,
                     norm_eps=1e-5, rope_theta=500_000.0, rope_scaling="llama3", rope_original_max_seq_len=32,
                     qk_norm=False, tie_embeddings=False)
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    return model


@pytest.fixture(scope="module")
def batches():
    """STEPS fixed (inputs, labels) batches of Shakespeare text, one token per UTF-8 byte (a
    256-token vocabulary keeps the LM head small enough for a fast test)."""
    pq = pytest.importorskip("pyarrow.parquet")
    if not SAMPLE.is_file():
        pytest.skip(f"{SAMPLE} missing: run `make setup` (python -m mhar_titan.data.prepare_shakespeare)")
    text = "\n".join(pq.read_table(SAMPLE).column("text").to_pylist())
    ids = torch.tensor(list(text.encode()[: STEPS * BATCH * (SEQ + 1)]))
    windows = ids.view(STEPS, BATCH, SEQ + 1)
    return [(w[:, :-1], w[:, 1:]) for w in windows]


def recipe_optimizer(model):
    """The recipe's optimizer and re-warmup schedule (train_configs/midtrain_llama3_8b_delta_mhar.toml),
    warmup and decay scaled to STEPS steps: AdamW 4e-4, wd 0.05 not on embeddings/norms/biases,
    linear re-warmup then 1-sqrt decay to 4e-6."""
    optimizer = build_optimizer(model, Optimizer(lr=4e-4, weight_decay=0.05, no_decay=["embeddings", "norms", "biases"]))
    schedule = build_lr_scheduler(optimizer, LRScheduler(warmup_steps=4, decay_type="sqrt", min_lr_factor=0.01), STEPS)
    return optimizer, schedule


def loss_of(model, x, y):
    return torch.nn.functional.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_conversion_preserves_the_model_and_trains_like_it(batches, layout):
    data = batches
    base, other = llama_like(256), llama_like(256)
    converted = convert_to_delta(other, layout=layout)
    assert converted.args.routing_layout == layout and converted.args.resolved_routing_heads == 8
    assert converted.args.routing_block_layers == 4 and converted.routing.null_source is not None
    x, _ = data[0]
    with torch.no_grad():
        assert torch.equal(base(x), converted(x))

    runs = {}
    for name, model in (("base", base), ("converted", converted)):
        optimizer, schedule = recipe_optimizer(model)
        losses = []
        for step, (x, y) in enumerate(data):
            loss = loss_of(model, x, y)
            loss.backward()
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            if name == "converted" and step == 0:
                moved = (model.routing.alpha != 0).flatten().tolist()
                if layout == "paper":
                    # layer 0's attention site reads only its null: mix = null = 0, so its gate and
                    # null get zero gradients and stay 0 (a dead site of the authors' bookkeeping)
                    assert moved == [False] + [True] * (len(moved) - 1)
                else:
                    assert all(moved), "every gate moves at the first step"
        runs[name] = losses
    assert runs["converted"][0] == runs["base"][0]  # bitwise: the first step sees the same model
    worst = max(c / b - 1 for c, b in zip(runs["converted"], runs["base"]))
    print(f"{layout}: worst loss excess over the base model {worst:+.5f}, final losses "
          f"{runs['base'][-1]:.4f} (base) {runs['converted'][-1]:.4f} (converted)")
    assert worst <= 0.005, (worst, runs)
    assert runs["converted"][-1] < runs["converted"][0]


def test_only_a_standard_decoder_converts():
    with pytest.raises(ConversionError, match="only a standard decoder"):
        delta_args(ModelArgs(residual="attn_res"))
    with pytest.raises(ConversionError, match="not divisible by routing heads"):
        delta_args(ModelArgs(dim=36, n_heads=2, n_kv_heads=2, qk_norm=False))
