"""``training.cuda_graphs`` on CUDA (the GPU suite's tests row; skipped without CUDA). Imports only
torch and the model (no data stack), so that the suite's plain checkout collects it; the CPU checks
of the same path are in tests/test_cuda_graphs.py."""
import pytest
import torch

from mhar_titan.components.cuda_graphs import GraphedMicroStep, no_recompile
from mhar_titan.models import ModelArgs, Transformer
from mhar_titan.models.attention_mask import attend, document_ids, flex_block_mask

EOS = 0


@pytest.mark.gpu
def test_a_captured_document_mask_replays_on_another_batch_on_cuda():
    """CUDA (the GPU suite's tests row): the block mask built inside a captured graph from a static
    token buffer, FlexAttention (compiled) forward and backward over it, replayed after another
    batch is copied into the buffer, equals the same computation run eagerly on that batch."""
    g = torch.Generator(device="cuda").manual_seed(0)
    B, H, Hkv, T, hd = 2, 8, 2, 512, 64

    def batch():
        tokens = torch.randint(1, 10, (B, T), generator=g, device="cuda")
        tokens[torch.rand(B, T, generator=g, device="cuda") < 0.02] = EOS
        return tokens

    inputs = [torch.randn(B, n, T, hd, generator=g, device="cuda", requires_grad=True) for n in (H, Hkv, Hkv)]

    def step(tokens):
        for t in inputs:
            t.grad = None
        out = attend(*inputs, flex_block_mask(document_ids(tokens, EOS)))
        out.square().sum().backward()
        return out.detach(), [t.grad for t in inputs]

    a, b = batch(), batch()
    static = a.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compiles FlexAttention, as the trainer's warm-up micro-batch does
        step(static)
    torch.cuda.current_stream().wait_stream(side)
    for t in inputs:
        t.grad = torch.zeros_like(t)  # the captured backward accumulates into kept storage
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), no_recompile():
        for t in inputs:
            t.grad.zero_()
        out = attend(*inputs, flex_block_mask(document_ids(static, EOS)))
        out.square().sum().backward()
    static.copy_(b)
    graph.replay()
    replayed = [out.clone(), *(t.grad.clone() for t in inputs)]
    fresh_out, fresh_grads = step(b)
    for got, want in zip(replayed, [fresh_out, *fresh_grads]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(fresh_out, step(a)[0])  # the two batches' documents differ


@pytest.mark.gpu
@pytest.mark.parametrize("group", [1, 2], ids=["per call", "grouped"])
def test_graphed_micro_steps_equal_eager_on_cuda(group):
    """CUDA (the GPU suite's tests row): `GraphedMicroStep` (warm-up, capture, replays) over four
    micro-batches of a small MHAR model with the fused routing kernels, AC-free, document masking
    and RoPE per document gives the eager step's losses bitwise and its gradients."""
    args = ModelArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=256, max_seq_len=256,
                     eos_id=EOS, attn_mask_type="block_causal", rope_per_document=True, routing_kernel="triton",
                     routing_group_size=group, residual="attn_res", routing_heads=8)
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        model = Transformer(args).cuda()
        model.init_weights()
        with torch.no_grad():
            model.routing.query.normal_()  # routing far from uniform
        model.check_token_ids = False
        models.append(model)
    eager, graphed = models
    step = GraphedMicroStep(graphed, None)
    g = torch.Generator(device="cuda").manual_seed(0)
    n_global = torch.tensor(1000.0, device="cuda")  # not a power of two: the trainer's arithmetic must match
    for k in range(4):
        tokens = torch.randint(1, 256, (2, 129), generator=g, device="cuda")
        tokens[torch.rand(2, 129, generator=g, device="cuda") < 0.03] = EOS
        x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        want = eager(x, y)
        (want / n_global * 1).backward()  # the eager trainer's arithmetic (train.py), world size 1
        got = step.step(x, y, n_global)
        torch.cuda.synchronize()
        assert torch.equal(got, want.detach()), (k, got, want)
        for (name, p), q in zip(eager.named_parameters(), graphed.parameters()):
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=lambda m: f"step {k} {name}: {m}")
            p.grad.zero_()
            q.grad.zero_()  # kept storage: the captured backward accumulates into it
    assert step.graph is not None and step.calls == 4
