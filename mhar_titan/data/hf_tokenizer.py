"""The tokenizer of a Hugging Face model folder (Llama-3 style byte-level BPE) as a tiktoken encoding.

Mid-training data must be tokenized exactly as the base model was. A Llama-3 folder ships its
BPE in one or both of:

- ``tokenizer.model`` (often under ``original/``): tiktoken's format, one ``base64(token) rank``
  line per token; the rank is the token id. Its split pattern is not in the file: it is taken
  from ``tokenizer.json`` when present, else Llama-3's (``LLAMA3_PATTERN``).
- ``tokenizer.json`` (the ``tokenizers`` library's format): a byte-level BPE whose vocabulary
  maps GPT-2's byte-to-unicode spelling of each token to its id, with the split regex in the
  pre-tokenizer. It is turned into tiktoken ranks (rank = id) when its merges are in id order,
  which is how tiktoken applies them (true of every tokenizer converted from tiktoken, Llama-3's
  included); otherwise it is refused.

Special tokens (``<|begin_of_text|>``, ``<|end_of_text|>``, ``<|eot_id|>``, reserved ones) come
from ``tokenizer_config.json`` (``added_tokens_decoder``), else ``tokenizer.json``
(``added_tokens``); ``eos_token`` / ``bos_token`` name the end and begin ids. As for every
tokenizer here, ``encode`` is ordinary encoding (special-token text stays text; the packer
inserts ``eos_id``); ``encode_with_special`` maps special-token text to its id, as transformers'
tokenizers do.
"""
from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import tiktoken

from mhar_titan.data.tokenizer_base import Tokenizer
from mhar_titan.errors import UserError

LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
"""Llama-3's pre-tokenization regex (the same as cl100k_base's)."""

GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
"""The byte-level pre-tokenizer's built-in regex (ByteLevel with use_regex = true)."""

TIKTOKEN_FILES = ("tokenizer.model", "original/tokenizer.model")


class HFTokenizerError(UserError, ValueError):
    """A tokenizer folder cannot be loaded; the message names the file and what is wrong."""


@dataclass
class HFTokenizer(Tokenizer):
    """``Tokenizer`` plus the begin-of-text id and the special tokens of a HF folder."""

    bos_id: Optional[int] = None
    special_tokens: dict[str, int] = field(default_factory=dict)
    encode_with_special: Optional[Callable[[str], list[int]]] = None
    """Encoding that maps special-token text to its id (transformers' default behaviour)."""
    folder: Optional[Path] = None
    """The folder the tokenizer was read from (an export copies its tokenizer files)."""


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table used by byte-level BPE vocabularies:
    printable Latin-1 bytes map to themselves, the other 68 bytes to U+0100 onwards, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise HFTokenizerError(f"cannot read {path}: {e}") from None


def ranks_from_tiktoken_file(path: Path) -> dict[bytes, int]:
    """Mergeable ranks of a tiktoken-format ``tokenizer.model`` (``base64 rank`` per line)."""
    ranks = {}
    try:
        lines = path.read_bytes().splitlines()
        for number, line in enumerate(lines, start=1):
            if line.strip():
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
    except (OSError, ValueError) as e:
        raise HFTokenizerError(
            f"{path} is not a tiktoken BPE file (expected 'base64-token rank' lines; line {number}: {e}); "
            "a SentencePiece tokenizer.model (Llama 1/2) is not supported"
        ) from None
    return ranks


def _merge_pair(merge) -> tuple[str, str]:
    return tuple(merge.split(" ", 1)) if isinstance(merge, str) else tuple(merge)


def ranks_from_tokenizer_json(data: dict, where: Path) -> tuple[dict[bytes, int], Optional[str]]:
    """(mergeable ranks, split pattern or None) of a byte-level BPE ``tokenizer.json``.

    Raises:
        HFTokenizerError: not a BPE model, a vocabulary entry that is not byte-level, or merges
            that are not in id order (tiktoken could not apply them in the same order).
    """
    model = data.get("model") or {}
    if model.get("type") != "BPE":
        raise HFTokenizerError(f"{where}: model type {model.get('type')!r}; only byte-level BPE is supported")
    decoder = {char: byte for byte, char in byte_to_unicode().items()}
    ranks = {}
    for text, token_id in model.get("vocab", {}).items():
        try:
            ranks[bytes(decoder[char] for char in text)] = int(token_id)
        except KeyError:
            raise HFTokenizerError(f"{where}: vocabulary entry {text!r} is not byte-level BPE") from None
    vocab = model.get("vocab", {})
    previous = -1
    for merge in model.get("merges", []):
        left, right = _merge_pair(merge)
        merged = vocab.get(left + right)
        if merged is None or merged < previous:
            raise HFTokenizerError(
                f"{where}: merge {left!r} + {right!r} is not in id order (token id {merged} after {previous}); "
                "tiktoken applies merges by token id, so this tokenizer cannot be loaded as tiktoken"
            )
        previous = merged
    return ranks, _split_pattern(data.get("pre_tokenizer"), where)


def _split_pattern(pre: Optional[dict], where: Path) -> Optional[str]:
    """The regex of a byte-level pre-tokenizer: a Split's pattern, or GPT-2's for ByteLevel(use_regex)."""
    if not pre:
        return None
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    for step in steps:
        if step.get("type") == "Split":
            pattern = step.get("pattern", {})
            if "Regex" not in pattern or step.get("behavior", "Isolated") != "Isolated" or step.get("invert"):
                raise HFTokenizerError(f"{where}: pre-tokenizer Split {step} is not an isolated regex split")
            return pattern["Regex"]
        if step.get("type") == "ByteLevel" and step.get("use_regex", True):
            return GPT2_PATTERN
    return None


def _special_tokens(folder: Path, tokenizer_json: Optional[dict]) -> dict[str, int]:
    config_path = folder / "tokenizer_config.json"
    specials: dict[str, int] = {}
    if config_path.is_file():
        for token_id, entry in (_read_json(config_path).get("added_tokens_decoder") or {}).items():
            specials[entry["content"]] = int(token_id)
    if not specials and tokenizer_json is not None:
        specials = {entry["content"]: int(entry["id"]) for entry in tokenizer_json.get("added_tokens", [])}
    return specials


def _named_id(config: dict, key: str, specials: dict[str, int]) -> Optional[int]:
    value = config.get(key)
    if isinstance(value, dict):
        value = value.get("content")
    return None if value is None else specials.get(value)


def is_hf_tokenizer_folder(path) -> bool:
    """Whether ``path`` is a folder holding ``tokenizer.json`` or a tiktoken ``tokenizer.model``."""
    folder = Path(path)
    return folder.is_dir() and any((folder / name).is_file() for name in ("tokenizer.json", *TIKTOKEN_FILES))


def load_hf_tokenizer(path, prefer: str = "tiktoken") -> HFTokenizer:
    """The tokenizer of a HF model folder as a tiktoken encoding (see the module docstring).

    Args:
        path: the model folder.
        prefer: "tiktoken" reads ``tokenizer.model`` (or ``original/tokenizer.model``) when there is
            one, "json" reads ``tokenizer.json`` when there is one.

    Raises:
        HFTokenizerError: no tokenizer file, an unreadable or unsupported one, a special token whose
            id collides with a BPE token, or no end-of-text token.
    """
    folder = Path(path)
    json_path = folder / "tokenizer.json"
    tiktoken_path = next((folder / name for name in TIKTOKEN_FILES if (folder / name).is_file()), None)
    tokenizer_json = _read_json(json_path) if json_path.is_file() else None
    if tiktoken_path is None and tokenizer_json is None:
        raise HFTokenizerError(f"{folder} holds no tokenizer.json and no tiktoken tokenizer.model "
                               f"(looked for {', '.join(('tokenizer.json', *TIKTOKEN_FILES))})")
    pattern = None if tokenizer_json is None else _split_pattern(tokenizer_json.get("pre_tokenizer"), json_path)
    if tiktoken_path is not None and (prefer == "tiktoken" or tokenizer_json is None):
        ranks, source = ranks_from_tiktoken_file(tiktoken_path), tiktoken_path
    else:
        (ranks, _), source = ranks_from_tokenizer_json(tokenizer_json, json_path), json_path
    pattern = pattern or LLAMA3_PATTERN
    specials = _special_tokens(folder, tokenizer_json)
    for text, token_id in specials.items():  # a special token the BPE vocabulary lists too is special only
        if ranks.get(text.encode()) == token_id:
            del ranks[text.encode()]
    collide = sorted(set(specials.values()) & set(ranks.values()))
    if collide:
        raise HFTokenizerError(f"{folder}: special token id(s) {collide[:5]} are also BPE token ids in {source}")
    config = _read_json(folder / "tokenizer_config.json") if (folder / "tokenizer_config.json").is_file() else {}
    eos = _named_id(config, "eos_token", specials)
    if eos is None:
        eos = specials.get("<|end_of_text|>")
    if eos is None:
        raise HFTokenizerError(f"{folder}: no end-of-text token (tokenizer_config.json eos_token, "
                               "or a special token <|end_of_text|>)")
    enc = tiktoken.Encoding(name=f"hf:{folder}", pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials)
    return HFTokenizer(
        name=f"hf:{folder.name}", n_vocab=enc.n_vocab, eos_id=eos, encode=enc.encode_ordinary, decode=enc.decode,
        bos_id=_named_id(config, "bos_token", specials), special_tokens=specials,
        encode_with_special=lambda text: enc.encode(text, allowed_special="all"),
        bpe=dict(pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials), folder=folder.resolve(),
    )
