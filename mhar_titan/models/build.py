"""The ``ModelArgs`` a job trains: ``[model]`` flavor + overrides, sized for the tokenizer and sequence.

The trainer, the dry run and the job config's validation all resolve model arguments
here, so they agree on the defaults (``vocab_size``, ``max_seq_len``) and on which
``[model]`` key an error blames.
"""
from __future__ import annotations

from typing import Optional

from mhar_titan.config import ConfigError, Model
from mhar_titan.models.args import ModelArgs, pad_vocab


def _blamed_model_key(m: Model, overrides: dict) -> str:
    """Which ``[model]`` key makes ``ModelArgs`` fail: the first override (in config order)
    whose addition to the flavor breaks it; the flavor itself if nothing does alone."""
    try:
        ModelArgs.from_flavor(m.flavor)
    except (ValueError, TypeError):
        return f"'model.flavor' = {m.flavor!r}"
    applied = {}
    for key, value in overrides.items():
        applied[key] = value
        try:
            ModelArgs.from_flavor(m.flavor, **applied)
        except (ValueError, TypeError):
            return f"'model.{key}' = {value!r} (flavor {m.flavor!r})"
    return f"[model] flavor={m.flavor!r} overrides={m.overrides}"


def resolve_model_args(m: Model, seq_len: int, n_vocab: Optional[int] = None,
                       tokenizer: str = "") -> ModelArgs:
    """Flavor ``m.flavor`` with the ``[model]`` overrides ``m.overrides``, and the defaults
    ``vocab_size = pad_vocab(n_vocab)`` (a multiple of 128) and
    ``max_seq_len = max(flavor's, seq_len)`` unless the config sets them.

    Args:
        m: the ``[model]`` section.
        seq_len: ``training.seq_len`` (tokens per sequence).
        n_vocab: the tokenizer's vocabulary size (special tokens included); None checks
            the rest with the flavor's ``vocab_size`` (the config parser does, without a tokenizer).
        tokenizer: the tokenizer's name, for the error message.

    Raises:
        ConfigError: unknown flavor or field, arguments ``ModelArgs`` rejects, a vocab_size
            below ``n_vocab``, or ``seq_len`` above an explicit max_seq_len.
    """
    overrides = dict(m.overrides)
    try:
        if n_vocab is not None:
            overrides.setdefault("vocab_size", pad_vocab(n_vocab))
        overrides.setdefault("max_seq_len", max(ModelArgs.from_flavor(m.flavor).max_seq_len, seq_len))
        args = ModelArgs.from_flavor(m.flavor, **overrides)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{_blamed_model_key(m, overrides)}: {e}") from e
    if n_vocab is not None and args.vocab_size < n_vocab:
        raise ConfigError(
            f"'model.vocab_size' ({args.vocab_size}) is smaller than tokenizer {tokenizer!r} "
            f"({n_vocab} tokens); set --model.vocab_size to at least {n_vocab} (a multiple of 128 is faster) "
            "or leave it unset"
        )
    if seq_len > args.max_seq_len:
        raise ConfigError(
            f"'training.seq_len' ({seq_len}) exceeds 'model.max_seq_len' ({args.max_seq_len}); "
            f"lower it or set --model.max_seq_len={seq_len}"
        )
    return args
