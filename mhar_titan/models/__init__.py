"""Model zoo: baseline, single-head AttnRes and MHAR decoders (see args.py for the families).

The names below are exported lazily (`mhar_titan.lazy`), so importing `mhar_titan.models.args`
or `mhar_titan.models.plan` (the job config's checks do) imports neither torch nor the kernels.
"""
from __future__ import annotations

from mhar_titan.lazy import lazy_exports

_EXPORTS = {
    "FAMILIES": "args", "FLAVORS": "args", "ModelArgs": "args", "ParamCounts": "args", "count_parameters": "args",
    "pad_vocab": "args", "RoutingPlan": "plan", "BlockOutput": "router", "Transformer": "model",
    "TransformerBlock": "model", "AttentionContext": "model", "DepthRouting": "routing_params", "Router": "router",
    "BlockRouting": "router", "resolve_model_args": "args",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
