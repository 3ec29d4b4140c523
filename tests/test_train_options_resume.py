"""Document masking, the loss paths and whole-model compile through the trainer: each option
resumes bitwise (4 steps uninterrupted vs 2 + 2 from the step-2 checkpoint, one machine)."""
from __future__ import annotations

import pathlib
import shutil
import sys

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from train_common import SAMPLE, debug_cfg, train  # noqa: E402

needs_sample = pytest.mark.skipif(not (SAMPLE / "validation-00000-of-00001.parquet").exists(),
                                  reason="run `python -m mhar_titan.data.prepare_shakespeare --out data/shakespeare`")
BYTES = ("--data.tokenizer=bytes", "--model.vocab_size=384", "--training.local_batch_size=2",
         "--checkpoint.enable=true", "--checkpoint.interval=2", "--training.steps=4")
OPTIONS = {
    "block_causal": ("--model.attn_mask_type=block_causal", "--model.rope_per_document=true"),
    "plain_loss": ("--training.loss_path=plain",),
    "chunked_loss": ("--training.loss_path=chunked", "--training.loss_chunk_tokens=16", "--training.z_loss=1e-4"),
    "whole_model": ("--compile.enable=true", '--compile.components=["whole_model"]', "--compile.backend=aot_eager"),
}


def resume_bitwise(tmp_path, *options) -> tuple[dict, pathlib.Path]:
    """The 4-step run's losses and its step-4 checkpoint, after checking the resumed run against it."""
    ref_losses, ref_weights, _ = train(debug_cfg(tmp_path, "ref", *BYTES, *options))
    assert sorted(ref_losses) == [1, 2, 3, 4]
    (tmp_path / "resumed" / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "ref" / "checkpoints" / "step-2", tmp_path / "resumed" / "checkpoints" / "step-2")
    losses, weights, _ = train(debug_cfg(tmp_path, "resumed", *BYTES, *options))
    assert sorted(losses) == [3, 4]
    assert [losses[s] for s in (3, 4)] == [ref_losses[s] for s in (3, 4)]
    for k in ref_weights:
        assert torch.equal(weights[k], ref_weights[k]), k
    return ref_losses, tmp_path / "ref" / "checkpoints" / "step-4"


@needs_sample
@pytest.mark.parametrize("option", [pytest.param(o, marks=pytest.mark.slow) if o == "whole_model" else o
                                    for o in OPTIONS])
def test_option_resumes_bitwise(tmp_path, option):
    _, checkpoint = resume_bitwise(tmp_path, *OPTIONS[option])
    if option == "block_causal":
        # the checkpoint records the mask, so evaluation and generation run the model as trained
        from mhar_titan.convert.dcp_io import load_model_dcp

        args = load_model_dcp(checkpoint).args
        assert (args.attn_mask_type, args.rope_per_document, args.eos_id) == ("block_causal", True, 256)
