"""Depth routing under ``torch.autocast`` (the nanoGPT way of training in bf16 or fp16): a sublayer's output
is then in the autocast dtype while the embedding and the residual stream stay fp32, and every routing call
needs its sources in one dtype. Every routing_kernel routes over the entries in the embedding's
dtype (the fused kernels' depth buffer is made in it; the list path casts each new entry to it,
`router.BlockSources.add`), so every routed family, per call and grouped, trains under autocast
with each kernel, and the kernels agree: the losses of the fused kernels (Triton interpreter) and
of the eager reference are within 1e-4 of each other (1e-5 under fp16) and the routing gradients
within 1e-3 in relative norm (both route in fp32 over the same fp32 entries, the eager grouped phase 1's einsums
included, which autocast would run in bf16: 2.6e-2 apart then; the sublayers after a routing call
round its input to bf16, where a difference in the last fp32 bits can move a bf16 rounding:
7e-5 apart, measured)."""
import pytest
import torch

import mhar_kernels
from mhar_titan.models import ModelArgs, Transformer
from mhar_titan.models.args import FAMILIES

SHAPE = dict(dim=64, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=128, vocab_size=256, max_seq_len=16)
ROUTED = [family for family, fields in FAMILIES.items() if fields["residual"] != "standard"]
GROUPED = [(family, group) for group in (1, 2) for family in ROUTED
           if group == 1 or FAMILIES[family]["residual"] == "attn_res"]
"""(family, routing group size): groups of 2 sites for depth routing only (the other connections have
no routing sites)."""
FUSED = mhar_kernels.can_run(torch.device("cpu"), 64, 8)


def autocast_step(family: str, kernel: str, dtype: torch.dtype = torch.bfloat16, **overrides) -> tuple[float, dict]:
    """One forward and backward under `dtype` autocast of a seeded (2, 16) batch: (loss, {routing
    parameter name: gradient})."""
    torch.manual_seed(0)
    model = Transformer(ModelArgs(**SHAPE, **FAMILIES[family], routing_kernel=kernel, **overrides))
    model.init_weights()
    with torch.no_grad():  # routing parameters off their zero init, so the depth softmax is not uniform
        for parameter in model.routing.parameters():
            parameter.add_(0.3 * torch.randn(parameter.shape, generator=torch.Generator().manual_seed(2)))
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=dtype):
        loss = model(x, torch.roll(x, -1, 1))
    loss.backward()
    return loss.item(), {name: p.grad for name, p in model.routing.named_parameters()}


LOSS_TOL = {torch.bfloat16: 1e-4, torch.float16: 1e-5}  # fp16 keeps 3 more mantissa bits


@pytest.mark.parametrize("dtype", list(LOSS_TOL), ids=["bf16", "fp16"])
@pytest.mark.parametrize("family, group", GROUPED)
def test_every_routed_family_trains_under_autocast_and_the_kernels_agree(family, group, dtype):
    loss, grads = autocast_step(family, "eager", dtype, routing_group_size=group)
    assert torch.isfinite(torch.tensor(loss))
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    if not FUSED:
        pytest.skip("the fused kernels do not run on this CPU (TRITON_INTERPRET=1 not set before import)")
    fused_loss, fused_grads = autocast_step(family, "triton", dtype, routing_group_size=group)
    assert fused_loss == pytest.approx(loss, rel=LOSS_TOL[dtype])
    for name, grad in grads.items():
        assert ((fused_grads[name] - grad).norm() / grad.norm()).item() <= 1e-3, name


@pytest.mark.slow  # torch.compile: 48 s with a cold compile cache, as on a fresh CI runner (2 cores, 2026-12-07)
def test_the_compiled_routing_body_runs_under_autocast():
    """routing_kernel = "compile" (the torch.compile'd reference) takes the same fp32 entries."""
    loss, _ = autocast_step("mhar H=8", "compile")
    eager_loss, _ = autocast_step("mhar H=8", "eager")
    assert loss == pytest.approx(eager_loss, rel=1e-4)


@pytest.mark.parametrize("family", ["mhar H=8", "delta block H=8 +null"])
def test_a_half_precision_model_under_autocast_of_the_other_half_dtype(family):
    """A bf16 model under fp16 autocast: the stream (bf16 + fp16 -> fp32) is taken to the sources'
    dtype for delta routing on every kernel (the eager path refused the fp32 partial); the losses of
    the kernels agree within 1e-3 (bf16 storage)."""
    losses = {}
    for kernel in ("eager", "triton") if FUSED else ("eager",):
        torch.manual_seed(0)
        model = Transformer(ModelArgs(**SHAPE, **FAMILIES[family], routing_kernel=kernel)).to(torch.bfloat16)
        model.init_weights()
        x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x, torch.roll(x, -1, 1))
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        losses[kernel] = loss.item()
    assert max(losses.values()) - min(losses.values()) <= 1e-3 * abs(losses["eager"]), losses
