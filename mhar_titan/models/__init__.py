"""Model zoo: baseline, single-head AttnRes and MHAR decoders (see args.py for the families)."""
from .args import FLAVORS, ModelArgs, ParamCounts, count_parameters, pad_vocab
from .model import DepthRouting, Transformer, TransformerBlock, routing_entropy
from .routing import route, route_reference, routing_logits

__all__ = [
    "FLAVORS", "ModelArgs", "ParamCounts", "count_parameters", "pad_vocab",
    "DepthRouting", "Transformer", "TransformerBlock", "routing_entropy",
    "route", "route_reference", "routing_logits",
]
