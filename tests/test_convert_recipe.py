"""The mid-training recipe's trainer parts (issue 14, acceptance 6 and 7): z-loss, weight EMA
(closed form, checkpointed, exact resume), a Hugging Face folder as checkpoint.initial_load_path,
and the 8B config's dry run."""
from __future__ import annotations

import pathlib
import shutil
import sys

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from helpers import ROOT  # noqa: E402
from train_common import SAMPLE, debug_cfg, train  # noqa: E402

from mhar_titan.components.ema import WeightEMA, plain_name  # noqa: E402
from mhar_titan.components.loss import IGNORE_INDEX, build_loss_fn, token_loss_sum  # noqa: E402
from mhar_titan.config import Compile  # noqa: E402
from mhar_titan.models import ModelArgs, Transformer  # noqa: E402
from mhar_titan.models.args import count_parameters  # noqa: E402

RECIPE = ROOT / "train_configs" / "midtrain_llama3_8b_delta_mhar.toml"
BYTES = ("--data.tokenizer=bytes", "--model.vocab_size=384", "--training.local_batch_size=4")
needs_sample = pytest.mark.skipif(not (SAMPLE / "validation-00000-of-00001.parquet").exists(),
                                  reason="run `python -m mhar_titan.data.prepare_shakespeare --out data/shakespeare`")


@pytest.mark.parametrize("path", ["plain", "chunked"])
def test_z_loss_adds_its_weight_times_mean_squared_log_partition(path):
    g = torch.Generator().manual_seed(0)
    h, weight = torch.randn(3, 7, 16, generator=g), torch.randn(50, 16, generator=g)
    logits = torch.nn.functional.linear(h, weight)
    labels = torch.randint(0, 50, (3, 7), generator=g)
    labels[0, :3] = IGNORE_INDEX
    n = (labels != IGNORE_INDEX).sum()
    total = build_loss_fn(Compile(), z_loss=1e-4, path=path, chunk_tokens=4)(h, weight, labels) / n
    cross_entropy = token_loss_sum(logits, labels) / n
    lse = torch.logsumexp(logits.double(), -1)[labels != IGNORE_INDEX]
    torch.testing.assert_close((total - cross_entropy).double(), 1e-4 * lse.square().mean(), rtol=1e-4, atol=0)
    if path == "plain":
        assert build_loss_fn(Compile(), path=path)(h, weight, labels) == token_loss_sum(logits, labels)


def test_ema_equals_the_closed_form_of_the_trajectory():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3, dtype=torch.float64)
    decay, trajectory = 0.9, [model.weight.detach().clone()]
    ema = WeightEMA(model, decay)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(7):
        model(torch.randn(5, 4, dtype=torch.float64)).square().sum().backward()
        opt.step()
        opt.zero_grad()
        ema.update()
        trajectory.append(model.weight.detach().clone())
    k = len(trajectory) - 1
    closed = decay**k * trajectory[0] + (1 - decay) * sum(decay ** (k - j) * trajectory[j] for j in range(1, k + 1))
    torch.testing.assert_close(ema.averages["weight"].double(), closed, rtol=1e-6, atol=1e-7)
    assert not torch.equal(closed, trajectory[-1])
    with ema.swapped():
        assert torch.equal(model.weight, ema.averages["weight"].double())
    assert torch.equal(model.weight, trajectory[-1])
    assert plain_name("layers.0._checkpoint_wrapped_module.attention.wq.weight") == "layers.0.attention.wq.weight"


@needs_sample
def test_z_loss_and_ema_resume_bitwise(tmp_path):
    recipe = (*BYTES, "--training.z_loss=1e-4", "--training.ema_decay=0.9", "--checkpoint.enable=true",
              "--checkpoint.interval=2", "--training.steps=4")
    ref_losses, ref_weights, ref_ema = train(debug_cfg(tmp_path, "ref", *recipe))
    assert sorted(ref_losses) == [1, 2, 3, 4]
    assert any(not torch.equal(ref_ema[k], ref_weights[k]) for k in ref_ema)  # the average lags the weights
    (tmp_path / "resumed" / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "ref" / "checkpoints" / "step-2", tmp_path / "resumed" / "checkpoints" / "step-2")
    losses, weights, ema = train(debug_cfg(tmp_path, "resumed", *recipe))
    assert sorted(losses) == [3, 4]
    for step in (3, 4):
        assert losses[step] == ref_losses[step]
    for k in ref_ema:
        assert torch.equal(ema[k], ref_ema[k]) and torch.equal(weights[k], ref_weights[k]), k
    # export reads the EMA from a training checkpoint (the trained weights with ema=False)
    from mhar_titan.convert.dcp_io import load_model_dcp

    step4 = tmp_path / "ref" / "checkpoints" / "step-4"
    exported, trained = load_model_dcp(step4).state_dict(), load_model_dcp(step4, ema=False).state_dict()
    for k in ref_ema:
        assert torch.equal(exported[k], ref_ema[k]) and torch.equal(trained[k], ref_weights[k]), k
    without_z, _, _ = train(debug_cfg(tmp_path, "no_z", *BYTES, "--training.steps=1"))
    assert ref_losses[1] > without_z[1]  # same model and batch: the z-loss term is in the step's loss


@needs_sample
def test_hugging_face_folder_as_initial_load_path(tmp_path):
    """A Llama folder loads into the trainer's model; its delta-MHAR conversion (paper layout)
    takes the same first step as the standard model from the same folder."""
    from mhar_titan.convert import export_hf

    args = ModelArgs.from_flavor("debug", vocab_size=384, qk_norm=False, max_seq_len=512)
    torch.manual_seed(3)
    base = Transformer(args)
    base.init_weights()
    export_hf(base, tmp_path / "hf")
    load = ("--checkpoint.enable=true", f"--checkpoint.initial_load_path={tmp_path / 'hf'}", "--training.steps=1",
            "--model.qk_norm=false", *BYTES)
    standard, weights, _ = train(debug_cfg(tmp_path, "standard", *load, "--model.residual=standard"))
    delta, _, _ = train(debug_cfg(
        tmp_path, "delta", *load, "--model.routing_mode=delta", "--model.routing_layout=paper",
        "--model.routing_null_source=true", "--model.routing_granularity=block", "--model.routing_block_layers=2"))
    fresh, _, _ = train(debug_cfg(tmp_path, "fresh", *BYTES, "--model.qk_norm=false", "--model.residual=standard",
                                  "--training.steps=1"))
    assert delta[1] == standard[1] != fresh[1]


def test_recipe_dry_run_prints_the_paper_layout_parameter_count(capsys):
    from mhar_titan.dryrun import main

    assert not (ROOT / "checkpoints" / "marin-8b-base").exists()  # the dry run reads no model or tokenizer
    assert main(["--config", str(RECIPE), "--world-size", "8"]) == 0
    out = capsys.readouterr().out
    args = ModelArgs.from_flavor("llama3_8b", vocab_size=128256, max_seq_len=4096, residual="attn_res",
                                 routing_mode="delta", routing_layout="paper", routing_granularity="block",
                                 routing_block_layers=4, routing_heads=8, routing_null_source=True, routing_eps=1e-5)
    counts = count_parameters(args)
    assert "MHAR (H=8), delta, paper layout" in out
    assert f"{counts.total:,}" in out
    assert f"{counts.routing:,}" in out and counts.routing == 64 * (2 * 4096 + 1) + 64 * 4096
    assert "1,048,576 tokens per step" in out
