"""The one tokenizer type of the project (``Tokenizer``), which every tokenizer module builds.

Its own module so that the builders (``tokenizer.build_tokenizer`` for tiktoken encodings and the
byte tokenizer, ``hf_tokenizer.load_hf_tokenizer`` for Hugging Face folders) import it one way:
``tokenizer`` -> ``hf_tokenizer`` -> ``tokenizer_base``. ``mhar_titan.data.tokenizer.Tokenizer``
is this class.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

__all__ = ["Tokenizer"]


@dataclass
class Tokenizer:
    """A text -> token ids encoder with a single end-of-text id.

    ``encode`` is tiktoken's *ordinary* encoding: special-token strings inside the
    text (e.g. the literal "<|endoftext|>") are encoded as plain text, never as
    ``eos_id``; only the packer inserts ``eos_id`` between documents.
    """

    name: str
    n_vocab: int
    eos_id: int
    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    bpe: Optional[dict] = None
    """The ``tiktoken.Encoding`` arguments of a BPE tokenizer (``pat_str``, ``mergeable_ranks``:
    token bytes -> id, ``special_tokens``: text -> id), from which an export writes the same
    tokenizer in Hugging Face's format (``convert.tokenizer_files``); None for the byte tokenizer."""

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]
