"""transformers classes for our ``mhar_titan`` folders, loaded with ``trust_remote_code=True``.

An exported routing model's folder holds two small files, ``configuration_mhar_titan.py`` and
``modeling_mhar_titan.py`` (``REMOTE_FILES``), that import these classes from the installed
package, and ``config.json`` names them in ``auto_map``; so

    AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)

gives a ``MharTitanForCausalLM`` whose ``model`` is this package's ``Transformer`` (the same
forward, no second implementation of the routing math) and whose ``generate()`` is
transformers' own, without a KV cache: every step runs the whole sequence (correct, slower).

Needs transformers (``pip install 'mhar-titan[hf]'``); this module is imported only by those
folder files and the export's tests, never by the rest of the package.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from mhar_titan.models.args import ModelArgs
from mhar_titan.models.model import Transformer, rope_cos_sin

from .mhar_format import MODEL_TYPE


class MharTitanConfig(PretrainedConfig):
    """``config.json`` of a ``mhar_titan`` folder: every ``ModelArgs`` field under ``model_args``,
    plus the names transformers' tools read (vocab_size, hidden_size, num_hidden_layers,
    num_attention_heads, max_position_embeddings) copied from them."""

    model_type = MODEL_TYPE

    def __init__(self, model_args: Optional[dict] = None, format_version: int = 2, **kwargs):
        self.model_args = dict(model_args or {})
        self.format_version = format_version
        if self.model_args:
            args = ModelArgs(**self.model_args)
            self.vocab_size, self.hidden_size = args.vocab_size, args.dim
            self.num_hidden_layers, self.num_attention_heads = args.n_layers, args.n_heads
            self.max_position_embeddings = args.max_seq_len
        kwargs["tie_word_embeddings"] = False  # the Transformer ties its own output to its embedding
        kwargs.setdefault("use_cache", False)
        super().__init__(**kwargs)


class MharTitanForCausalLM(PreTrainedModel, GenerationMixin):
    """Causal LM over ``Transformer(ModelArgs(**config.model_args))`` (tensors under ``model.``).

    ``forward(input_ids (B, T) int64, attention_mask (B, T) optional, labels (B, T) optional)``
    returns ``logits`` (B, T, vocab_size) and, with labels, the mean next-token cross-entropy
    (nats; label -100 is ignored). An attention mask may only mark right padding (ones, then
    zeros): the causal model reads no later position, so right-padded rows are exact; left
    padding raises ValueError (generate one prompt at a time, or prompts of equal length).
    """

    config_class = MharTitanConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["TransformerBlock"]
    _supports_cache_class = False

    def __init__(self, config: MharTitanConfig):
        super().__init__(config)
        self.model = Transformer(ModelArgs(**config.model_args))
        self.model.init_weights()
        self._rope_device: Optional[torch.device] = None
        self.post_init()

    def _init_weights(self, module) -> None:
        """Nothing: the weights come from the folder (transformers must not reset the routing
        parameters, MHAR_SPEC section 5 pitfall 3) or from ``Transformer.init_weights``."""

    def get_input_embeddings(self):
        return self.model.tok_embeddings

    def _ready_rope(self, device: torch.device) -> None:
        """RoPE tables are buffers that are not saved: computed here, once per device (a model
        built on the meta device by from_pretrained holds none)."""
        if self._rope_device != device:
            self.model.rope_cos, self.model.rope_sin = rope_cos_sin(self.model.args, device=device)
            self._rope_device = device

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None, **kwargs) -> CausalLMOutputWithPast:
        if attention_mask is not None:
            mask = attention_mask.bool()
            if bool((mask[:, 1:] & ~mask[:, :-1]).any()):
                raise ValueError("this model reads no padding mask: only right padding is exact; generate one "
                                 "prompt at a time or prompts of equal length")
        self._ready_rope(input_ids.device)
        logits = self.model(input_ids)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    def prepare_inputs_for_generation(self, input_ids: torch.Tensor, attention_mask=None, **kwargs) -> dict:
        """The whole sequence at every step (no KV cache)."""
        return {"input_ids": input_ids, "attention_mask": attention_mask}
