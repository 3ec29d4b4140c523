"""Per-block torch.compile with fullgraph=True traces the fused routing kernels without a graph
break (issue: CUDA graphs, compile and the fused kernels compose): inside a compiled block every
fused call is a registered custom op (`mhar::depth_route`, `mhar::phase1`) with a fake
implementation and autograd, so one training step of MHAR per call and grouped (and the delta /
block families) equals the eager fused path's within 1e-5 in fp32 on CPU (Triton interpreter)."""
import pytest
import torch

from mhar_kernels import triton_grouped, triton_routing
from mhar_titan.models import ModelArgs, Transformer
from mhar_titan.models.args import FAMILIES
from mhar_titan.parallel import _raise_recompile_limits

SHAPE = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=128, max_seq_len=16, eos_id=0)


def build(family: str, **overrides) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(ModelArgs(**SHAPE, **FAMILIES[family], routing_kernel="triton", **overrides))
    model.init_weights()
    return model


def step(model) -> tuple[float, dict]:
    """One forward and backward of a seeded (2, 12) batch: (loss, {parameter name: gradient})."""
    x = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    loss = model(x, torch.roll(x, -1, 1))
    loss.backward()
    return loss.item(), {n.replace("_orig_mod.", ""): p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("family, group", [("mhar H=8", 1), ("mhar H=8", 3), ("delta block H=8 +null", 3)])
def test_per_block_fullgraph_compile_of_the_fused_kernels_equals_eager(family, group, monkeypatch):
    eager = build(family, routing_group_size=group)
    compiled = build(family, routing_group_size=group)
    _raise_recompile_limits(64)
    for i, block in enumerate(compiled.layers):
        compiled.layers[i] = torch.compile(block, fullgraph=True, backend="aot_eager")
    compiled.compiled_blocks = True  # as parallel.apply_compile sets it
    launches = []
    for module, name in ((triton_routing, "_route_fwd_kernel"), (triton_grouped, "_phase1_fwd_kernel")):
        real = getattr(module, name)
        spy = type("Spy", (), {"__getitem__": lambda self, grid, real=real, name=name:
                               launches.append(name) or real[grid]})()
        monkeypatch.setattr(module, name, spy)
    loss, grads = step(eager)
    eager_launches = len(launches)
    compiled_loss, compiled_grads = step(compiled)
    assert len(launches) > eager_launches  # the compiled blocks ran the fused kernels, not an eager fallback
    if group > 1:
        assert "_phase1_fwd_kernel" in launches[eager_launches:]
    assert compiled_loss == pytest.approx(loss, rel=1e-5, abs=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(compiled_grads[name], grad, rtol=1e-5, atol=1e-5, msg=name)
