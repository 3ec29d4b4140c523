"""Parameter groups: which group each parameter belongs to (the optimizers' weight decay and Muon
split read them) and the groups the gradient norms are logged by.

``param_group_of`` groups: ``routing`` (everything under the top-level ``model.routing`` module:
pseudo-queries, key norms, gates, null source), ``embeddings`` (``tok_embeddings``), ``norms``
(RMSNorm/LayerNorm weights), ``biases``, ``head`` (the untied LM head ``output``) and ``other``
(the hidden matrices). ``grad_norm_group``: ``routing_query``, ``routing_gate``, ``rest``.

``never_decayed``: parameters that no weight decay touches whatever ``optimizer.no_decay`` says:
the learned routing log-temperatures (``routing.log_temperature``, in the ``routing`` group).
Decay would pull log t towards 0, i.e. the temperature towards 1, not towards its configured
start (``model.routing_logit_scale``): a bias toward one particular temperature, the very
quantity the temperature-matched experiments compare. Also every parameter of Hyper-Connections
and mHC (their parameters module says ``decayed = False``), as in the MHAR authors' harness
(``hcfactory/train.py``): decay pulls the mixing back towards no mixing, and Hyper-Connections'
static alpha and beta, which start at the identity and 1, towards 0. The routing group is never Muon's either
(``optimizer_split``), so it is never orthogonalised.
"""
from __future__ import annotations

from torch import nn

from mhar_titan.config import PARAM_GROUPS

# Wrappers that insert a path component into parameter names.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def clean_name(name: str) -> str:
    """Parameter name without the components added by checkpoint_wrapper / torch.compile."""
    for p in _WRAPPER_PREFIXES:
        name = name.replace(p, "")
    return name


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, (nn.RMSNorm, nn.LayerNorm)) or type(module).__name__.endswith("Norm")


def param_group_of(model: nn.Module) -> dict[str, str]:
    """Map every parameter's clean name to one of ``PARAM_GROUPS``.

    Routing wins over the other groups (the routing key norms belong to ``routing``).
    """
    norm_params = set()
    for mname, module in model.named_modules():
        if _is_norm(module):
            for pname, _ in module.named_parameters(recurse=False):
                norm_params.add(clean_name(f"{mname}.{pname}" if mname else pname))
    groups = {}
    for name, _ in model.named_parameters():
        n = clean_name(name)
        if n.startswith("routing."):
            groups[n] = "routing"
        elif n.startswith("tok_embeddings."):
            groups[n] = "embeddings"
        elif n in norm_params:
            groups[n] = "norms"
        elif n.endswith(".bias"):
            groups[n] = "biases"
        elif n.startswith("output."):
            groups[n] = "head"
        else:
            groups[n] = "other"
    assert set(groups.values()) <= set(PARAM_GROUPS)
    return groups


NEVER_DECAYED = ("routing.log_temperature",)
"""Clean names of the parameters that are never weight-decayed (module docstring)."""


def never_decayed(model: nn.Module) -> set[str]:
    """Clean names of ``model``'s parameters exempt from weight decay: ``NEVER_DECAYED``, and every
    parameter of a depth connection whose parameters module (``model.routing``) sets ``decayed =
    False`` (Hyper-Connections' and mHC's: module docstring)."""
    names = {clean_name(n) for n, _ in model.named_parameters() if clean_name(n) in NEVER_DECAYED}
    routing = getattr(model, "routing", None)
    if routing is not None and not getattr(routing, "decayed", True):
        names |= {f"routing.{clean_name(n)}" for n, _ in routing.named_parameters()}
    return names


GRAD_NORM_GROUPS = ("routing_query", "routing_gate", "rest")


def grad_norm_group(clean: str) -> str:
    """Logging group of a parameter: routing pseudo-queries, delta gates (alpha), or the rest."""
    if clean.startswith("routing."):
        leaf = clean.rsplit(".", 1)[-1]
        if "query" in clean:
            return "routing_query"
        if leaf == "alpha" or ".alpha" in clean:
            return "routing_gate"
    return "rest"
