"""transformers classes for our ``mhar_titan`` folders, loaded with ``trust_remote_code=True``.

An exported routing model's folder holds two small files, ``configuration_mhar_titan.py`` and
``modeling_mhar_titan.py`` (``REMOTE_FILES``), that import these classes from the installed
package, and ``config.json`` names them in ``auto_map``; so

    AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)

gives a ``MharTitanForCausalLM`` whose ``model`` is this package's ``Transformer`` (the same
forward, no second implementation of the routing math). Its ``generate()`` is transformers' own
loop over our KV cache: ``DecodingState`` holds a ``mhar_titan.eval.generation.Decoding``, the
decoder of ``generate_batch``, so batched prompts with any padding (the attention mask says which
tokens are real) give exactly ``generate_batch``'s tokens. ``save_pretrained`` writes the same
kind of folder again (the two files, the same ``auto_map``).

Needs transformers (``pip install 'mhar-titan[hf]'``); this module is imported only by those
folder files and the export's tests, never by the rest of the package.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.generation.configuration_utils import GenerationMode
from transformers.modeling_outputs import CausalLMOutputWithPast

from mhar_titan.eval.generation import Decoding, left_padded_forward
from mhar_titan.models.args import ModelArgs
from mhar_titan.models.model import Transformer

from .mhar_format import MODEL_TYPE, write_remote_files

CACHED_MODES = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE)
"""Generation modes that decode with ``DecodingState``; the others (beam search, assisted
generation, ...) reorder or roll back a cache, and run without one (every step runs the whole
sequence, exact but slower)."""


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
        kwargs.setdefault("use_cache", True)
        super().__init__(**kwargs)


class DecodingState:
    """The KV cache of one ``generate()`` call: a ``Decoding`` of the rows' real tokens.

    transformers' loop passes the whole sequence so far (B, L) and its attention mask at every
    step; the first call runs every row's real tokens (mask 1; padding on either side, or inside,
    is dropped) left-padded through the model, each later call appends the new column.

    Args:
        capacity: tokens that will be appended per row (``max_length`` minus the prompt width);
            more are still exact (the cache is refilled).
    """

    def __init__(self, capacity: int):
        self.capacity = max(int(capacity), 1)
        self.decoding: Optional[Decoding] = None
        self.sequence: Optional[torch.Tensor] = None

    def step(self, model, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor]) -> torch.Tensor:
        """Logits (B, 1, V) of each row's next token after ``input_ids`` (B, L).

        Raises:
            ValueError: a row with no real token, or a sequence that is not the previous one plus new
                columns (beam reordering, rolled-back candidates: generate with ``use_cache=False``).
        """
        mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        if self.decoding is None:
            rows = [ids[real].tolist() for ids, real in zip(input_ids, mask)]
            self.decoding = Decoding(model, rows, use_cache=True, capacity=self.capacity)
        else:
            seen = self.sequence.shape[1]
            if input_ids.shape[1] <= seen or not torch.equal(input_ids[:, :seen], self.sequence):
                raise ValueError("this KV cache only appends tokens (greedy or sampled generation); for a loop that "
                                 "reorders or rolls back sequences, generate with use_cache=False")
            if not bool(mask[:, seen:].all()):
                raise ValueError("padding after the prompt: only the prompt's attention mask may hold zeros")
            for column in input_ids[:, seen:].unbind(1):
                self.decoding.append(column)
        self.sequence = input_ids
        return self.decoding.logits[:, None]


class MharTitanForCausalLM(PreTrainedModel, GenerationMixin):
    """Causal LM over ``Transformer(ModelArgs(**config.model_args))`` (tensors under ``model.``).

    ``forward(input_ids (B, T) int64, attention_mask (B, T) optional, labels (B, T) optional)``
    returns ``logits`` (B, T, vocab_size) and, with labels, the mean next-token cross-entropy
    (nats; label -100 is ignored). The attention mask marks the real tokens (1) of each row: they
    get positions 0, 1, ... and attend only to each other, so a row with left padding (or any
    other) has the logits it has alone; logits at padding positions are 0. Within ``generate()``
    (``decoding``, a ``DecodingState``) it returns the next token's logits (B, 1, vocab_size).
    A row longer than ``max_position_embeddings`` raises ValueError (``generate()`` instead
    reads each row's last ``max_position_embeddings`` tokens, as ``generate_batch`` does).
    """

    config_class = MharTitanConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["TransformerBlock"]
    _supports_cache_class = False

    def __init__(self, config: MharTitanConfig):
        super().__init__(config)
        self.model = Transformer(ModelArgs(**config.model_args))
        self.model.init_weights()  # RoPE tables: the model recomputes them where it lives (Transformer._ready_rope)
        self.post_init()

    def _init_weights(self, module) -> None:
        """Nothing: the weights come from the folder (transformers must not reset the routing
        parameters, MHAR_SPEC section 5 pitfall 3) or from ``Transformer.init_weights``."""

    def get_input_embeddings(self):
        return self.model.tok_embeddings

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None, decoding: Optional[DecodingState] = None,
                **kwargs) -> CausalLMOutputWithPast:
        if decoding is not None:
            logits = decoding.step(self.model, input_ids, attention_mask)
        else:
            logits = self._logits(input_ids, attention_mask)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    def _logits(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor]) -> torch.Tensor:
        """(B, T, V) logits of the real tokens of every row (class docstring)."""
        if input_ids.shape[1] > self.model.args.max_seq_len:
            raise ValueError(f"{input_ids.shape[1]} tokens exceed this model's max_position_embeddings="
                             f"{self.model.args.max_seq_len}")
        mask = None if attention_mask is None else attention_mask.bool()
        if mask is None or not bool((mask[:, 1:] & ~mask[:, :-1]).any()):
            return self.model(input_ids)  # no padding, or right padding only: the causal model is exact
        rows = [ids[real].tolist() for ids, real in zip(input_ids, mask)]
        logits, _ = left_padded_forward(self.model, rows)
        out = logits.new_zeros(*input_ids.shape, logits.shape[-1])
        for b, real in enumerate(mask):
            out[b, real] = logits[b, logits.shape[1] - int(real.sum()):]
        return out

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        """transformers' own caches do not fit this model: ``DecodingState`` is its cache."""
        return False

    def _prepare_cache_for_generation(self, generation_config, model_kwargs: dict, *args, **kwargs) -> None:
        """transformers' hook that makes a generation's cache: a ``DecodingState`` sized for
        ``max_length`` in ``model_kwargs["decoding"]``, for greedy and sampled generation with
        ``use_cache`` (``CACHED_MODES``); nothing otherwise. The third argument is the generation
        mode (transformers 5) or the assistant model (4.x)."""
        first = args[0] if args else kwargs.get("generation_mode", kwargs.get("assistant_model"))
        mode = first if isinstance(first, GenerationMode) else generation_config.get_generation_mode(first)
        if generation_config.use_cache is False or mode not in CACHED_MODES:
            return
        width = model_kwargs["attention_mask"].shape[1] if model_kwargs.get("attention_mask") is not None else 0
        model_kwargs["decoding"] = DecodingState(generation_config.max_length - width)

    def prepare_inputs_for_generation(self, input_ids: torch.Tensor, attention_mask=None, decoding=None,
                                      **kwargs) -> dict:
        """The whole sequence and its mask at every step; the ``DecodingState`` runs only the new
        column (without one, the whole sequence runs again)."""
        return {"input_ids": input_ids, "attention_mask": attention_mask, "decoding": decoding}

    def save_pretrained(self, save_directory: str | os.PathLike, *args, **kwargs):
        """transformers' ``save_pretrained``, writing the same folder kind as the export: the two
        files of ``REMOTE_FILES`` that import this package and the same ``auto_map`` (not a copy
        of this package's modules, which transformers makes for remote code)."""
        classes = (type(self), type(self.config))
        saved = [c.__dict__.get("_auto_class", _UNSET) for c in classes]
        for c in classes:
            c._auto_class = None  # transformers copies the modules of a class with an auto class
        try:
            out = super().save_pretrained(save_directory, *args, **kwargs)
        finally:
            for c, value in zip(classes, saved):
                if value is _UNSET:
                    del c._auto_class
                else:
                    c._auto_class = value
        write_remote_files(save_directory)
        return out


_UNSET = object()
