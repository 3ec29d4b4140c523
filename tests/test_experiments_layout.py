"""The permuted head layout ablation: definition, H = 1 equivalence, same permutation everywhere."""
import json
import subprocess
import sys

import pytest
import torch

from helpers import metric_losses
from mhar_titan.models import ModelArgs, Transformer
from mhar_kernels.dispatch import route
from mhar_kernels.reference import head_permutation, route_reference
from train_common import debug_argv

TINY = dict(dim=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=64, vocab_size=256, max_seq_len=16)


def test_permuted_heads_route_over_the_permuted_coordinate_sets():
    """Oracle written per head with explicit coordinate sets: logit = <q[S_h], khat[S_h]>,
    out[S_h] = sum_n softmax_n(logit) s_n[S_h], S_h = perm[h K : (h + 1) K]."""
    g = torch.Generator().manual_seed(0)
    d, H, N = 12, 3, 4
    sources = [torch.randn(2, 5, d, generator=g, dtype=torch.float64) for _ in range(N)]
    q, w = torch.randn(d, generator=g, dtype=torch.float64), torch.rand(d, generator=g, dtype=torch.float64) + 0.5
    perm = head_permutation(d, 7)
    out = route_reference(sources, q, w, H, eps=1e-6, permutation=perm)
    expected = torch.zeros_like(sources[0])
    for h in range(H):
        idx = perm[h * d // H:(h + 1) * d // H]
        keys = [s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * w for s in sources]
        logits = torch.stack([(k[..., idx] * q[idx]).sum(-1) for k in keys])
        a = torch.softmax(logits, 0)
        expected[..., idx] = sum(a[n, ..., None] * sources[n][..., idx] for n in range(N))
    torch.testing.assert_close(out, expected)
    assert not torch.allclose(out, route_reference(sources, q, w, H))  # contiguous heads differ
    with pytest.raises(ValueError, match="eager path only"):
        route(sources, q, w, H, kernel="compile", permutation=perm)


def test_permuted_layout_needs_the_eager_kernel_and_keeps_state_dict_keys():
    with pytest.raises(ValueError, match="eager path only.*routing_kernel='eager'"):
        ModelArgs(**TINY, residual="attn_res", routing_heads=2, routing_head_layout="permuted", routing_kernel="auto")
    contiguous = Transformer(ModelArgs(**TINY, residual="attn_res", routing_heads=2))
    permuted = Transformer(ModelArgs(**TINY, residual="attn_res", routing_heads=2, routing_head_layout="permuted"))
    assert list(contiguous.state_dict()) == list(permuted.state_dict())


def train_losses(steps=20, **fields):
    torch.manual_seed(0)
    model = Transformer(ModelArgs(**TINY, residual="attn_res", **fields))
    model.init_weights()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(1))  # memorised
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_one_head_permuted_trains_like_contiguous_within_rounding():
    contiguous = train_losses(routing_heads=1)
    permuted = train_losses(routing_heads=1, routing_head_layout="permuted", routing_head_layout_seed=3)
    torch.testing.assert_close(permuted, contiguous, rtol=1e-5, atol=0)
    assert contiguous[-1] < contiguous[0] - 0.5  # it did train
    # With several heads the layout matters once the pseudo-queries leave zero.
    multi = train_losses(routing_heads=4, routing_head_layout="permuted", routing_head_layout_seed=3)
    assert abs(multi[-1] - train_losses(routing_heads=4)[-1]) > 1e-4


def test_the_permutation_depends_only_on_the_seed():
    """Another process (another rank) with another global RNG state draws the same permutation."""
    perm = head_permutation(64, 5)
    assert sorted(perm.tolist()) == list(range(64)) and perm.tolist() != list(range(64))
    assert head_permutation(64, 6).tolist() != perm.tolist()
    code = ("import torch, json; torch.manual_seed(123); torch.rand(99);"
            "from mhar_kernels.reference import head_permutation; print(json.dumps(head_permutation(64, 5).tolist()))")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(other.stdout) == perm.tolist()


def test_a_resumed_permuted_run_continues_with_the_same_permutation(tmp_path):
    """4 steps straight vs 2 steps + resume to 4 (the permutation is not saved: it is rebuilt from
    the seed); resuming with another layout seed is refused by the checkpoint fingerprint."""
    from mhar_titan.train import main as train_main

    layout = ["--model.routing_heads=4", "--model.routing_head_layout=permuted", "--model.routing_head_layout_seed=9",
              "--model.dim=32", "--model.n_heads=2", "--model.n_kv_heads=1", "--model.ffn_dim=64",
              "--training.local_batch_size=2", "--checkpoint.enable=true", "--checkpoint.interval=2"]

    def losses(name):
        return metric_losses(tmp_path / name)

    assert train_main(debug_argv(tmp_path, "straight", "--training.steps=4", *layout)) == 0
    assert train_main(debug_argv(tmp_path, "resumed", "--training.steps=2", *layout)) == 0
    assert train_main(debug_argv(tmp_path, "resumed", "--training.steps=4", *layout)) == 0
    assert losses("resumed") == losses("straight") and len(losses("straight")) == 4
    assert train_main(debug_argv(tmp_path, "resumed", "--training.steps=6", *layout[:-2],
                                 "--model.routing_head_layout_seed=10", *layout[-2:])) == 2
