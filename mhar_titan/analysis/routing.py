"""Depth-routing statistics read from a model's own forward (MHAR_SPEC sections 1.1 and 2).

For routing site s with N_s sources and H routing heads, the depth-softmax weights
a[n, b, t, h] (``route_reference(..., return_weights=True)``) are reduced over the tokens:

* mean weight ``W_s[h, n] = mean_{b,t} a[n, b, t, h]``; the single-head view is the mean over
  heads, ``mean_h W_s[h, n]``: the share of the routed output's dimensions that comes from
  source n (each head mixes d/H of the d dimensions);
* entropy ``E_s = mean_{b,t,h} -sum_n a[n,b,t,h] log a[n,b,t,h]`` in nats (log N_s when uniform);
* effective number of sources ``exp(E_s)`` (N_s when uniform, 1 when one source takes all).

``RoutingRecorder`` is an observer of the model's routing (``Transformer.observe_routing``): the
model's Router hands it each site's source list in order, and the recorder takes that site's
weights from the Router (the reference implementation, ``route_reference(...,
return_weights=True)``) and reduces them at once, while the forward runs. Under FSDP that is
where the root's parameters are unsharded anyway, so the training metric ``routing_entropy``
needs no explicit unshard.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Optional, Sequence

import torch
from torch import Tensor

from mhar_titan.progress import progress


@dataclasses.dataclass
class SiteStats:
    """Running sums of one routing site over the tokens seen (float64)."""

    weight_sum: Tensor
    """(H, N): sum over tokens of the depth-softmax weights."""
    entropy_sum: Tensor
    """(H,): sum over tokens of the per-token entropy (nats)."""
    tokens: int = 0

    @property
    def n_sources(self) -> int:
        return self.weight_sum.shape[1]

    @property
    def mean_weights(self) -> Tensor:
        """(H, N) mean routing weight of each head over each source."""
        return self.weight_sum / self.tokens

    @property
    def entropy(self) -> float:
        """Mean entropy over tokens and heads (nats)."""
        return float(self.entropy_sum.sum()) / (self.tokens * self.entropy_sum.numel())

    @property
    def effective_sources(self) -> float:
        """exp(entropy): N when routing is uniform, 1 when one source takes all the weight."""
        return math.exp(self.entropy)


def token_entropy(weights: Tensor) -> Tensor:
    """Entropy (nats) over the depth axis of weights (N, ...) -> (...); 0 log 0 = 0."""
    return -(weights * weights.clamp_min(torch.finfo(weights.dtype).tiny).log()).sum(0)


class RoutingRecorder:
    """An observer of the model's routing that reduces every site's weights as the forward goes.

    Args:
        model: a ``Transformer`` with ``residual = "attn_res"`` (plain or FSDP-wrapped).
        keep_weights: also keep every site's per-token weights (N, B, T, H) of the LAST forward
            in ``weights`` (for tests and small inputs).

    One forward appends ``n_routing_sites`` source lists; further forwards (more batches)
    accumulate into the same sums.

    Raises:
        ValueError: the model has no routing sites (the baseline).
    """

    def __init__(self, model: torch.nn.Module, keep_weights: bool = False):
        if getattr(model, "routing", None) is None:
            raise ValueError("the model has no depth routing (residual = 'standard'): nothing to record")
        self.plan = model.plan
        self.heads, self.n_sites = model.args.resolved_routing_heads, self.plan.n_sites
        self.sites: list[Optional[SiteStats]] = [None] * self.n_sites
        self.keep_weights = keep_weights
        self.weights: list[Optional[Tensor]] = [None] * self.n_sites
        self._calls = 0

    @torch.no_grad()
    def __call__(self, index: int, sources: Sequence[Tensor], router) -> None:
        """Reduce site ``index``'s weights over ``sources`` (its source list, in routing order),
        read from ``router.weights`` (the model's ``router.Router``)."""
        if index != self._calls % self.n_sites:
            raise RuntimeError(f"routing site {index} observed where site {self._calls % self.n_sites} was expected")
        self._calls += 1
        weights = router.weights(index, sources)
        token_dims = tuple(range(1, weights.dim() - 1))
        w_sum = weights.double().sum(token_dims).T  # (H, N)
        e_sum = token_entropy(weights).double().sum(tuple(d - 1 for d in token_dims))  # (H,)
        n_tokens = weights[0, ..., 0].numel()
        site = self.sites[index]
        if site is None:
            self.sites[index] = SiteStats(w_sum.cpu(), e_sum.cpu(), n_tokens)
        else:
            site.weight_sum += w_sum.cpu()
            site.entropy_sum += e_sum.cpu()
            site.tokens += n_tokens
        if self.keep_weights:
            self.weights[index] = weights

    def __len__(self) -> int:
        return self._calls

    def summary(self) -> "RoutingSummary":
        """The reduced statistics.

        Raises:
            RuntimeError: no complete forward has been recorded.
        """
        if self._calls == 0 or self._calls % self.n_sites or any(s is None for s in self.sites):
            raise RuntimeError(f"recorded {self._calls} routing sites, not a whole number of forwards of "
                               f"{self.n_sites} sites: run the model's forward within model.observe_routing(recorder)")
        return RoutingSummary(sites=list(self.sites), heads=self.heads, plan=self.plan)


@dataclasses.dataclass
class RoutingSummary:
    """Per-site routing statistics of one model over some tokens (see the module docstring).

    With the model's routing ``plan`` (``mhar_titan.models.plan.RoutingPlan``), columns are the
    entries of the model's source list (embedding, a_0, m_0, ... or block sums), so one column is
    one source across sites; without it, column n is each site's n-th source.
    """

    sites: list[SiteStats]
    heads: int
    plan: object = None

    def columns(self) -> list[int]:
        """Source-list entries read by at least one site (with a plan), else 0 .. N_max - 1."""
        if self.plan is None:
            return list(range(max(site.n_sources for site in self.sites)))
        return sorted({j for site in self.plan.sites for j in site.reads})

    def column_labels(self) -> list[str]:
        """Short names of the columns: null, emb, a0 / m0 (sublayer outputs), b1~m0 (the partial
        sum of block 1 after m0); without a plan, the source position."""
        if self.plan is None:
            return [str(n) for n in self.columns()]
        labels = []
        for j in self.columns():
            entry = self.plan.sources[j]
            if entry.kind in ("null", "embedding"):
                labels.append("null" if entry.kind == "null" else "emb")
                continue
            site = self.plan.sites[entry.site]
            name = f"{'a' if site.sublayer == 'attention' else 'm'}{site.layer}"
            labels.append(name if entry.kind == "output" else f"b{site.block}~{name}")
        return labels

    def site_source_labels(self, site: int) -> list[str]:
        """Labels (as ``column_labels``) of the sources one site reads, in its routing order."""
        by_column = dict(zip(self.columns(), self.column_labels()))
        reads = self.plan.sites[site].reads if self.plan is not None else range(self.sites[site].n_sources)
        return [by_column[j] for j in reads]

    def mean_weights(self) -> Tensor:
        """(H, S, C) float64: head h, site s, column c (``columns``); NaN where site s does not
        read that column's source."""
        columns = self.columns()
        out = torch.full((self.heads, len(self.sites), len(columns)), float("nan"), dtype=torch.float64)
        for s, site in enumerate(self.sites):
            reads = self.plan.sites[s].reads if self.plan is not None else range(site.n_sources)
            out[:, s, [columns.index(j) for j in reads]] = site.mean_weights
        return out

    def head_mean_weights(self) -> Tensor:
        """(S, C): the single-head view, mean over heads (NaN where not read)."""
        return self.mean_weights().mean(0)

    def entropy(self) -> list[float]:
        """Per-site mean entropy (nats)."""
        return [site.entropy for site in self.sites]

    def effective_sources(self) -> list[float]:
        """Per-site exp(entropy)."""
        return [site.effective_sources for site in self.sites]

    def mean_entropy(self) -> float:
        """Mean over sites of the per-site entropy (the trainer's ``routing_entropy`` metric)."""
        return sum(self.entropy()) / len(self.sites)

    def to_dict(self) -> dict:
        return {
            "heads": self.heads,
            "tokens": self.sites[0].tokens,
            "mean_entropy": self.mean_entropy(),
            "sites": [
                {"site": s, "n_sources": site.n_sources, "entropy": site.entropy,
                 "effective_sources": site.effective_sources, "mean_weights": site.mean_weights.tolist()}
                for s, site in enumerate(self.sites)
            ],
        }


def site_names(n_sites: int) -> list[str]:
    """Names of the routing sites in order: layer i's attention and MLP sites, then the final one."""
    return [f"L{i // 2}.{'attn' if i % 2 == 0 else 'mlp'}" for i in range(n_sites - 1)] + ["final"]


@torch.no_grad()
def routing_summary(model: torch.nn.Module, batches: Iterable[Tensor], desc: str = "routing") -> RoutingSummary:
    """Routing statistics of a plain (unsharded) model over token batches, each (B, T) int64.

    Raises:
        ValueError: the model has no routing; no batches.
    """
    recorder = RoutingRecorder(model)
    device = next(model.parameters()).device
    total = len(batches) if hasattr(batches, "__len__") else None
    for tokens in progress(batches, total=total, desc=desc, unit="batch"):
        with model.observe_routing(recorder):
            model.hidden_states(tokens.to(device))
    if len(recorder) == 0:
        raise ValueError("no batches to record routing over")
    return recorder.summary()


@torch.no_grad()
def routing_entropy(model: torch.nn.Module, tokens: Tensor) -> Optional[float]:
    """Mean depth-softmax entropy (nats) over sites, heads and tokens; None for the baseline and the
    connections other than depth routing (they have no depth softmax).

    Runs the model's own forward (within ``model.observe_routing``), so an FSDP-sharded model
    gathers its parameters as in any forward; the per-block compiled graphs are bypassed
    (eager) so that this no-grad call does not compile a second set. Uniform routing over N
    sources at every site gives mean_s log N_s.
    """
    if getattr(model, "routing", None) is None or model.args.residual != "attn_res":
        return None
    recorder = RoutingRecorder(model)
    with torch.compiler.set_stance("force_eager"), model.observe_routing(recorder):
        model(tokens)
    return recorder.summary().mean_entropy()
