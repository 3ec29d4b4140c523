"""Per-block torch.compile with fullgraph=True traces the fused routing kernels without a graph
break (issue: CUDA graphs, compile and the fused kernels compose): inside a compiled block every
fused call is a registered custom op (`mhar::depth_route`, `mhar::phase1`) with a fake
implementation and autograd, so one training step of MHAR per call and grouped (and the delta /
block families) equals the eager fused path's within 1e-5 in fp32 on CPU (Triton interpreter).
Every depth-routing family is compiled, and tracing warns of nothing (a user compiling the blocks
sees no warning from our code)."""
import warnings
from pathlib import Path

import pytest
import torch

import mhar_kernels
from mhar_kernels import triton_grouped, triton_routing
from mhar_titan.models import ModelArgs, Transformer
from mhar_titan.models.args import FAMILIES
from mhar_titan.parallel import _raise_recompile_limits

SHAPE = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=128, max_seq_len=16, eos_id=0)


def build(family: str, kernel: str = "triton", **overrides) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(ModelArgs(**SHAPE, **FAMILIES[family], routing_kernel=kernel, **overrides))
    model.init_weights()
    return model


def step(model) -> tuple[float, dict]:
    """One forward and backward of a seeded (2, 12) batch: (loss, {parameter name: gradient})."""
    x = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    loss = model(x, torch.roll(x, -1, 1))
    loss.backward()
    return loss.item(), {n.replace("_orig_mod.", ""): p.grad for n, p in model.named_parameters()}


def compile_blocks(model: Transformer) -> Transformer:
    """Every block compiled with fullgraph=True, as `parallel.apply_compile` does."""
    _raise_recompile_limits(64)
    for i, block in enumerate(model.layers):
        model.layers[i] = torch.compile(block, fullgraph=True, backend="aot_eager")
    model.compiled_blocks = True
    return model


def warned_step(model) -> tuple[float, dict, list[str]]:
    """`step`, and the warnings raised while it ran that name a file of ours (e.g. dynamo's about
    tracing through a functools cache)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss, grads = step(model)
    ours = [str(w.message) for w in caught if any(f"'{name}:" in str(w.message) or w.filename.endswith(f"/{name}")
                                                   for name in KERNEL_FILES)]
    return loss, grads, ours


ROUTED = [family for family, fields in FAMILIES.items() if fields["residual"] == "attn_res"]
"""The families that route on the fused kernels (depth routing's); the other connections' per-block
compile is tests/test_multistream_connections.py's."""
KERNEL_FILES = [path.name for path in Path(mhar_kernels.__file__).parent.glob("*.py")]
PAPER = dict(routing_layout="paper", routing_mode="delta", routing_null_source=True)

pytestmark = pytest.mark.slow  # torch.compile (dynamo, aot_eager) of every routed family's blocks over the Triton interpreter


@pytest.mark.parametrize("family, group, extra", [*((family, 1, {}) for family in ROUTED), ("mhar H=8", 3, {}),
                                                   ("delta block H=8 +null", 3, {}), ("mhar H=8", 1, PAPER)])
def test_per_block_fullgraph_compile_of_the_fused_kernels_equals_eager(family, group, extra, monkeypatch):
    eager = build(family, routing_group_size=group, **extra)
    compiled = compile_blocks(build(family, routing_group_size=group, **extra))
    launches = []
    for module, name in ((triton_routing, "_route_fwd_kernel"), (triton_grouped, "_phase1_fwd_kernel")):
        real = getattr(module, name)
        spy = type("Spy", (), {"__getitem__": lambda self, grid, real=real, name=name:
                               launches.append(name) or real[grid]})()
        monkeypatch.setattr(module, name, spy)
    loss, grads = step(eager)
    eager_launches = len(launches)
    compiled_loss, compiled_grads, warned = warned_step(compiled)
    assert not warned
    assert len(launches) > eager_launches  # the compiled blocks ran the fused kernels, not an eager fallback
    if group > 1:
        assert "_phase1_fwd_kernel" in launches[eager_launches:]
    assert compiled_loss == pytest.approx(loss, rel=1e-5, abs=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(compiled_grads[name], grad, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("kernel, group", [("eager", 1), ("eager", 3), ("compile", 1)])
def test_per_block_compile_of_the_eager_routing_warns_of_nothing(kernel, group):
    """With routing_kernel = "eager" or "compile" the compiled blocks trace the eager routing (the
    grouped reference's phase 1 included) without a warning from our code, and equal the model
    run without per-block compile within 1e-5."""
    loss, grads = step(build("mhar H=8", kernel, routing_group_size=group))
    compiled_loss, compiled_grads, warned = warned_step(compile_blocks(build("mhar H=8", kernel,
                                                                             routing_group_size=group)))
    assert not warned
    assert compiled_loss == pytest.approx(loss, rel=1e-5, abs=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(compiled_grads[name], grad, rtol=1e-5, atol=1e-5, msg=name)
