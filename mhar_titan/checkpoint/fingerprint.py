"""The run's fingerprint: what must match between a checkpoint and the run resuming it.

``checkpoint_fingerprint`` builds it (the model arguments that shape or define the
weights, and the tokenizer); ``CheckpointManager`` records it in ``complete.json`` and
``check_fingerprint`` compares it on every load, before any tensor is read.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from mhar_titan.config.checkpoint import CheckpointMismatchError
from mhar_titan.models.args import WEIGHT_NEUTRAL_FIELDS

LEGACY_MODEL_DEFAULTS = {"routing_layout": "clean", "routing_head_layout": "contiguous", "routing_head_layout_seed": 0,
                         "attn_mask_type": "causal", "rope_per_document": False, "eos_id": None,
                         "routing_logit_scale": 1.0, "routing_temperature": "fixed",
                         "dense_dilation": 1, "dense_period": 1, "mudd_prepost_norm": True}
"""Fields of ``ModelArgs`` added after checkpoints existed, with the value that gives the older
models: left out of the fingerprint at that value, so those checkpoints still resume."""


def checkpoint_fingerprint(model_args, tokenizer_name: str) -> dict:
    """What must match between a checkpoint and the run resuming it: the fields of
    ``model_args`` (a ``ModelArgs``) that shape or define the weights (not
    ``WEIGHT_NEUTRAL_FIELDS``, nor ``LEGACY_MODEL_DEFAULTS`` fields at their legacy value)
    and the tokenizer name. ``routing_logit_scale`` is recorded as the scale it resolves to
    (``ModelArgs.resolved_logit_scale``)."""
    fields = dataclasses.asdict(model_args)
    # the scale a setting means, not its spelling: "match_heads:1", 1 and 1.0 are one model
    fields["routing_logit_scale"] = model_args.resolved_logit_scale
    args = {k: v for k, v in fields.items()
            if k not in WEIGHT_NEUTRAL_FIELDS and not (k in LEGACY_MODEL_DEFAULTS and v == LEGACY_MODEL_DEFAULTS[k])}
    return {"model_args": args, "tokenizer": tokenizer_name}


def flatten_plain(tree: Any, prefix: str = "") -> dict:
    """Nested dict -> ``{"a.b": leaf}`` (used for fingerprints)."""
    if isinstance(tree, dict):
        out = {}
        for key in sorted(tree, key=str):
            out.update(flatten_plain(tree[key], f"{prefix}{key}."))
        return out
    return {prefix[:-1]: tree}


def json_safe(tree: Any) -> Any:
    """Fingerprints go into JSON: tuples become lists, unknown objects their ``repr``."""
    if isinstance(tree, dict):
        return {str(k): json_safe(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [json_safe(v) for v in tree]
    if tree is None or isinstance(tree, (bool, int, float, str)):
        return tree
    return repr(tree)


def check_fingerprint(path: Path, saved: dict, current: dict) -> None:
    """Raise ``CheckpointMismatchError`` listing the settings that differ (up to 8)."""
    saved, current = flatten_plain(saved), flatten_plain(current)
    diffs = [
        f"{key}: checkpoint {saved.get(key, '<unset>')!r}, this run {current.get(key, '<unset>')!r}"
        for key in sorted(set(saved) | set(current))
        if saved.get(key, "<unset>") != current.get(key, "<unset>")
    ]
    if diffs:
        raise CheckpointMismatchError(
            f"checkpoint {path} was made with different settings ({len(diffs)} differ), e.g.\n  "
            + "\n  ".join(diffs[:8])
            + "\nNothing was loaded. Use the original settings, a new run folder (job.name), or "
            "checkpoint.initial_load_path with a matching model."
        )
