"""Whole-model compile ([compile] components = ["whole_model"], parallel.compile_whole_model):
the forward from the embedding to the chunked loss as one graph, equal to eager over 5 steps."""
import os
import subprocess
import sys

import pytest
import torch

from helpers import PATIENCE_S, ROOT
from mhar_titan.components.loss import build_loss_fn
from mhar_titan.config import Compile
from mhar_titan.models import ModelArgs, Transformer
from mhar_titan.models.args import FAMILIES
from mhar_titan.parallel import compile_whole_model

SHAPE = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=128, max_seq_len=16, eos_id=0)


def build(family: str, **overrides) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(ModelArgs(**SHAPE, **FAMILIES[family], **overrides))
    model.init_weights()
    return model


def train(model, steps: int = 5, rows=slice(None)) -> list[float]:
    """AdamW steps on seeded (4, 12) batches (rows `rows` of each), z-loss 1e-4, the chunked loss;
    returns the summed losses."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss_fn = build_loss_fn(Compile(), 1e-4, "chunked", chunk_tokens=64)
    g, out = torch.Generator().manual_seed(1), []
    for _ in range(steps):
        x = torch.randint(0, 128, (4, 12), generator=g)
        x[:, 5] = 0  # an EOS: two documents per row
        loss = model(x[rows], torch.roll(x, -1, 1)[rows], loss_fn=loss_fn)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def check_equal(family: str, backend: str, **overrides) -> None:
    eager_model, compiled_model = build(family, **overrides), build(family, **overrides)
    compile_whole_model(compiled_model, backend, fullgraph=True)
    eager, compiled = train(eager_model), train(compiled_model)
    assert compiled == pytest.approx(eager, rel=1e-5, abs=1e-5)
    for (name, a), b in zip(eager_model.state_dict().items(), compiled_model.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.slow  # whole-model torch.compile of a debug model and 5 steps: tens of seconds on 2 cores
@pytest.mark.parametrize("family,mask", [("baseline", "causal"), ("mhar H=8", "block_causal")])
def test_whole_model_aot_eager_fullgraph_equals_eager(family, mask):
    """fullgraph=True (no graph break from the embedding to the loss), 5 AdamW steps: losses and
    weights within 1e-5 of eager; MHAR with the document mask and restarted positions."""
    check_equal(family, "aot_eager", attn_mask_type=mask, rope_per_document=mask == "block_causal")


@pytest.mark.slow
@pytest.mark.parametrize("family", ["baseline", "mhar H=8"])
def test_whole_model_inductor_equals_eager(family):
    check_equal(family, "inductor")


@pytest.mark.slow
def test_whole_model_compile_under_two_rank_fsdp2(tmp_path):
    """2-rank FSDP2 (gloo) with full AC and whole-model compile (aot_eager): every rank's losses
    over 5 steps equal the single-process eager model on its rows (tests/compile_fsdp_worker.py)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "tests" / "compile_fsdp_worker.py"), str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=PATIENCE_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for family in ("baseline", "mhar H=8"):
        assert (tmp_path / f"ok_{family.replace(' ', '_')}").exists(), proc.stdout[-3000:]
