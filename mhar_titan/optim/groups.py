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
quantity the temperature-matched experiments compare. ``never_decayed_names(model)`` adds every
parameter of a connection whose parameter module (``model.routing``) says ``weight_decay = False``
(its reference does not decay them, or was not shown to: docs/CONNECTIONS.md): MUDDFormer's,
and Hyper-Connections' and mHC's, as in the MHAR authors' harness (``hcfactory/train.py``): decay
pulls the mixing back towards no mixing, and Hyper-Connections' static alpha and beta, which
start at the identity and 1, towards 0.
DenseFormer's weights follow ``optimizer.no_decay`` like depth routing's: its reference decays them
(they are ``nn.Linear`` weights in its decayed set). The routing group is never Muon's either
(``optimizer_split``), so no connection parameter is ever orthogonalised.

``grad_norm_group``: the pseudo-queries and delta gates of depth routing (a model whose routing
plan has sites) get groups of their own; every other parameter, the other connections' included,
is ``rest`` (DenseFormer's weights are also named ``alpha``, but they are no gate).
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


def never_decayed(clean: str) -> bool:
    """Whether the parameter of clean name ``clean`` is exempt from weight decay (``NEVER_DECAYED``)."""
    return clean in NEVER_DECAYED


def never_decayed_names(model: nn.Module) -> set[str]:
    """Clean names of ``model``'s parameters that no weight decay touches: ``NEVER_DECAYED`` and
    every parameter of a connection module that declares ``weight_decay = False`` (module docstring)."""
    names = {clean_name(n) for n, _ in model.named_parameters() if never_decayed(clean_name(n))}
    routing = getattr(model, "routing", None)
    if routing is not None and getattr(routing, "weight_decay", True) is False:
        names |= {clean_name(f"routing.{n}") for n, _ in routing.named_parameters()}
    return names


GRAD_NORM_GROUPS = ("routing_query", "routing_gate", "rest")


def grad_norm_group(clean: str, routed: bool = True) -> str:
    """Logging group of a parameter: depth routing's pseudo-queries, its delta gates (alpha), or the
    rest; ``routed``: the model routes (its routing plan has sites), else every parameter is rest."""
    if routed and clean.startswith("routing."):
        leaf = clean.rsplit(".", 1)[-1]
        if "query" in clean:
            return "routing_query"
        if leaf == "alpha" or ".alpha" in clean:
            return "routing_gate"
    return "rest"
