"""Conversion of a ``standard`` decoder to delta-MHAR (MHAR_SPEC section 1.4, 8B recipe 3.4).

The converted model keeps the residual stream and adds, at every sublayer input,
``alpha * route(sources)``: H = 8 routing heads, blocks of 4 layers, null sources, gates 0,
pseudo-queries 0 (key norms 1). With every gate exactly 0 the converted model computes the same
logits as the original, bit for bit in fp32, whatever the layout; training moves the gates
first (d loss / d alpha = <d loss / d h, mix> is not 0), then the pseudo-queries.

Layouts (``routing_layout``, plan.py): "paper" reproduces the authors' bookkeeping (the 8B
recipe uses it; routing eps = the model's norm eps), "clean" is this repository's.
"""
from __future__ import annotations

import dataclasses

import torch

from mhar_titan.models.args import ModelArgs
from mhar_titan.models.model import Transformer

from .hf_config import ConversionError

DELTA_MHAR = dict(residual="attn_res", routing_mode="delta", routing_granularity="block", routing_block_layers=4,
                  routing_heads=8, routing_null_source=True)
"""The paper's conversion (MHAR_SPEC 3.4: `delta_mh`, H = 8, one source per block of 4 layers)."""


def delta_fields(args: ModelArgs, layout: str = "paper", **fields) -> dict:
    """The ModelArgs fields that turn ``args`` (a standard decoder) into its delta-MHAR
    conversion in ``layout``; ``fields`` override the defaults of ``DELTA_MHAR``."""
    out = {**DELTA_MHAR, "routing_layout": layout}
    if layout == "paper":
        out["routing_eps"] = args.norm_eps
    return {**out, **fields}


def delta_args(args: ModelArgs, layout: str = "paper", **fields) -> ModelArgs:
    """``args`` converted (see ``delta_fields``). Raises ConversionError for a model that is
    not a standard decoder or fields ModelArgs rejects (e.g. a width not divisible by H)."""
    if args.residual != "standard":
        raise ConversionError(f"only a standard decoder can be converted to delta-MHAR, got residual={args.residual!r}")
    try:
        return dataclasses.replace(args, **delta_fields(args, layout, **fields))
    except ValueError as e:
        raise ConversionError(f"cannot convert to delta-MHAR: {e}") from None


@torch.no_grad()
def convert_to_delta(model: Transformer, layout: str = "paper", **fields) -> Transformer:
    """A delta-MHAR model that shares ``model``'s weight tensors (no copy: the original must not
    be trained afterwards) with fresh routing parameters at the identity init."""
    args = delta_args(model.args, layout, **fields)
    with torch.device("meta"):
        converted = Transformer(args)
    device = model.tok_embeddings.weight.device
    converted.load_state_dict(model.state_dict(), strict=False, assign=True)
    converted.routing.to_empty(device=device)
    converted.routing.to(model.tok_embeddings.weight.dtype)
    converted.routing.reset_parameters()
    converted.rope_cos, converted.rope_sin = model.rope_cos, model.rope_sin
    return converted
