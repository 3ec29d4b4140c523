"""Model zoo: baseline, single-head AttnRes and MHAR decoders (see args.py for the families)."""
from .args import FAMILIES, FLAVORS, ModelArgs, ParamCounts, count_parameters, pad_vocab
from .model import BlockOutput, DepthRouting, Transformer, TransformerBlock
from .plan import RoutingPlan
from .routing import route, route_reference, routing_logits

__all__ = [
    "FAMILIES", "FLAVORS", "ModelArgs", "ParamCounts", "count_parameters", "pad_vocab",
    "BlockOutput", "DepthRouting", "Transformer", "TransformerBlock", "RoutingPlan",
    "route", "route_reference", "routing_logits",
]
