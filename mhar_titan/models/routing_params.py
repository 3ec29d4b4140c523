"""The routing parameters of a model and what every routing site shares (lifetime: the model).

- `RoutingSettings`: what every site shares (kernel, heads H, eps, the permuted head layout).
- `DepthRouting`: all routing parameters of the model (pseudo-queries, key norms, gates, nulls,
  learned log-temperatures); registered as `Transformer.routing` for the attn_res connection.
- `parameter_rows` / `SiteRows`: every parameter's per-site and per-group rows, taken once per
  forward (`DepthRouting.rows`), as views with one backward node per parameter.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch
from torch import Tensor, nn

from mhar_kernels import reference

from .args import ModelArgs
from .plan import Group, RoutingPlan


@dataclass(frozen=True)
class RoutingSettings:
    """What every routing site of a model shares: the configured `kernel` (routing_kernel),
    `heads` (resolved H), `eps`, and for the permuted head layout the model `dim` and
    `permutation_seed` (None for contiguous heads)."""

    kernel: str
    heads: int
    eps: float
    dim: int = 0
    permutation_seed: int | None = None

    @classmethod
    def from_args(cls, args: ModelArgs) -> "RoutingSettings":
        seed = args.routing_head_layout_seed if args.routing_head_layout == "permuted" else None
        return cls(args.routing_kernel, args.resolved_routing_heads, args.routing_eps, args.dim, seed)

    @property
    def permutation(self) -> Tensor | None:
        """The permuted head layout's int64 (d,) permutation (`reference.head_permutation`, on the
        CPU, made once per process), None for contiguous heads."""
        return None if self.permutation_seed is None else reference.head_permutation(self.dim, self.permutation_seed)


class SiteRows(NamedTuple):
    """Every routing parameter's rows for one forward (`DepthRouting.rows`), all views.

    query, key_norm: S rows (d,), by site. alpha: S rows (1,) in delta mode, else None.
    group_query, group_key_norm: {group index: its (g, d) rows} for the groups of more than one
    site (grouped routing), empty for per-call routing."""

    query: tuple[Tensor, ...]
    key_norm: tuple[Tensor, ...]
    alpha: tuple[Tensor, ...] | None
    group_query: dict[int, Tensor]
    group_key_norm: dict[int, Tensor]


def parameter_rows(parameter: Tensor, groups: Sequence[Group]) -> tuple[tuple[Tensor, ...], dict[int, Tensor]]:
    """The rows of an (S, ...) routing parameter as views: per site its row (S rows of shape
    (...)), and {group index: its (g, ...) rows} for every group of more than one site.

    Per-call routing unbinds the parameter once (one backward node, which stacks the S row
    gradients into one (S, ...) gradient); grouped routing splits it once by group and unbinds
    each group's rows (one node per group besides). Indexing a row per site instead gives each
    site a backward that writes a zero-filled (S, ...) tensor, and autograd one (S, ...) addition
    per site."""
    if len(groups) == parameter.shape[0]:  # the groups cover the S sites: S groups are S single sites
        return parameter.unbind(0), {}
    chunks = parameter.split([group.size for group in groups])
    rows = tuple(row for chunk in chunks for row in chunk.unbind(0))
    return rows, {group.index: chunk for group, chunk in zip(groups, chunks) if group.size > 1}


class DepthRouting(nn.Module):
    """All routing parameters of the model (MHAR_SPEC section 2; DESIGN.md "Placement").

    query (S, d): pseudo-queries, row 2i / 2i+1 = layer i's attention / MLP site, row 2L = final.
    key_norm (S, d): key RMSNorm weights. alpha (S, 1): delta gates (delta mode only; shape (1,)
    per site because FSDP rejects 0-dim parameters). null_source: when enabled, (d,), or (2L, d)
    in the paper layout (row k = the null of site k; plan.py). log_temperature (S, H): with
    `routing_temperature = "learned"` only, one learnable log-temperature per site and routing
    head, initialised to log(routing_logit_scale); None otherwise.

    Logit scale and temperature (docs/DESIGN.md "Logit scale and temperature", which also says
    why Adam does not absorb a fixed scale): every depth logit of site s and head h is
    t_{s,h} <q_s[h], RMSNorm(k)[h]>, t the fixed `routing_logit_scale` or, learned,
    exp(log_temperature[s, h]). The factor is folded into the query once per forward,
    q_eff[s, h] = t_{s,h} q_s[h] (`effective_queries`, the ONE accessor of a site's effective
    pseudo-query), so every routing path runs unchanged on q_eff; at scale 1 with a fixed
    temperature the raw parameter itself is used (bitwise the unscaled model). Gradients through
    the fold: dL/dq_s[h] = t_{s,h} dL/dq_eff[h], dL/dlog t_{s,h} = <dL/dq_eff[h], q_eff[h]>.
    """

    def __init__(self, args: ModelArgs, plan: RoutingPlan | None = None):
        super().__init__()
        plan = plan or RoutingPlan.from_args(args)
        S, d, nulls = plan.n_sites, args.dim, plan.n_nulls
        self.query = nn.Parameter(torch.empty(S, d))
        self.key_norm = nn.Parameter(torch.empty(S, d))
        self.alpha = nn.Parameter(torch.empty(S, 1)) if args.routing_mode == "delta" else None
        self.null_source = nn.Parameter(torch.empty((nulls, d) if nulls > 1 else (d,))) if nulls else None
        self.logit_scale = args.resolved_logit_scale  # c, a float (args.logit_scale)
        self.heads = args.resolved_routing_heads
        self.settings = RoutingSettings.from_args(args)
        learned = args.routing_temperature == "learned"
        self.log_temperature = nn.Parameter(torch.empty(S, self.heads)) if learned else None

    def reset_parameters(self) -> None:
        """Pseudo-queries exactly 0 (uniform depth softmax, MHAR_SPEC pitfall 2), key norms 1, gates 0, null 0,
        log-temperatures log(routing_logit_scale) (the learned temperature starts at the fixed scale)."""
        nn.init.zeros_(self.query)
        nn.init.ones_(self.key_norm)
        if self.alpha is not None:
            nn.init.zeros_(self.alpha)
        if self.null_source is not None:
            nn.init.zeros_(self.null_source)
        if self.log_temperature is not None:
            nn.init.constant_(self.log_temperature, math.log(self.logit_scale))

    def null_sources(self) -> list[Tensor]:
        """The (d,) null sources in the order of the plan's null entries (empty when disabled)."""
        if self.null_source is None:
            return []
        return [self.null_source] if self.null_source.dim() == 1 else list(self.null_source.unbind(0))

    @property
    def learned(self) -> bool:
        """Whether the temperatures are learned (`routing_temperature = "learned"`)."""
        return self.log_temperature is not None

    @property
    def scaled(self) -> bool:
        """Whether the effective pseudo-queries differ from the raw ones (a scale other than 1, or
        a learned temperature)."""
        return self.log_temperature is not None or self.logit_scale != 1.0

    def temperatures(self) -> Tensor:
        """(S, H) factors t_{s,h} every depth logit of site s, head h is multiplied by (class
        docstring): exp(log_temperature), or the fixed scale; in the query's dtype, on its device."""
        if self.log_temperature is not None:
            return self.log_temperature.exp().to(self.query.dtype)
        return torch.full((self.query.shape[0], self.heads), self.logit_scale, dtype=self.query.dtype,
                          device=self.query.device)

    def effective_queries(self) -> Tensor:
        """(S, d) effective pseudo-queries q_eff[s, h] = t_{s,h} q_s[h], head h being the layout's
        coordinates of head h (contiguous slices, or the permuted layout's): the one accessor every
        reader of a site's query uses (class docstring). Differentiable; the raw parameter itself
        at scale 1 with a fixed temperature."""
        if not self.scaled:
            return self.query
        if self.log_temperature is None:
            return self.query * self.logit_scale
        S, d = self.query.shape
        t = self.log_temperature.exp().to(self.query.dtype).unsqueeze(-1)  # (S, H, 1)
        permutation = self.settings.permutation
        if permutation is None:
            return (self.query.view(S, self.heads, -1) * t).view(S, d)
        perm = permutation.to(self.query.device)  # head h owns coordinates perm[h K:(h + 1) K]
        scaled = (self.query.index_select(1, perm).view(S, self.heads, -1) * t).view(S, d)
        return scaled.index_select(1, torch.argsort(perm))

    def effective_query(self, site: int) -> Tensor:
        """(d,) effective pseudo-query of `site` (`effective_queries`' row)."""
        return self.effective_queries()[site]

    def rows(self, groups: Sequence[Group]) -> SiteRows:
        """Every parameter's per-site and per-group rows for one forward (`parameter_rows`), taken
        once per forward (under FSDP2 from the unsharded parameters), for the plan's `groups`; the
        query rows are the effective pseudo-queries (`effective_queries`, folded once here)."""
        query, group_query = parameter_rows(self.effective_queries(), groups)
        key_norm, group_key_norm = parameter_rows(self.key_norm, groups)
        alpha = None if self.alpha is None else self.alpha.unbind(0)
        return SiteRows(query, key_norm, alpha, group_query, group_key_norm)
