"""Every residual family of the debug flavor can fit one fixed batch (acceptance: 40 AdamW steps, loss < 50%)."""
import pytest
import torch
import torch.nn.functional as F

from mhar_titan.models import FAMILIES, ModelArgs, Transformer

KV = FAMILIES["mhar H=kv"]
CASES = {
    "standard": FAMILIES["baseline"],
    "attn_res H=1": FAMILIES["attn_res H=1"],
    "attn_res H=kv": KV,
    "block": dict(KV, routing_granularity="block", routing_block_layers=2),
    "delta": dict(KV, routing_mode="delta", routing_granularity="block", routing_block_layers=2,
                  routing_null_source=True),
    "delta sublayer": dict(KV, routing_mode="delta"),
}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("family", CASES)
def test_debug_flavor_overfits_one_batch(family):
    torch.manual_seed(0)
    # The debug layer stack at a 1,024-token vocabulary: the 50,304-row LM head would make
    # this test 5x slower on 2 cores without exercising anything the residual path does.
    args = ModelArgs.from_flavor("debug", vocab_size=1024, **CASES[family])
    model = Transformer(args)
    model.init_weights()
    batch = torch.randint(0, args.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    inputs, labels = batch[:, :-1], batch[:, 1:]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    losses = []
    for _ in range(40):
        loss = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    final = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten()).item()
    assert final < 0.5 * losses[0], (family, losses[0], final)
    if model.routing is not None:  # the routing parameters are trained, not dead
        assert model.routing.query.abs().sum() > 0
        if model.routing.alpha is not None:
            assert model.routing.alpha.abs().sum() > 0
