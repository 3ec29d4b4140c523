"""The chunked cross-entropy of the LM head (models/cross_entropy.py) against the plain path."""
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from mhar_titan.components.loss import build_loss_fn
from mhar_titan.config import Compile
from mhar_titan.models import ModelArgs, Transformer
from mhar_titan.models.cross_entropy import (
    IGNORE_INDEX, ChunkedLinearCrossEntropy, chunked_linear_cross_entropy, loss_path_bytes,
    plain_linear_cross_entropy,
)


def head_case(dtype, B=2, T=37, d=16, V=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, T, d, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(V, d, generator=g) * 0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[0, :5] = IGNORE_INDEX
    labels[1, -1] = IGNORE_INDEX
    return h, weight, labels


@pytest.mark.parametrize("z_loss", [0.0, 1e-2])
@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 1e-6), (torch.bfloat16, 1.6e-2)])
def test_chunked_equals_plain_loss_and_gradients(dtype, rtol, z_loss):
    """Loss and gradients of h and W, chunks of 8 tokens (not dividing the 74 tokens), ignored
    labels: within 1e-6 relative in fp32, bf16's tolerance (2^-6 relative to the largest entry) in bf16."""
    h, weight, labels = head_case(dtype)
    plain = plain_linear_cross_entropy(h, weight, labels, z_loss)
    chunked = chunked_linear_cross_entropy(h, weight, labels, z_loss, chunk=8)
    assert chunked.dtype == torch.float32
    assert abs(chunked.item() - plain.item()) <= 1e-6 * abs(plain.item())
    for a, b in zip(torch.autograd.grad(plain, (h, weight)), torch.autograd.grad(chunked, (h, weight))):
        assert a.dtype == b.dtype == dtype
        assert (a.float() - b.float()).abs().max() <= rtol * a.float().abs().max()


def test_all_labels_ignored_gives_zero_and_zero_gradients():
    h, weight, labels = head_case(torch.float32)
    loss = chunked_linear_cross_entropy(h, weight, torch.full_like(labels, IGNORE_INDEX), 1e-2, chunk=16)
    loss.backward()
    assert loss.item() == 0.0 and not h.grad.any() and not weight.grad.any()


def test_backward_state_goes_through_save_for_backward_only():
    """The node keeps h, W, labels and the (N,) fp32 lse as saved tensors and no tensor attribute."""
    h, weight, labels = head_case(torch.float32)
    loss = ChunkedLinearCrossEntropy.apply(h.flatten(0, 1), weight, labels.flatten(), 1e-2, 8)
    node = loss.grad_fn
    assert [k for k, v in vars(node).items() if isinstance(v, torch.Tensor)] == []
    saved = node.saved_tensors
    assert [tuple(t.shape) for t in saved] == [(74, 16), (300, 16), (74,), (74,)]
    assert saved[3].dtype == torch.float32


# The 100m loss path scaled by 1/8 in tokens, width and vocabulary: 16,384 -> 2,048 tokens,
# d 512 -> 64, vocab 100,352 -> 12,544, and the chunk 1,024 -> 128 tokens.
N, D, V, CHUNK = 2048, 64, 12_544, 128


def saved_bytes(fn, h, weight) -> int:
    """Bytes of the distinct storages autograd saves for backward while `fn()` runs (saved-tensor hooks)."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = fn()
    loss.backward()
    h.grad = weight.grad = None
    return sum(storages.values())


def peak_allocation(fn, h, weight) -> int:
    """Peak of the CPU allocations (net bytes, in allocation order) recorded by the profiler during
    the forward and backward of `fn()`."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn().backward()
    h.grad = weight.grad = None
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    current = peak = 0
    for e in events:
        current += e.nbytes()
        peak = max(peak, current)
    return peak


@pytest.mark.parametrize("z_loss", [0.0, 1e-4])
def test_loss_path_memory_at_a_scaled_100m_shape(z_loss):
    """Saved-for-backward bytes and the profiler's peak allocation of the chunked loss are >= 8x
    smaller than the plain path's, and so is the dry run's model of the loss path."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(1, N, D, generator=g).requires_grad_()
    weight = (torch.randn(V, D, generator=g) * 0.1).requires_grad_()
    labels = torch.randint(0, V, (1, N), generator=g)

    def plain():
        return plain_linear_cross_entropy(h, weight, labels, z_loss)

    def chunked():
        return chunked_linear_cross_entropy(h, weight, labels, z_loss, chunk=CHUNK)

    saved = saved_bytes(plain, h, weight), saved_bytes(chunked, h, weight)
    assert saved[1] == 4 * (N * D + V * D) + 8 * N + 4 * N  # h, W, int64 labels, fp32 lse
    assert saved[0] >= 8 * saved[1], saved
    peak = peak_allocation(plain, h, weight), peak_allocation(chunked, h, weight)
    assert peak[0] >= 8 * peak[1], peak
    modelled = loss_path_bytes(N, V, D, 4, "plain"), loss_path_bytes(N, V, D, 4, "chunked", CHUNK)
    assert modelled[0] >= 8 * modelled[1]
    assert 0.5 <= peak[0] / modelled[0] <= 2 and 0.5 <= peak[1] / modelled[1] <= 2, (peak, modelled)


@pytest.mark.parametrize("family", [dict(residual="standard"), dict(residual="attn_res", routing_heads=4)])
def test_model_forward_with_labels_chunked_equals_plain(family):
    """`model(x, labels, loss_fn=...)` (the trainer's call): the chunked and plain training losses
    (z-loss 1e-4) and every parameter's gradient agree within 1e-6 relative; untied head too."""
    torch.manual_seed(0)
    args = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=256, max_seq_len=32,
                     tie_embeddings=False, **family)
    model = Transformer(args)
    model.init_weights()
    x = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    y = torch.roll(x, -1, 1)
    y[:, -1] = IGNORE_INDEX
    results = []
    for path in ("plain", "chunked"):
        loss = model(x, y, loss_fn=build_loss_fn(Compile(), 1e-4, path, chunk_tokens=7))
        results.append((loss.item(), torch.autograd.grad(loss, list(model.parameters()))))
    (plain, plain_grads), (chunked, chunked_grads) = results
    assert abs(plain - chunked) <= 1e-6 * plain
    for a, b in zip(plain_grads, chunked_grads):
        assert (a - b).abs().max() <= 1e-6 * a.abs().max() + 1e-12
