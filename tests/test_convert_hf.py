"""Hugging Face Llama import/export against transformers (issue 14, acceptance 1 and 4)."""
from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from mhar_titan.checkpoint import CheckpointConfig, CheckpointManager  # noqa: E402
from mhar_titan.convert.__main__ import main as convert_main  # noqa: E402
from mhar_titan.convert import ConversionError, export_hf, hf_args, import_hf  # noqa: E402
from mhar_titan.convert.dcp_io import load_model_dcp  # noqa: E402
from mhar_titan.convert.safetensors_io import shard_paths  # noqa: E402
from mhar_titan.models import ModelArgs, Transformer  # noqa: E402

VOCAB = 320


def tiny_llama(folder, tied: bool, seed: int = 0):
    """A random LlamaForCausalLM with llama3 RoPE scaling saved in exactly 2 shards; returns the model."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=tied,
        rope_theta=500_000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=32),
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # non-trivial norm weights and larger weights than the 0.02 init
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.08 * torch.randn_like(p))
    total = sum(p.numel() * 4 for p in model.state_dict().values())
    model.save_pretrained(folder, max_shard_size=f"{int(total * 0.6) // 1000}KB")
    assert len(shard_paths(folder)) == 2
    return model


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / a.abs().max()).item()


@pytest.fixture(params=[False, True], ids=["untied", "tied"])
def hf_folder(request, tmp_path):
    folder = tmp_path / "hf"
    return folder, tiny_llama(folder, tied=request.param)


TOKENS = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(1))


def test_config_fields_come_from_config_json(hf_folder):
    folder, hf = hf_folder
    args = hf_args(folder)
    c = hf.config
    assert (args.dim, args.n_layers, args.n_heads, args.n_kv_heads, args.ffn_dim, args.vocab_size) == (
        64, 3, 4, 2, 160, VOCAB)
    assert args.norm_eps == 1e-5 and args.rope_theta == 500_000.0 and args.qk_norm is False
    assert (args.rope_scaling, args.rope_scaling_factor, args.rope_original_max_seq_len) == ("llama3", 8.0, 32)
    assert args.tie_embeddings == c.tie_word_embeddings and args.max_seq_len == 256
    assert args.residual == "standard"


def test_import_matches_transformers_logits(hf_folder):
    folder, hf = hf_folder
    model = import_hf(folder)
    assert model.args.tie_embeddings == (model.output is None)
    with torch.no_grad():
        expected, got = hf(TOKENS).logits, model(TOKENS)
    assert rel_err(expected, got) < 1e-5


def test_export_reloads_in_transformers(hf_folder, tmp_path):
    folder, hf = hf_folder
    model = import_hf(folder)
    export_hf(model, tmp_path / "out", max_shard_bytes=200_000)
    assert len(shard_paths(tmp_path / "out")) > 1
    reloaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    with torch.no_grad():
        assert rel_err(hf(TOKENS).logits, reloaded(TOKENS).logits) < 1e-5
    for name, p in hf.state_dict().items():
        assert torch.equal(p, reloaded.state_dict()[name]), name


def test_import_command_writes_a_checkpoint_for_initial_load_path(tmp_path):
    folder = tmp_path / "hf"
    hf = tiny_llama(folder, tied=False)
    out = tmp_path / "converted"
    assert convert_main(["import", str(folder), str(out), "--max-seq-len", "64"]) == 0
    args = hf_args(folder, max_seq_len=64)
    model = Transformer(args)
    model.init_weights()
    cfg = CheckpointConfig(enable=True, initial_load_path=str(out))
    assert CheckpointManager(cfg, tmp_path / "run", model=model).load() == 0
    with torch.no_grad():
        assert rel_err(hf(TOKENS).logits, model(TOKENS)) < 1e-5
    # and the export command takes the converted checkpoint back to a Llama folder
    assert convert_main(["export", str(out), str(tmp_path / "back"), "--tokenizer", "bytes"]) == 0
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float32)
    for name, p in hf.state_dict().items():
        assert torch.equal(p, back.state_dict()[name]), name
    assert torch.equal(load_model_dcp(out).output.weight, hf.lm_head.weight)


def test_routing_model_on_a_llama_backbone_keeps_routing_init(tmp_path):
    folder = tmp_path / "hf"
    hf = tiny_llama(folder, tied=False)
    model = import_hf(folder, residual="attn_res", routing_mode="delta", routing_granularity="block",
                      routing_null_source=True)
    assert torch.equal(model.routing.alpha, torch.zeros_like(model.routing.alpha))
    assert torch.equal(model.routing.query, torch.zeros_like(model.routing.query))
    with torch.no_grad():
        assert rel_err(hf(TOKENS).logits, model(TOKENS)) < 1e-5


def test_bad_folders_are_refused_before_loading(tmp_path):
    folder = tmp_path / "hf"
    tiny_llama(folder, tied=False)
    config = json.loads((folder / "config.json").read_text())

    with pytest.raises(ConversionError, match="model_type='qwen2'"):
        (folder / "config.json").write_text(json.dumps({**config, "model_type": "qwen2"}))
        import_hf(folder)
    with pytest.raises(ConversionError, match="attention_bias"):
        (folder / "config.json").write_text(json.dumps({**config, "attention_bias": True}))
        import_hf(folder)
    # a config that disagrees with the weights: every bad tensor is named, nothing is loaded
    (folder / "config.json").write_text(json.dumps({**config, "intermediate_size": 128}))
    with pytest.raises(ConversionError, match=r"mlp.gate_proj.weight: shape \(160, 64\) in the checkpoint"):
        import_hf(folder)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConversionError, match="rope_theta: checkpoint 500000.0, model 10000.0"):
        model = Transformer(ModelArgs(**{**vars(hf_args(folder)), "rope_theta": 10_000.0}))
        from mhar_titan.convert import load_hf_weights
        load_hf_weights(model, folder)
    (folder / "model.safetensors.index.json").unlink()
    with pytest.raises(ConversionError, match="neither model.safetensors nor"):
        import_hf(folder)


@pytest.mark.parametrize("layout", ["paper", "clean"])
def test_import_command_converts_to_delta_mhar(tmp_path, layout):
    folder = tmp_path / "hf"
    tiny_llama(folder, tied=True)
    assert convert_main(["import", str(folder), str(tmp_path / "delta"), "--to-delta", layout, "--max-seq-len", "64"]) == 0
    converted = load_model_dcp(tmp_path / "delta")
    args = converted.args
    assert (args.routing_layout, args.routing_mode, args.resolved_routing_heads, args.routing_block_layers) == (
        layout, "delta", 8, 4)
    assert args.routing_null_source and (args.routing_eps == 1e-5 if layout == "paper" else True)
    with torch.no_grad():
        assert torch.equal(converted(TOKENS), import_hf(folder, max_seq_len=64)(TOKENS))
