"""Parameter names: Hugging Face Llama / Qwen3 (and the authors' routing names) <-> our state dict.

Our state dict keys are the plain model's (``layers.3.attention.wq.weight``, ``routing.query``).
Routing parameters are stacked per site in ``DepthRouting`` (``routing.query`` is (S, d), row
2i / 2i+1 = layer i's attention / MLP site, row 2L = final site); checkpoints of the authors'
modeling code store one tensor per site instead. A name therefore maps to a *target*:
``(our key, row)`` with ``row = None`` for a whole tensor.

Backbone names (transformers ``LlamaForCausalLM`` and ``Qwen3ForCausalLM``, which is Llama plus
per-head q/k RMSNorm; weights in the rotate-half RoPE layout that our attention uses too, so no
permutation is needed):

====================================================  ===================================
``model.embed_tokens.weight``                         ``tok_embeddings.weight``
``model.layers.{i}.self_attn.{q,k,v,o}_proj.weight``  ``layers.{i}.attention.w{q,k,v,o}.weight``
``model.layers.{i}.self_attn.{q,k}_norm.weight``      ``layers.{i}.attention.{q,k}_norm.weight`` (Qwen3)
``model.layers.{i}.mlp.gate_proj.weight``             ``layers.{i}.feed_forward.w1.weight``
``model.layers.{i}.mlp.up_proj.weight``               ``layers.{i}.feed_forward.w3.weight``
``model.layers.{i}.mlp.down_proj.weight``             ``layers.{i}.feed_forward.w2.weight``
``model.layers.{i}.input_layernorm.weight``           ``layers.{i}.attention_norm.weight``
``model.layers.{i}.post_attention_layernorm.weight``  ``layers.{i}.ffn_norm.weight``
``model.norm.weight``                                 ``norm.weight``
``lm_head.weight``                                    ``output.weight`` (untied models)
====================================================  ===================================
"""
from __future__ import annotations

import re
from typing import Optional

Target = tuple[str, Optional[int]]

LAYER_NAMES = {
    "self_attn.q_proj.weight": "attention.wq.weight",
    "self_attn.k_proj.weight": "attention.wk.weight",
    "self_attn.v_proj.weight": "attention.wv.weight",
    "self_attn.o_proj.weight": "attention.wo.weight",
    "self_attn.q_norm.weight": "attention.q_norm.weight",
    "self_attn.k_norm.weight": "attention.k_norm.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
    "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}
TOP_NAMES = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}
IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
"""Buffers some older checkpoints store; recomputed from the config."""

_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_OUR_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_LAYER_NAMES_BACK = {ours: hf for hf, ours in LAYER_NAMES.items()}
_TOP_NAMES_BACK = {ours: hf for hf, ours in TOP_NAMES.items()}


def backbone_target(hf_name: str) -> Optional[Target]:
    """Our ``(key, None)`` for a HF Llama backbone name; None for names this table does not know."""
    if hf_name in TOP_NAMES:
        return TOP_NAMES[hf_name], None
    match = _HF_LAYER.match(hf_name)
    if match and match.group(2) in LAYER_NAMES:
        return f"layers.{match.group(1)}.{LAYER_NAMES[match.group(2)]}", None
    return None


def backbone_hf_name(key: str) -> Optional[str]:
    """The HF Llama name of one of our backbone keys; None for routing keys."""
    if key in _TOP_NAMES_BACK:
        return _TOP_NAMES_BACK[key]
    match = _OUR_LAYER.match(key)
    if match and match.group(2) in _LAYER_NAMES_BACK:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES_BACK[match.group(2)]}"
    return None
