"""Tokenizer files of an exported folder: ``transformers.AutoTokenizer.from_pretrained(folder)``
loads them and encodes text to the ids training used.

Every tokenizer of the project is a byte-level BPE (``mhar_titan.data.tokenizer``):

- tiktoken encodings (``gpt2``, ``cl100k_base``, ``o200k_base``) and Llama-3-style folders read
  from ``tokenizer.model`` alone: their ranks (token bytes -> id) become a ``tokenizers`` BPE
  (``bpe_vocab_merges``: the way transformers converts tiktoken files, Llama-3's included), with
  ``ignore_merges`` (a pre-token that is a whole vocabulary entry is one token, as in tiktoken),
  the encoding's split regex (``onig_pattern``) and its special tokens at their ids;
- the byte tokenizer (``bytes``): ids 0-255 are the UTF-8 bytes, 256 the end of text
  (``<|endoftext|>``): a BPE of the 256 single bytes with no merges;
- a Hugging Face folder that has a ``tokenizer.json`` (``data.tokenizer = "hf:<folder>"``): its
  tokenizer files are copied as they are.

Written: ``tokenizer.json``, ``tokenizer_config.json`` (``PreTrainedTokenizerFast``, eos token,
the eos token as pad token with left padding, so that ``tokenizer(prompts, padding=True)`` gives
the batch ``generate()`` needs, special tokens) and ``special_tokens_map.json``; a copied folder's
``tokenizer_config.json`` without a pad token gets the same pad token and padding side. ``encode(text, add_special_tokens=False)`` of the
result equals the training ids (the project's ``encode``); the copied Llama-3 files keep their
own begin-of-text post-processor. Files are created with ``open`` / ``copyfile`` (the umask applies).
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from mhar_titan.data.hf_tokenizer import HFTokenizer, byte_to_unicode
from mhar_titan.data.tokenizer import BYTE_EOS, Tokenizer
from mhar_titan.files import write_text

from .hf_config import ConversionError

COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                "original/tokenizer.model")
BYTE_EOS_TEXT = "<|endoftext|>"
_POSSESSIVE_INTERVAL = re.compile(r"(\\p\{\w+\}|\[[^\]]*\]|\\.|[^\\(){}])\{(\d+),(\d+)\}\+")
"""An atom followed by a possessive interval, e.g. cl100k_base's ``\\p{N}{1,3}+``."""


def onig_pattern(pattern: str) -> str:
    """A tiktoken split regex in the dialect of ``tokenizers`` (Oniguruma): a possessive interval
    ``X{m,n}+`` (which Oniguruma reads as "X{m,n}, one or more times": "2026" would be one piece
    instead of "202", "6") becomes the atomic group ``(?>X{m,n})``, which means the same in both."""
    return _POSSESSIVE_INTERVAL.sub(r"(?>\1{\2,\3})", pattern)


def _libraries():
    try:
        from tokenizers import AddedToken, Regex, Tokenizer as Backend, decoders, pre_tokenizers
        from tokenizers.models import BPE
    except ImportError:
        raise ConversionError("writing tokenizer files needs the tokenizers package: "
                              "pip install 'mhar-titan[hf]'") from None
    return AddedToken, Regex, Backend, decoders, pre_tokenizers, BPE


def bpe_vocab_merges(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """(vocabulary, merges) of a byte-level BPE that merges like tiktoken with ``ranks``.

    Tokens are spelled with GPT-2's byte-to-unicode table. Every split of a token into two
    tokens is a merge whose priority is the token's rank (tiktoken merges the adjacent pair whose
    concatenation has the lowest rank), ties broken by the parts' ranks; so the merges are in id
    order, as ``hf_tokenizer`` needs to read them back."""
    spell = byte_to_unicode()

    def text(token: bytes) -> str:
        return "".join(spell[b] for b in token)

    merges = sorted((rank, ranks[token[:k]], ranks[token[k:]], token[:k], token[k:])
                    for token, rank in ranks.items() for k in range(1, len(token))
                    if token[:k] in ranks and token[k:] in ranks)
    return {text(token): rank for token, rank in ranks.items()}, [(text(a), text(b)) for *_, a, b in merges]


def bpe_arguments(tokenizer: Tokenizer) -> tuple[dict[bytes, int], str | None, dict[str, int]]:
    """(ranks, split regex or None, special tokens) of a project tokenizer (module docstring).

    Raises:
        ConversionError: a tokenizer that is neither the byte tokenizer nor a BPE with its ranks.
    """
    if tokenizer.bpe is not None:
        return dict(tokenizer.bpe["mergeable_ranks"]), tokenizer.bpe["pat_str"], dict(tokenizer.bpe["special_tokens"])
    if tokenizer.name == "bytes":
        return {bytes([b]): b for b in range(256)}, None, {BYTE_EOS_TEXT: BYTE_EOS}
    raise ConversionError(f"tokenizer {tokenizer.name!r} carries no BPE ranks; it cannot be written as tokenizer files")


def backend_tokenizer(ranks: dict[bytes, int], pattern: str | None, specials: dict[str, int]):
    """A ``tokenizers.Tokenizer`` that encodes like tiktoken with these ranks, regex and special tokens."""
    AddedToken, Regex, Backend, decoders, pre_tokenizers, BPE = _libraries()
    vocab, merges = bpe_vocab_merges(ranks)
    vocab.update(specials)  # special tokens keep their ids (they are not contiguous in cl100k_base)
    backend = Backend(BPE(vocab, merges, fuse_unk=False, ignore_merges=True))
    steps = [pre_tokenizers.Split(Regex(onig_pattern(pattern)), behavior="isolated", invert=False)] if pattern else []
    backend.pre_tokenizer = pre_tokenizers.Sequence(steps + [pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                      use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(text, special=True, normalized=False) for text in specials])
    return backend


def _write_json(path: Path, data: dict) -> None:
    write_text(path, json.dumps(data, indent=2, ensure_ascii=False))


MODEL_INPUT_NAMES = ("input_ids", "attention_mask")
"""What the tokenizer returns: the inputs every exported model's forward takes (transformers 4.x
would add ``token_type_ids``, which ``generate(**tokenizer(prompts))`` then refuses)."""


def _add_padding(path: Path) -> None:
    """Give a copied ``tokenizer_config.json`` that names no pad token the eos token as its pad
    token, and left padding (what batched generation needs); one that has a pad token is kept.
    Without ``model_input_names`` it gets ``MODEL_INPUT_NAMES``."""
    if not path.is_file():
        return
    config = json.loads(path.read_text())
    update = {} if "model_input_names" in config else {"model_input_names": list(MODEL_INPUT_NAMES)}
    if config.get("pad_token") is None and config.get("eos_token") is not None:
        update.update(pad_token=config["eos_token"], padding_side=config.get("padding_side", "left"))
    if update:
        _write_json(path, {**config, **update})


def pad_token_id(folder: str | os.PathLike, tokenizer: Tokenizer) -> int:
    """The id of the pad token the tokenizer files in ``folder`` name (what
    ``AutoTokenizer.from_pretrained(folder).pad_token_id`` is), for ``config.json`` and
    ``generation_config.json``: ``special_tokens_map.json``'s pad token, else
    ``tokenizer_config.json``'s (transformers lets the first override the second), looked up among
    ``tokenizer``'s special tokens, then in ``tokenizer.json`` (added tokens, vocabulary); the eos
    id when the files name no pad token (the files this module writes pad with eos).

    Raises:
        ConversionError: the named pad token is not in the tokenizer's vocabulary.
    """
    folder = Path(folder)
    name = None
    for file in ("special_tokens_map.json", "tokenizer_config.json"):
        if (folder / file).is_file():
            value = json.loads((folder / file).read_text()).get("pad_token")
            name = value.get("content") if isinstance(value, dict) else value
            if name is not None:
                break
    if name is None:
        return tokenizer.eos_id
    specials = getattr(tokenizer, "special_tokens", None) or {}
    if name in specials:
        return specials[name]
    if (folder / "tokenizer.json").is_file():
        backend = json.loads((folder / "tokenizer.json").read_text())
        added = {entry["content"]: int(entry["id"]) for entry in backend.get("added_tokens", [])}
        vocab = (backend.get("model") or {}).get("vocab") or {}
        found = added.get(name, vocab.get(name) if isinstance(vocab, dict) else None)
        if found is not None:
            return int(found)
    raise ConversionError(f"{folder}: the tokenizer files name the pad token {name!r}, which is not in the "
                          "tokenizer's vocabulary; fix pad_token in tokenizer_config.json / special_tokens_map.json")


def write_tokenizer_files(tokenizer: Tokenizer, folder: str | os.PathLike, model_max_length: int) -> list[Path]:
    """Write ``tokenizer``'s files into ``folder`` (module docstring); returns the paths written.

    Args:
        tokenizer: the tokenizer training used (``mhar_titan.data.build_tokenizer``).
        folder: an existing export folder.
        model_max_length: the longest input in tokens (tokenizer_config.json).

    Raises:
        ConversionError: transformers / tokenizers are not installed, or the tokenizer has no ranks.
    """
    folder = Path(folder)
    source = tokenizer.folder if isinstance(tokenizer, HFTokenizer) else None
    if source is not None and (source / "tokenizer.json").is_file():
        written = []
        for name in COPIED_FILES:
            if (source / name).is_file():
                (folder / name).parent.mkdir(exist_ok=True)
                shutil.copyfile(source / name, folder / name)  # copyfile: new files get the umask's mode
                written.append(folder / name)
        _add_padding(folder / "tokenizer_config.json")
        return written
    ranks, pattern, specials = bpe_arguments(tokenizer)
    eos = next((text for text, i in specials.items() if i == tokenizer.eos_id), None)
    if eos is None:
        raise ConversionError(f"tokenizer {tokenizer.name!r}: its eos id {tokenizer.eos_id} is no special token")
    backend_tokenizer(ranks, pattern, specials).save(str(folder / "tokenizer.json"))
    bos = None if getattr(tokenizer, "bos_id", None) is None else next(
        (text for text, i in specials.items() if i == tokenizer.bos_id), None)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "bos_token": bos, "pad_token": eos,
        "padding_side": "left", "model_input_names": list(MODEL_INPUT_NAMES), "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {str(i): {"content": text, "special": True, "lstrip": False, "rstrip": False,
                                          "normalized": False, "single_word": False}
                                 for text, i in sorted(specials.items(), key=lambda item: item[1])},
    }
    _write_json(folder / "tokenizer_config.json", config)
    _write_json(folder / "special_tokens_map.json", {"eos_token": eos, "pad_token": eos,
                                                    **({"bos_token": bos} if bos else {})})
    return [folder / "tokenizer.json", folder / "tokenizer_config.json", folder / "special_tokens_map.json"]
