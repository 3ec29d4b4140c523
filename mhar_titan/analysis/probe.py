"""The query probe: do the slices of a single-head pseudo-query agree on where to read?

MHAR_SPEC section 3.3 (the paper's mechanism probe; "subspace discrepancy grows with width").
For one routing site of a single-head (H = 1) model with pseudo-query q (d,), key-norm
weight g and sources s_1..s_N, on one token:

* keys ``khat_n = RMSNorm_g(s_n)`` exactly as the routing computes them (RMS over the full d);
* q is the site's effective pseudo-query (``DepthRouting.effective_queries``: its
  ``routing_logit_scale`` or learned temperature t folded in, q = t q_raw), so the logits below
  are the effective logits the forward's depth softmax reads;
* full logits ``z_n = <q, khat_n>`` and the site's distribution ``p = softmax_n(z)``;
* split q (and every key) into S contiguous slices of d/S dims; slice j alone gives the
  partial logits ``z_{j,n} = <q[j], khat_n[j]>``, with ``sum_j z_{j,n} = z_n``. These are the
  logits an H = S multi-head router would compute with the same parameters
  (``routing_logits(..., heads=S)``);
* slice j's own distribution is ``p_j = softmax_n(S * z_{j,n})``; when all slices agree
  (``z_{j,n} = z_n / S`` for every j) it equals p;
* the discrepancy of slice j is ``KL(p || p_j) = sum_n p_n (log p_n - log p_{j,n})`` (nats).

The probe reports the mean of KL(p || p_j) over sites, slices and tokens ("raw KL"), the same
mean for random queries of equal norm (per site ``r = |q| x u / |u|`` with u ~ N(0, I_d) from
a seeded generator, averaged over several draws: the "random reference"), and their
difference, the learned-excess KL. Sites with a single source have no choice and are skipped.
The random queries have the effective query's norm, so the reference runs at the same temperature.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

import torch
from torch import Tensor

from mhar_kernels.reference import routing_logits
from mhar_titan.progress import progress


def slice_kl(sources: Sequence[Tensor], query: Tensor, norm_weight: Tensor, slices: int = 4,
             eps: float = 1e-6) -> Tensor:
    """KL(p || p_j) per token and slice (see the module docstring): (..., S) for sources (..., d).

    Computed in the routing's compute dtype (float32, or float64 for float64 sources).

    Raises:
        ValueError: d is not divisible by ``slices``, or the routing arguments are invalid
            (as ``routing_logits``).
    """
    d = query.shape[-1]
    if slices < 1 or d % slices:
        raise ValueError(f"the probe splits the query into {slices} contiguous slices, so d={d} must be a "
                         f"multiple of slices; pick slices among the divisors of {d}")
    full = routing_logits(sources, query, norm_weight, 1, eps)  # (N, ..., 1)
    parts = routing_logits(sources, query, norm_weight, slices, eps)  # (N, ..., S)
    log_p = torch.log_softmax(full, dim=0)
    log_pj = torch.log_softmax(slices * parts, dim=0)
    return (log_p.exp() * (log_p - log_pj)).sum(0)


def random_query_like(query: Tensor, generator: torch.Generator) -> Tensor:
    """A random direction with the norm of ``query`` (same dtype and device)."""
    u = torch.randn(query.shape, generator=generator, dtype=torch.float64).to(query.device)
    return (u / u.norm() * query.double().norm()).to(query.dtype)


@dataclasses.dataclass(frozen=True)
class ProbeResult:
    """Means over sites (with >= 2 sources), slices and tokens, in nats."""

    raw_kl: float
    random_kl: float
    """The same mean for random queries of equal norm, averaged over ``draws``."""
    slices: int
    draws: int
    sites: int
    tokens: int
    per_site: tuple = ()
    """(site index, learned KL, random-query KL) per probed site: means over its slices and tokens."""
    site_draws: tuple = ()
    """Per probed site (the order of ``per_site``), the random-query KL of each draw (``draws``
    values, means over the site's slices and tokens): the spread of the reference."""
    random_draws: tuple = ()
    """The random-query mean KL of each draw over all probed sites (``draws`` values; their
    mean is ``random_kl``)."""

    @property
    def excess_kl(self) -> float:
        """raw - random: the learned-excess KL."""
        return self.raw_kl - self.random_kl

    def report(self, heading: str) -> str:
        """A short Markdown report: the three means and the range of the random draws."""
        low, high = (min(self.random_draws), max(self.random_draws)) if self.random_draws else (float("nan"),) * 2
        return (f"# {heading}\n\nQuery probe (MHAR_SPEC 3.3), S = {self.slices} slices, {self.sites} sites, "
                f"{self.tokens} tokens, random reference over {self.draws} draws.\n\n"
                "| raw KL (nats) | random-query KL | random draws (min to max) | learned-excess KL |\n"
                "|---:|---:|---:|---:|\n"
                f"| {self.raw_kl:.4f} | {self.random_kl:.4f} | {low:.4f} to {high:.4f} | {self.excess_kl:.4f} |\n")


class ProbeTrace:
    """An observer of the model's routing (``Transformer.observe_routing``): probes each site as
    the forward reaches it."""

    def __init__(self, model: torch.nn.Module, slices: int, draws: int, seed: int):
        self.routing, self.eps, self.n_sites = model.routing, model.args.routing_eps, model.args.n_routing_sites
        self.slices, self.draws = slices, draws
        generator = torch.Generator().manual_seed(seed)
        q = self.routing.effective_queries().detach()
        # draws x sites random queries, fixed once (the same for every batch)
        self.queries = q
        self.random = [[random_query_like(q[s], generator) for s in range(self.n_sites)] for _ in range(draws)]
        self.sums = torch.zeros(2, dtype=torch.float64)  # learned, random (summed over draws)
        self.by_site: dict[int, list[float]] = {}  # site -> [learned sum, random sum, count]
        self.by_draw: dict[int, list[float]] = {}  # site -> KL sum of each draw
        self.count = 0
        self.sites = 0
        self._calls = 0

    @torch.no_grad()
    def __call__(self, site: int, sources: Sequence[Tensor], router=None) -> None:
        self._calls += 1
        if len(sources) < 2:
            return
        # the site's effective query (its logit scale or learned temperature folded in), as the forward routes
        # the site's effective query of this forward (its scale or temperature folded in), as it routes
        q, g = router.site_rows(site) if router is not None else (self.queries[site], self.routing.key_norm[site])
        q, g = q.detach(), g.detach()
        kl = slice_kl(sources, q, g, self.slices, self.eps)
        learned = kl.double().sum().item()
        per_draw = [slice_kl(sources, draw[site], g, self.slices, self.eps).double().sum().item()
                    for draw in self.random]
        random = sum(per_draw) / self.draws
        self.sums[0] += learned
        self.sums[1] += random
        entry = self.by_site.setdefault(site, [0.0, 0.0, 0])
        entry[0], entry[1], entry[2] = entry[0] + learned, entry[1] + random, entry[2] + kl.numel()
        draws = self.by_draw.setdefault(site, [0.0] * self.draws)
        self.by_draw[site] = [a + b for a, b in zip(draws, per_draw)]
        self.count += kl.numel()
        self.sites += 1


def check_probe(args) -> None:
    """Refuse, in one line, a model (`ModelArgs` `args`) the probe does not apply to: anything but
    single-head AttnRes (the baseline, MHAR with H > 1, DenseFormer, MUDDFormer, Hyper-Connections,
    mHC: no single-head pseudo-query to split).

    Raises:
        ValueError: naming the model's depth connection and its routing heads."""
    if args.residual != "attn_res" or args.resolved_routing_heads != 1:
        what = (f"H={args.resolved_routing_heads}" if args.residual == "attn_res" else
                "a depth connection without pseudo-queries")
        raise ValueError(f"the query probe is defined for single-head AttnRes models (residual = 'attn_res', "
                         f"routing_heads = 1); this model has residual={args.residual!r}, {what}")


@torch.no_grad()
def query_probe(model: torch.nn.Module, batches: Iterable[Tensor], slices: int = 4, draws: int = 4,
                seed: int = 0) -> ProbeResult:
    """Run the probe of the module docstring over token batches (B, T) of a single-head model.

    Raises:
        ValueError: the model is not single-head AttnRes (H must be 1, `check_probe`), d % slices
            != 0, or no site has two sources.
    """
    args = model.args
    check_probe(args)
    if args.dim % slices:
        raise ValueError(f"d={args.dim} is not a multiple of slices={slices}")
    trace = ProbeTrace(model, slices, draws, seed)
    device = next(model.parameters()).device
    total = len(batches) if hasattr(batches, "__len__") else None
    tokens = 0
    with model.observe_routing(trace):
        for x in progress(batches, total=total, desc="probe", unit="batch"):
            model.hidden_states(x.to(device))
            tokens += x.numel()
    if trace.count == 0:
        raise ValueError("no routing site with two or more sources was probed (no batches?)")
    sites = sorted(trace.by_site)
    return ProbeResult(raw_kl=float(trace.sums[0]) / trace.count, random_kl=float(trace.sums[1]) / trace.count,
                       slices=slices, draws=draws, sites=trace.sites // (trace._calls // trace.n_sites), tokens=tokens,
                       per_site=tuple((site, trace.by_site[site][0] / trace.by_site[site][2],
                                       trace.by_site[site][1] / trace.by_site[site][2]) for site in sites),
                       site_draws=tuple(tuple(v / trace.by_site[site][2] for v in trace.by_draw[site])
                                        for site in sites),
                       random_draws=tuple(sum(trace.by_draw[site][k] for site in sites) / trace.count
                                          for k in range(draws)))


def plot_probe(result: ProbeResult, n_sites: int, path, title: str = "", dpi: int = 200):
    """Per-site mean KL(p || p_j) of the learned pseudo-queries against the random-query
    reference of equal norm (nats), one point per probed site (rows of the routing heatmaps,
    ``routing.site_names(n_sites)``), drawn at a paper's column width: the mean over the draws
    (dashed), each draw (small grey dots) and their range (grey band, min to max over the draws);
    the random queries have the learned query's norm. Saves a PNG at ``path`` and returns the figure. A learned curve above the band: the slices
    disagree more than any random query of the same norm did (the quantity MHAR_SPEC 3.3 tracks)."""
    from mhar_titan.analysis.heatmap import COLUMN_WIDTH_IN, FONT_PT
    from mhar_titan.analysis.plots import new_figure, save_figure
    from mhar_titan.analysis.routing import site_names

    names = site_names(n_sites)
    fig, (ax,) = new_figure(1, 1, panel_size=(COLUMN_WIDTH_IN, 2.8), dpi=dpi)
    x = list(range(len(result.per_site)))
    if result.site_draws:
        ax.fill_between(x, [min(d) for d in result.site_draws], [max(d) for d in result.site_draws], color="0.5",
                        alpha=0.25, lw=0, label=f"range of the {result.draws} draws")
        ax.plot([i for i, d in zip(x, result.site_draws) for _ in d], [v for d in result.site_draws for v in d],
                ".", ms=2, color="0.45", label="each random draw")
    ax.plot(x, [kl for _, _, kl in result.per_site], "s--", ms=3, lw=1, color="0.3",
            label="random query, mean")
    ax.plot(x, [kl for _, kl, _ in result.per_site], "o-", ms=3, lw=1, color="C0", label="learned query")
    ax.set_xticks(x, [names[site] for site, _, _ in result.per_site], rotation=90, fontsize=FONT_PT)
    ax.tick_params(labelsize=FONT_PT)
    ax.set_xlabel("routing site", fontsize=FONT_PT)
    ax.set_ylabel("KL(p || p_j), nats", fontsize=FONT_PT)
    ax.set_title(title or f"query probe, S = {result.slices} slices: excess {result.excess_kl:.4f} nats",
                 fontsize=FONT_PT)
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    order = [labels.index("learned query"), *(k for k, label in enumerate(labels) if label != "learned query")]
    fig.legend([handles[k] for k in order], [labels[k] for k in order], fontsize=FONT_PT, frameon=False,
               loc="outside lower center", ncol=2, handlelength=1.5, columnspacing=1.0)
    save_figure(fig, path, dpi)
    return fig
