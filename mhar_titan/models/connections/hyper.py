"""Hyper-Connections (Zhu et al. 2025, "Hyper-Connections", ICLR 2025, arXiv 2409.19606, section 2
and appendix J, algorithm 2): `residual = "hyper"`.

The residual stream is widened to n = `hyper_rate` streams (streams.py): the carried state is H
(B, T, n, d), n copies of the token embedding x0 at entry, and the read-out before the final norm is
sum_c H_c. At sublayer site s (s = 2 i + sublayer in block i), with f the sublayer and its own
pre-RMSNorm:

    static (learned, per site):  alpha_s (n x (1+n)), beta_s (n)
    dynamic (`hyper_dynamic`, the paper's DHC; the default):
      Hbar  = LayerNorm_s(H)                             over d, per stream, with weight and bias
      alpha = s_alpha tanh(Hbar W_alpha) + alpha_s       (B, T, n, 1+n), W_alpha (d x (1+n))
      beta  = s_beta tanh(Hbar W_beta) + beta_s          (B, T, n),      W_beta (d)
    static only (false, SHC): alpha = alpha_s, beta = beta_s
    u    = sum_i alpha[i, 0] H_i                          the sublayer's input (B, T, d)
    R_c  = sum_i alpha[i, c] H_i,  c = 1..n               the streams mixed
    H'_c = R_c + beta_c f(u)

Initialisation: alpha_s[:, 0] = e_{s mod n} (the read stream cycles over the sublayers),
alpha_s[:, 1:] = I, beta_s = 1, W_alpha = W_beta = 0, s_alpha = s_beta = 0.01, LayerNorm weight 1
and bias 0. Every stream then carries the pre-norm stream h, and the read-out is n h: the pre-norm
baseline up to the factor n, which the final RMSNorm removes (up to its eps).

Reference: the MHAR authors' harness `wdlctc/hyper-connection-factory`,
`hcfactory/connections/hyper.py` (`_HCSite`, `HyperConnection`), which we follow: LayerNorm with
weight and bias at torch's eps 1e-5, the static alpha and beta learned, one scalar s_alpha and one
s_beta per site, the read stream counted over sublayers, the coefficients cast to the state's dtype.
`lucidrains/hyper-connections` (`hyper_connections/hyper_connections.py`, `HyperConnections`)
differs: each stream goes through an RMSNorm with a learned gain (1 + gamma) instead of the
LayerNorm, the read stream is random where no layer index is given, and the streams sit in the
batch dimension; one public port copied a version in which the residual mix R was never applied
(docs/CONNECTIONS.md).

Cost (the hooks of base.Connection): per site the mixing reads H three times (the read, the mix,
the write's R) and, with the dynamic part, twice more (the LayerNorm, the projection of Hbar).
Memory: without AC a site keeps H (read by the mix and the LayerNorm), Hbar (dynamic) and f's output
(1 row; the baseline's add keeps none); under AC full a block keeps its input H alone (streams.py):
L (n - 1) rows of d per token more than the baseline, 108 at the 1b flavor's 36 layers and n = 4.
An observer (`base.MixObserver`) sees each site's alpha and beta ((n, 1+n) and (n,), or per token
(B, T, n, 1+n) and (B, T, n)) as "site s alpha" and "site s beta".
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import Connection
from .streams import Mapping, StreamFlow, StreamLink, copy_full, expand, state_rows

LAYER_NORM_EPS = 1e-5
"""The dynamic part's LayerNorm eps: torch's default, as the reference's nn.LayerNorm."""
SCALE_INIT = 0.01
"""s_alpha and s_beta at initialisation (the paper's and the reference's)."""


class HyperWeights(nn.Module):
    """Hyper-Connections' parameters (`Transformer.routing`), stacked over the S = 2L sites:
    `static_alpha` (S, n, n+1) and `static_beta` (S, n); with the dynamic part also `norm_weight`
    and `norm_bias` (S, d) (the LayerNorm), `dynamic_alpha` (S, d, n+1) (W_alpha), `dynamic_beta`
    (S, d) (W_beta), `scale_alpha` and `scale_beta` (S,)."""

    weight_decay = False
    """No weight decay on these parameters (optim.groups.never_decayed; the harness's choice)."""

    mix_weights = {"alpha": 2, "beta": 1}
    """The weights each site gives its observer ("site s alpha", "site s beta") and how many of
    their dimensions are the weights' own, (n, 1+n) and (n,); per token they lead with (B, T)."""

    def __init__(self, args):
        super().__init__()
        S, n, d = 2 * args.n_layers, args.hyper_rate, args.dim
        self.dynamic = args.hyper_dynamic
        self.static_alpha = nn.Parameter(torch.empty(S, n, n + 1))
        self.static_beta = nn.Parameter(torch.empty(S, n))
        if self.dynamic:
            self.norm_weight = nn.Parameter(torch.empty(S, d))
            self.norm_bias = nn.Parameter(torch.empty(S, d))
            self.dynamic_alpha = nn.Parameter(torch.empty(S, d, n + 1))
            self.dynamic_beta = nn.Parameter(torch.empty(S, d))
            self.scale_alpha = nn.Parameter(torch.empty(S))
            self.scale_beta = nn.Parameter(torch.empty(S))

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """alpha_s[:, 0] = e_{s mod n}, alpha_s[:, 1:] = I, beta_s = 1; LayerNorm 1 and 0; W = 0;
        scales 0.01: the pre-norm baseline at initialisation (module docstring)."""
        S, n = self.static_alpha.shape[:2]
        alpha = torch.zeros(S, n, n + 1)
        alpha[torch.arange(S), torch.arange(S) % n, 0] = 1.0
        alpha[:, :, 1:] = torch.eye(n)
        copy_full(self.static_alpha, alpha)
        self.static_beta.fill_(1.0)
        if self.dynamic:
            self.norm_weight.fill_(1.0)
            self.norm_bias.zero_()
            self.dynamic_alpha.zero_()
            self.dynamic_beta.zero_()
            self.scale_alpha.fill_(SCALE_INIT)
            self.scale_beta.fill_(SCALE_INIT)

    def sites(self, observer=None) -> list["HyperSite"]:
        """Every site's `HyperSite` in this forward, holding views of the parameters."""
        names = ("static_alpha", "static_beta") + (
            ("norm_weight", "norm_bias", "dynamic_alpha", "dynamic_beta", "scale_alpha", "scale_beta")
            if self.dynamic else ())
        views = zip(*(getattr(self, name).unbind(0) for name in names))
        return [HyperSite(s, self.dynamic, tuple(v), observer) for s, v in enumerate(views)]


class HyperSite:
    """Site s's mapping in one forward (module docstring): H (B, T, n, d) -> `Mapping`(alpha[:, 0],
    alpha[:, 1:], beta), per token with the dynamic part, else the static (n,), (n, n), (n,)."""

    __slots__ = ("index", "dynamic", "params", "observer")

    def __init__(self, index: int, dynamic: bool, params: tuple[Tensor, ...], observer=None):
        self.index, self.dynamic, self.params, self.observer = index, dynamic, params, observer

    def __call__(self, streams: Tensor) -> Mapping:
        alpha, beta = self.params[:2]
        if self.dynamic:
            weight, bias, w_alpha, w_beta, s_alpha, s_beta = self.params[2:]
            normed = F.layer_norm(streams, streams.shape[-1:], weight, bias, LAYER_NORM_EPS)
            projected = torch.tanh(normed @ torch.cat([w_alpha, w_beta.unsqueeze(-1)], dim=-1))  # (B, T, n, n+2)
            alpha = s_alpha * projected[..., :-1] + alpha
            beta = s_beta * projected[..., -1] + beta
        if self.observer is not None:
            self.observer(f"site {self.index} alpha", alpha.detach())
            self.observer(f"site {self.index} beta", beta.detach())
        alpha, beta = alpha.to(streams.dtype), beta.to(streams.dtype)
        return Mapping(alpha[..., 0], alpha[..., 1:], beta)


def sum_of_streams(streams: Tensor) -> Tensor:
    """The read-out: sum_c H_c, (B, T, n, d) -> (B, T, d)."""
    return streams.sum(-2)


class HyperConnections(Connection):
    """`residual = "hyper"` (module docstring)."""

    name = "hyper"

    def parameters(self) -> HyperWeights:
        return HyperWeights(self.args)

    def flow(self, params: HyperWeights, x0: Tensor, observer=None, buffered: bool = True) -> StreamFlow:
        sites = params.sites(observer)
        links = [StreamLink((sites[2 * i], sites[2 * i + 1])) for i in range(self.args.n_layers)]
        return StreamFlow(expand(x0, self.args.hyper_rate), links, sum_of_streams)

    # -- the cost model (module docstring; base.Connection) --
    def flops_per_token(self) -> int:
        """Per site: the read 2nd, the mix 2n^2 d, the write 2nd (2nd (n+2)); with the dynamic part
        also the projection of Hbar onto [W_alpha | W_beta], 2nd (n+2); the read-out's sum (n-1) d."""
        n, d, L = self.args.hyper_rate, self.args.dim, self.args.n_layers
        site = 2 * n * d * (n + 2) * (2 if self.args.hyper_dynamic else 1)
        return 2 * L * site + (n - 1) * d

    def depth_reads(self) -> tuple[int, int]:
        """Rows of d read per token beyond the baseline's in one training step, (forward, backward),
        as the eager ops read them (every op's inputs but views; tests/test_multistream_connections.py
        counts them with a dispatch mode). Forward: per site H by the read, the mix and the write's R
        (3n), with the dynamic part also by the LayerNorm and the projection (5n), and f once by the
        write, against the baseline's add of the stream and f (2): 3n - 1 or 5n - 1; the entry's n
        copies n and the read-out's sum n. Backward (counted): per site 10n + 2, or 15n + 2 with the
        dynamic part; the entry's sum over its copies n."""
        n, S = self.args.hyper_rate, 2 * self.args.n_layers
        per_site = (5 * n - 1, 15 * n + 2) if self.args.hyper_dynamic else (3 * n - 1, 10 * n + 2)
        return S * per_site[0] + 2 * n, S * per_site[1] + n

    def kept_rows(self, ac: str) -> int:
        """Rows of d per token kept for the backward at the end of the forward beyond the baseline's
        (counted like `depth_reads`, with saved-tensor hooks). AC none (and "selective", whose block
        count this does not take: an upper bound): per site H (n rows, saved by the read, the mix
        and the LayerNorm), Hbar (n, dynamic) and f (1, by the write). AC full: per block its input
        H, n rows against the baseline's stream, L (n - 1); while the backward recomputes a block,
        its two sites' rows of AC none come on top."""
        n, L = self.args.hyper_rate, self.args.n_layers
        if ac == "full":
            return self.state_rows(ac) - L
        return self.state_rows(ac) + 2 * L * ((n if self.args.hyper_dynamic else 0) + 1)

    def state_rows(self, ac: str) -> int:
        """H's rows among what the backward keeps (streams.state_rows; the sum over streams keeps
        nothing): L n under AC full, 2 L n otherwise."""
        return state_rows(ac, self.args.n_layers, self.args.hyper_rate, 0)
