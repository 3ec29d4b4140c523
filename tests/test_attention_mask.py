"""Document masking (model.attn_mask_type = "block_causal", models/attention_mask.py).

Convention under test: an EOS closes the document it ends, so the label at an EOS position (the
next document's first token) is scored with the document that EOS ends.
"""
import warnings

import pytest
import torch

from mhar_titan.models import ModelArgs, Transformer
from mhar_titan.models.args import FAMILIES
from mhar_titan.models.attention_mask import attend, dense_mask, document_ids, document_positions, flex_block_mask
from mhar_titan.models.cross_entropy import IGNORE_INDEX, token_loss_sum

EOS = 0
BASE = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=128, max_seq_len=64, eos_id=EOS)


def model_of(family: str, dtype=torch.float64, **overrides) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(ModelArgs(**BASE, **FAMILIES[family], **overrides))
    model.init_weights()
    if model.routing is not None:
        with torch.no_grad():
            model.routing.query.normal_()  # routing far from uniform
    model = model.to(dtype)
    if dtype == torch.float64:  # fp64 RoPE tables, so that RoPE's relative form holds to fp64 rounding
        inv_freq = 1.0 / model.args.rope_theta ** (torch.arange(0, 8, 2, dtype=dtype) / 8)
        angles = torch.outer(torch.arange(model.args.max_seq_len, dtype=dtype), inv_freq).repeat(1, 2)
        model.rope_cos, model.rope_sin = angles.cos(), angles.sin()
    return model


def packed_window(layout: list[int], seed: int) -> torch.Tensor:
    """One window of len(sum(layout)) + 1 tokens: documents of the given lengths (each but the
    last ends with an EOS, counted in its length), ids in [1, 128)."""
    g = torch.Generator().manual_seed(seed)
    window = torch.randint(1, 128, (sum(layout) + 1,), generator=g)
    ends = torch.tensor(layout).cumsum(0)[:-1] - 1
    window[ends] = EOS
    return window


def test_document_ids_and_positions():
    tokens = torch.tensor([[5, 0, 0, 7, 8, 0, 9], [1, 2, 3, 4, 5, 6, 7]])
    assert document_ids(tokens, EOS).tolist() == [[0, 0, 1, 2, 2, 2, 3], [0] * 7]
    assert document_positions(document_ids(tokens, EOS)).tolist() == [[0, 1, 0, 0, 1, 2, 0], list(range(7))]


@pytest.mark.parametrize("family", ["baseline", "mhar H=8"])
@pytest.mark.parametrize("restart", [False, True])
def test_packed_loss_is_the_token_weighted_mean_of_its_documents(family, restart):
    """fp64: the loss of two packed windows (documents of lengths 1, a whole window, several) equals
    the documents run one by one (positions from 0), token-weighted, within 1e-10. Without restart
    the packed positions are offset, which RoPE's relative form makes exact too."""
    model = model_of(family, attn_mask_type="block_causal", rope_per_document=restart)
    layouts = [[3, 1, 1, 9, 6, 4], [24]]
    windows = [packed_window(layout, seed) for seed, layout in enumerate(layouts)]
    x, y = torch.stack([w[:-1] for w in windows]), torch.stack([w[1:] for w in windows])
    y[0, 5] = IGNORE_INDEX  # an ignored label counts in neither
    with torch.no_grad():
        packed = model(x, y) / (y != IGNORE_INDEX).sum()
        total, count = 0.0, 0
        for row, layout in enumerate(layouts):
            start = 0
            for length in layout:
                xs, ys = x[row:row + 1, start:start + length], y[row:row + 1, start:start + length]
                total += token_loss_sum(model(xs), ys).item()
                count += int((ys != IGNORE_INDEX).sum())
                start += length
    assert abs(packed.item() - total / count) < 1e-10
    # and it is not the causal loss: attention really stopped at the boundaries
    with torch.no_grad():
        causal = model_of(family, attn_mask_type="causal")(x, y) / (y != IGNORE_INDEX).sum()
    assert abs(causal.item() - packed.item()) > 1e-4


def test_positions_restart_in_the_attention_context():
    model = model_of("baseline", attn_mask_type="block_causal", rope_per_document=True)
    tokens = torch.tensor([[5, 0, 7, 8, 0, 9]])
    context = model.attention_context(tokens)
    positions = torch.tensor([0, 1, 0, 1, 2, 0])
    assert torch.equal(context.cos, model.rope_cos[positions].view(1, 1, 6, -1))
    assert torch.equal(context.mask, dense_mask(document_ids(tokens, EOS)))


@pytest.mark.parametrize("family", ["baseline", "mhar H=8"])
def test_causal_is_todays_forward(family):
    """Under "causal" the attention context has no mask and the loss through the model's forward
    is bitwise the trainer's former `token_loss_sum(model(x), y)`; a block-causal model on a window
    without EOS (one document) gives the same logits up to the kernel's rounding."""
    model = model_of(family, dtype=torch.float32, attn_mask_type="causal")
    x = torch.randint(1, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    y = torch.roll(x, -1, 1)
    assert model.attention_context(x).mask is None
    with torch.no_grad():
        assert torch.equal(model(x, y), token_loss_sum(model(x), y))
        masked = model_of(family, dtype=torch.float32, attn_mask_type="block_causal")
        torch.testing.assert_close(masked(x), model(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("seed", range(4))
def test_flex_attention_forward_equals_the_cpu_path(seed):
    """Random layouts, including a document spanning the whole window (row 0 of seed 0) and
    documents of length 1 (consecutive EOS): FlexAttention's forward with the block mask equals
    SDPA with the dense mask within 1e-6 (GQA, T not a multiple of the 128-token block)."""
    g = torch.Generator().manual_seed(seed)
    B, H, Hkv, T, hd = 3, 4, 2, 150, 8
    tokens = torch.randint(1, 10, (B, T), generator=g)
    eos = torch.rand(B, T, generator=g) < torch.tensor([[0.0], [0.05], [0.4]])
    tokens[eos] = EOS
    tokens[2, 10:13] = EOS  # documents of one token
    q, k, v = (torch.randn(B, n, T, hd, generator=g) for n in (H, Hkv, Hkv))
    ids = document_ids(tokens, EOS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flex = attend(q, k, v, flex_block_mask(ids), compiled_flex=False)
    torch.testing.assert_close(flex, attend(q, k, v, dense_mask(ids)), rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
def test_flex_attention_forward_and_backward_on_cuda():
    """CUDA (the GPU suite): the compiled FlexAttention path's output and q/k/v gradients equal SDPA
    with the dense mask, fp32, within 2e-3 relative (TF32-free tolerances of the fused kernels)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    B, H, Hkv, T, hd = 2, 8, 2, 512, 64
    tokens = torch.randint(1, 10, (B, T), generator=g, device="cuda")
    tokens[torch.rand(B, T, generator=g, device="cuda") < 0.02] = EOS
    ids = document_ids(tokens, EOS)
    inputs = [torch.randn(B, n, T, hd, generator=g, device="cuda", requires_grad=True) for n in (H, Hkv, Hkv)]
    out = [attend(*inputs, mask) for mask in (flex_block_mask(ids), dense_mask(ids))]
    grads = [torch.autograd.grad(o.square().sum(), inputs) for o in out]
    torch.testing.assert_close(out[0], out[1], rtol=2e-3, atol=2e-3)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=2e-3, atol=2e-3)


def test_rope_per_document_needs_block_causal():
    with pytest.raises(ValueError, match="rope_per_document=True .* needs attn_mask_type='block_causal'"):
        ModelArgs(**BASE, rope_per_document=True)
    with pytest.raises(ValueError, match="unknown attn_mask_type 'document'"):
        ModelArgs(**BASE, attn_mask_type="document")


def test_generation_respects_the_document_mask():
    """Generation re-runs the model's forward: under block_causal with positions restarting, the
    next-token logits after "earlier document, EOS, prompt" are those of the prompt alone, and
    under causal they are not."""
    from mhar_titan.eval.generation import next_token_logits

    prompt = torch.tensor([[7, 8, 9]])
    packed = torch.cat([torch.tensor([[3, 4, 5, EOS]]), prompt], dim=1)
    masked = model_of("mhar H=8", attn_mask_type="block_causal", rope_per_document=True)
    with torch.no_grad():
        torch.testing.assert_close(next_token_logits(masked, packed), next_token_logits(masked, prompt),
                                   rtol=1e-10, atol=1e-10)
        causal = model_of("mhar H=8")
        assert not torch.allclose(next_token_logits(causal, packed), next_token_logits(causal, prompt), atol=1e-4)
