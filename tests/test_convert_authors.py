"""Checkpoints of the authors' modeling code (issue 14, acceptance 3, second half): their
parameter names import into the matching layout and export back to identical tensors, and the
paper layout computes their delta forward."""
from __future__ import annotations

import json

import pytest
import torch

safetensors_torch = pytest.importorskip("safetensors.torch")

from mhar_titan.convert import ConversionError, load_pretrained  # noqa: E402
from mhar_titan.convert.authors import authors_args, export_authors, import_authors  # noqa: E402
from mhar_titan.convert.safetensors_io import iter_tensors  # noqa: E402
from mhar_titan.models.model import AttentionContext  # noqa: E402
from mhar_kernels.reference import route_reference  # noqa: E402

D, L, VOCAB, FFN = 32, 5, 64, 48
LLAMA = dict(hidden_size=D, num_hidden_layers=L, num_attention_heads=4, num_key_value_heads=2, intermediate_size=FFN,
             vocab_size=VOCAB, rms_norm_eps=1e-5, max_position_embeddings=32, tie_word_embeddings=False,
             rope_theta=500_000.0)
MODES = {
    "delta_mh": dict(attnres_mode="delta_mh", attnres_num_heads=4, attnres_num_blocks=3,  # blocks of ceil(5/3) = 2
                     attnres_gate_type="learnable_alpha", attnres_use_null_source=True),
    "delta": dict(attnres_mode="delta", attnres_num_heads=8, attnres_gate_type="learnable_alpha",
                  attnres_use_null_source=True),
    "full_mh": dict(attnres_mode="full_mh", attnres_num_heads=4, attnres_gate_type="bias"),
}


def authors_state(mode: str, alpha_shape=(1,)) -> dict[str, torch.Tensor]:
    """A state dict under the authors' names with random non-zero values."""
    g = torch.Generator().manual_seed(5)

    def rand(*shape):
        return torch.randn(shape, generator=g) * 0.3 + 0.01

    state = {"model.embed_tokens.weight": rand(VOCAB, D), "model.norm.weight": rand(D), "lm_head.weight": rand(VOCAB, D)}
    for i in range(L):
        p = f"model.layers.{i}."
        hd = D // 4
        state.update({p + "self_attn.q_proj.weight": rand(D, D), p + "self_attn.k_proj.weight": rand(2 * hd, D),
                      p + "self_attn.v_proj.weight": rand(2 * hd, D), p + "self_attn.o_proj.weight": rand(D, D),
                      p + "mlp.gate_proj.weight": rand(FFN, D), p + "mlp.up_proj.weight": rand(FFN, D),
                      p + "mlp.down_proj.weight": rand(D, FFN), p + "input_layernorm.weight": rand(D),
                      p + "post_attention_layernorm.weight": rand(D)})
        for site in ("attn", "mlp"):
            state[p + f"{site}_res_proj.weight"] = rand(1, D)
            state[p + f"{site}_res_norm.weight"] = rand(D)
            if mode.startswith("delta"):
                state[p + f"{site}_res_alpha"] = rand(*alpha_shape)
                state[p + f"{site}_null_source"] = rand(D)
    if not mode.startswith("delta"):
        state["model.final_res_proj.weight"] = rand(1, D)
        state["model.final_res_norm.weight"] = rand(D)
    return state


def write_folder(folder, mode, state):
    folder.mkdir()
    config = {**LLAMA, **MODES[mode], "model_type": "llama_attnres", "architectures": ["LlamaAttnResForCausalLM"]}
    (folder / "config.json").write_text(json.dumps(config))
    safetensors_torch.save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("mode", MODES)
def test_import_then_export_gives_identical_tensors(tmp_path, mode):
    state = authors_state(mode)
    write_folder(tmp_path / "theirs", mode, state)
    model = load_pretrained(tmp_path / "theirs")  # dispatches on model_type llama_attnres
    expected_layout = "paper" if mode.startswith("delta") else "clean"
    assert model.args.routing_layout == expected_layout and model.args.routing_eps == 1e-5
    assert torch.equal(model.routing.query[3], state["model.layers.1.mlp_res_proj.weight"][0])
    export_authors(model, tmp_path / "back", max_shard_bytes=20_000)
    back = dict(iter_tensors(tmp_path / "back"))
    assert sorted(back) == sorted(state)
    for name, tensor in state.items():
        assert back[name].shape == tensor.shape and torch.equal(back[name], tensor), name
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert {k: config[k] for k in MODES[mode]} == {**MODES[mode], "attnres_num_heads": model.args.resolved_routing_heads}


def test_zero_dim_gates_import(tmp_path):
    state = authors_state("delta_mh", alpha_shape=())
    write_folder(tmp_path / "theirs", "delta_mh", state)
    model = import_authors(tmp_path / "theirs")
    assert torch.equal(model.routing.alpha[7, 0], state["model.layers.3.mlp_res_alpha"])


def reference_delta_forward(model, tokens, sublayer_sources: bool):
    """The authors' delta forward loop (`delta` / `delta_mh`: blocks start empty, each site routes
    over [its null] + blocks, the boundary append before the attention output is added, no final
    routing), written directly against the model's modules."""
    args, r = model.args, model.routing
    T = tokens.shape[1]
    context = AttentionContext(model.rope_cos[:T], model.rope_sin[:T])
    h = model.tok_embeddings(tokens)
    blocks = []

    def routed(site, h):
        mix = route_reference([r.null_source[site].expand_as(h), *blocks], r.query[site], r.key_norm[site],
                              args.resolved_routing_heads, args.routing_eps)
        return h + r.alpha[site] * mix

    for i, layer in enumerate(model.layers):
        a = layer.attention(layer.attention_norm(routed(2 * i, h)), context)
        if sublayer_sources:
            blocks += ([h] if not blocks else []) + [a]
        elif i % args.routing_block_layers == 0:
            blocks.append(h if not blocks else h - blocks[-1])
        h = h + a
        m = layer.feed_forward(layer.ffn_norm(routed(2 * i + 1, h)))
        if sublayer_sources:
            blocks.append(m)
        h = h + m
    return model.output(model.norm(h))


@pytest.mark.parametrize("mode", ["delta_mh", "delta"])
def test_paper_layout_computes_the_authors_forward(tmp_path, mode):
    write_folder(tmp_path / "theirs", mode, authors_state(mode))
    model = import_authors(tmp_path / "theirs")
    tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), reference_delta_forward(model, tokens, mode == "delta"),
                                   rtol=1e-6, atol=1e-6)


def test_unsupported_configs_are_named():
    with pytest.raises(ConversionError, match="attnres_mode='hyper_connection' is not supported"):
        authors_args({**LLAMA, "attnres_mode": "hyper_connection"})
    with pytest.raises(ConversionError, match="only the learnable_alpha gate"):
        authors_args({**LLAMA, **MODES["delta_mh"], "attnres_gate_type": "sigmoid_scalar"})
