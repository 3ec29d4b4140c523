"""Manifold-constrained Hyper-Connections (Xie et al. 2025, DeepSeek, "mHC: Manifold-Constrained
Hyper-Connections", arXiv 2512.24880, section 4): `residual = "mhc"`.

The residual stream is widened to n = `hyper_rate` streams (streams.py): the carried state is H
(B, T, n, d), n copies of the token embedding at entry. At sublayer site s, with x = vec(H) (B, T,
nd) and f the sublayer with its own pre-RMSNorm, the mapping is computed in fp32 (fp64 in an fp64
model), whatever the activations' dtype and autocast:

    r    = 1 / sqrt(mean(x^2) + eps)                                 per token
    m    = (x phi_s^T) r                                             (B, T, n^2 + 2n), phi_s ((n^2+2n) x nd)
    pre  = sigmoid(a_0 m[:n] + b[:n]) + eps                          (B, T, n)
    post = 2 sigmoid(a_1 m[n:2n] + b[n:2n])                          (B, T, n)
    comb = Sinkhorn(a_2 m[2n:] + b[2n:]) as n x n                    (B, T, n, n), comb[j, k]
    u    = sum_j pre_j H_j,   H'_k = post_k f(u) + sum_j comb[j, k] H_j

then pre, post and comb are cast to the activations' dtype for the mixing. Sinkhorn(X): a softmax
over each row (the last dimension), + eps, each column divided by its sum + eps, then iters - 1
rounds of rows then columns (`mhc_sinkhorn_iters` = 20 iterations, ending on a column
normalisation: each new stream k is a convex mix of the old ones; the columns sum to 1, the rows
only nearly: within 1e-3 after a training step from initialisation, up to 8e-3 off for peaked,
trained-like matrices, measured). eps = 1e-6 everywhere.
The read-out before the final norm (`mhc_exit`): "learned", DeepSeek's head, w = sigmoid(a_h
(x phi_h^T) r + b_h) + eps (n,) per token and sum_j w_j H_j; or "mean", Megatron's mean of streams.

References (they agree on the above): DeepSeek-V4's `hc_pre`, `hc_post`, `hc_head` and
`hc_split_sinkhorn` (inference/model.py, inference/kernel.py) and Megatron-LM's
`megatron/core/transformer/hyper_connection.py` (`HyperConnectionModule`, `SinkhornKnopp`), whose
choices we take where DeepSeek's inference code is silent: the mapping in fp32 with the mixing
weights cast back, and Sinkhorn's backward recomputing its iterations from the saved logits (an
autograd Function, `Sinkhorn`) instead of keeping 2 x iters intermediate matrices. Megatron's r puts
eps outside the square root; we follow DeepSeek's (and the paper's) inside.

Initialisation is not published (`mhc_init`). Ours, "zero" (the default, Megatron's): phi_s
xavier-uniform (fan in nd, fan out n^2 + 2n), b = 0, a = 0.01 (and the head's phi_h xavier-uniform,
b_h = 0, a_h = 0.01). With b = 0 the model does not start exactly at pre-norm: pre ~ 1/2 per stream
(sum n/2, which the sublayer's RMSNorm removes), post ~ 1, comb ~ the uniform 1/n matrix, each
moved by a m ~ 0.01 m per token; on equal streams any column-stochastic comb is the identity, so the
model starts near pre-norm (the hidden states after the final norm 0.3% off at 6 layers and 0.9% at
24, tests/test_multistream_connections.py) and the streams part from each other only through those
per-stream differences. "prenorm" sets b_pre = logit(1/n) (pre = 1/n: u is the mean of the
streams), b_res = c I (c = `mhc_res_bias`, 10 by default as in one public port: comb near the
identity) and b_h = logit(1/n) (the exit starts as the mean); it starts as far from pre-norm (the
gap is post's and the exit's a m terms). The MHAR authors' harness draws phi from N(0, 0.02^2) with
b = 0 instead. Megatron's xavier initialisation is the default because it is the published
trainer's. Whatever the initialisation, the first site's comb never learns: its n input streams are
copies of the embedding, which any column-stochastic comb leaves unchanged (its gradient is 0 up to
eps and rounding).

The projection (`RmsProjection`) keeps x in the activations' dtype for its backward (no fp32 copy
of vec(H) per site) and recomputes r's gradient from it. Memory: without AC a site keeps H (its
projection and mixing read it) and f's output (1 row); under AC full a block keeps its input H alone
(streams.py): L (n - 1) rows of d per token more than the baseline, 108 at the 1b flavor's 36 layers
and n = 4; the learned exit keeps the last H. An observer (`base.MixObserver`) sees the fp32
mapping of each site, "site s pre" (B, T, n), "site s post" (B, T, n) and "site s comb" (B, T, n,
n), and the exit's weights "exit" (B, T, n).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .base import Connection
from .streams import Mapping, StreamFlow, StreamLink, copy_full, expand, read, state_rows

EPS = 1e-6
"""eps of r, pre, the exit's weights and Sinkhorn (DeepSeek's and Megatron's 1e-6)."""
GATE_INIT = 0.01
"""The gating factors a (and the head's a_h) at initialisation (Megatron's mhc_init_gating_factor)."""


def mapping_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the mapping is computed in: fp32, or fp64 for an fp64 model."""
    return torch.promote_types(dtype, torch.float32)


class RmsProjection(torch.autograd.Function):
    """m = (x phi^T) r with r = 1 / sqrt(mean(x^2) + eps): x (..., K) in any dtype, phi (M, K) ->
    (..., M) in `mapping_dtype` (computed there, autocast off; mean(x^2) as |x|^2 / K, one pass over
    x). Saves x as it is (a view of the state, no copy) and r and x phi^T (M + 1 values per token);
    the backward recomputes the rest: dm -> dp = dm r, dr = <dm, x phi^T>, dx = dp phi - dr r^3 x / K,
    dphi = dp^T x."""

    @staticmethod
    def forward(ctx, x: Tensor, phi: Tensor, eps: float) -> Tensor:
        dtype = mapping_dtype(x.dtype)
        with torch.autocast(x.device.type, enabled=False):
            wide = x.to(dtype)
            r = torch.rsqrt(torch.linalg.vector_norm(wide, dim=-1, keepdim=True).square() / x.shape[-1] + eps)
            projected = wide @ phi.to(dtype).T
        ctx.save_for_backward(x, phi, r, projected)
        return projected * r

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, phi, r, projected = ctx.saved_tensors
        with torch.autocast(x.device.type, enabled=False):
            wide, phi_wide = x.to(r.dtype), phi.to(r.dtype)
            grad_projected = grad * r
            grad_r = (grad * projected).sum(-1, keepdim=True)
            grad_x = torch.addcmul(grad_projected @ phi_wide, grad_r * r.pow(3) / x.shape[-1], wide, value=-1)
            grad_phi = grad_projected.flatten(0, -2).T @ wide.flatten(0, -2)
        return grad_x.to(x.dtype), grad_phi.to(phi.dtype), None


def normalisations(iters: int) -> list[int]:
    """The dimensions Sinkhorn divides by the sums of, in order after the row softmax: columns (-2),
    then iters - 1 rounds of rows (-1) and columns: 2 iters - 1 of them, ending on columns."""
    return [-2] + [-1, -2] * (iters - 1)


class Sinkhorn(torch.autograd.Function):
    """Sinkhorn(X) (module docstring) of logits X (..., n, n) in their dtype. The forward keeps only
    X; the backward recomputes the iterations (their 2 iters - 1 intermediate matrices live only
    while it runs) and goes back through them: through M' = M / (sum_dim M + eps),
    dM = (dM' - sum_dim(dM' M')) / (sum_dim M + eps); through the softmax P, dX = P (dM - sum(dM P))."""

    @staticmethod
    def forward(ctx, logits: Tensor, iters: int, eps: float) -> Tensor:
        ctx.save_for_backward(logits)
        ctx.iters, ctx.eps = iters, eps
        matrix = logits.softmax(-1) + eps
        for dim in normalisations(iters):
            matrix = matrix / (matrix.sum(dim, keepdim=True) + eps)
        return matrix

    @staticmethod
    def backward(ctx, grad: Tensor):
        (logits,) = ctx.saved_tensors
        probabilities = logits.softmax(-1)
        matrix, steps = probabilities + ctx.eps, []
        for dim in normalisations(ctx.iters):
            total = matrix.sum(dim, keepdim=True) + ctx.eps
            matrix = matrix / total
            steps.append((dim, matrix, total))
        for dim, matrix, total in reversed(steps):
            grad = (grad - (grad * matrix).sum(dim, keepdim=True)) / total
        return probabilities * (grad - (grad * probabilities).sum(-1, keepdim=True)), None, None


def sinkhorn(logits: Tensor, iters: int, eps: float = EPS) -> Tensor:
    """Sinkhorn(logits) (module docstring): (..., n, n) -> (..., n, n), columns summing to 1."""
    return Sinkhorn.apply(logits, iters, eps)


class MhcWeights(nn.Module):
    """mHC's parameters (`Transformer.routing`), stacked over the S = 2L sites: `phi` (S, n^2+2n,
    nd), `bias` (S, n^2+2n) (b: pre, post, then comb row by row) and `scale` (S, 3) (a_0, a_1, a_2);
    with the learned exit also `head_phi` (n, nd), `head_bias` (n,) and `head_scale` (1,)."""

    weight_decay = False
    """No weight decay on these parameters (optim.groups.never_decayed; the harness's choice)."""

    mix_weights = {"pre": 1, "post": 1, "comb": 2, "exit": 1}
    """The weights each site gives its observer ("site s pre", "site s post", "site s comb") and the
    learned exit ("exit"), with how many of their dimensions are the weights' own, (n,), (n,),
    (n, n) and (n,), after the tokens' (B, T)."""

    def __init__(self, args):
        super().__init__()
        S, n, d = 2 * args.n_layers, args.hyper_rate, args.dim
        self.n, self.init, self.res_bias = n, args.mhc_init, args.mhc_res_bias
        self.phi = nn.Parameter(torch.empty(S, n * n + 2 * n, n * d))
        self.bias = nn.Parameter(torch.empty(S, n * n + 2 * n))
        self.scale = nn.Parameter(torch.empty(S, 3))
        self.learned_exit = args.mhc_exit == "learned"
        if self.learned_exit:
            self.head_phi = nn.Parameter(torch.empty(n, n * d))
            self.head_bias = nn.Parameter(torch.empty(n))
            self.head_scale = nn.Parameter(torch.empty(1))

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """phi xavier-uniform, a = 0.01, b = 0; under mhc_init = "prenorm" b_pre = b_h = logit(1/n)
        and b_res = c I (module docstring)."""
        n, (mix, width) = self.n, self.phi.shape[1:]
        self.phi.uniform_(-math.sqrt(6 / (width + mix)), math.sqrt(6 / (width + mix)))
        self.bias.zero_()
        self.scale.fill_(GATE_INIT)
        if self.init == "prenorm":
            bias = torch.zeros(self.bias.shape)
            bias[:, :n] = -math.log(n - 1)  # logit(1/n)
            bias[:, 2 * n:] = (self.res_bias * torch.eye(n)).flatten()
            copy_full(self.bias, bias)
        if self.learned_exit:
            self.head_phi.uniform_(-math.sqrt(6 / (width + n)), math.sqrt(6 / (width + n)))
            self.head_bias.fill_(-math.log(n - 1) if self.init == "prenorm" else 0.0)
            self.head_scale.fill_(GATE_INIT)

    def sites(self, iters: int, observer=None) -> list["MhcSite"]:
        """Every site's `MhcSite` in this forward, holding views of the parameters."""
        views = zip(self.phi.unbind(0), self.bias.unbind(0), self.scale.unbind(0))
        return [MhcSite(s, self.n, iters, phi, bias, scale, observer) for s, (phi, bias, scale) in enumerate(views)]


class MhcSite:
    """Site s's mapping in one forward (module docstring): H (B, T, n, d) -> `Mapping`(pre, comb,
    post) per token, in H's dtype."""

    __slots__ = ("index", "n", "iters", "phi", "bias", "scale", "observer")

    def __init__(self, index: int, n: int, iters: int, phi: Tensor, bias: Tensor, scale: Tensor, observer=None):
        self.index, self.n, self.iters, self.observer = index, n, iters, observer
        self.phi, self.bias, self.scale = phi, bias, scale

    def __call__(self, streams: Tensor) -> Mapping:
        n = self.n
        m = RmsProjection.apply(streams.flatten(-2), self.phi, EPS)  # (B, T, n^2 + 2n), fp32
        with torch.autocast(streams.device.type, enabled=False):
            a, b = self.scale.to(m.dtype), self.bias.to(m.dtype)
            pre = torch.sigmoid(a[0] * m[..., :n] + b[:n]) + EPS
            post = 2 * torch.sigmoid(a[1] * m[..., n:2 * n] + b[n:2 * n])
            comb = sinkhorn((a[2] * m[..., 2 * n:] + b[2 * n:]).unflatten(-1, (n, n)), self.iters)
        if self.observer is not None:
            for name, weights in (("pre", pre), ("post", post), ("comb", comb)):
                self.observer(f"site {self.index} {name}", weights.detach())
        return Mapping(pre.to(streams.dtype), comb.to(streams.dtype), post.to(streams.dtype))


class LearnedExit:
    """DeepSeek's head (module docstring): H (B, T, n, d) -> sum_j w_j H_j (B, T, d), w =
    sigmoid(a_h (x phi_h^T) r + b_h) + eps in fp32, cast to H's dtype."""

    __slots__ = ("phi", "bias", "scale", "observer")

    def __init__(self, params: MhcWeights, observer=None):
        self.phi, self.bias, self.scale, self.observer = params.head_phi, params.head_bias, params.head_scale, observer

    def __call__(self, streams: Tensor) -> Tensor:
        m = RmsProjection.apply(streams.flatten(-2), self.phi, EPS)  # (B, T, n), fp32
        with torch.autocast(streams.device.type, enabled=False):
            weights = torch.sigmoid(self.scale.to(m.dtype) * m + self.bias.to(m.dtype)) + EPS
        if self.observer is not None:
            self.observer("exit", weights.detach())
        return read(weights.to(streams.dtype), streams)


def mean_of_streams(streams: Tensor) -> Tensor:
    """Megatron's read-out: the mean of the streams, (B, T, n, d) -> (B, T, d)."""
    return streams.mean(-2)


class ManifoldHyperConnections(Connection):
    """`residual = "mhc"` (module docstring)."""

    name = "mhc"

    def parameters(self) -> MhcWeights:
        return MhcWeights(self.args)

    def flow(self, params: MhcWeights, x0: Tensor, observer=None, buffered: bool = True) -> StreamFlow:
        sites = params.sites(self.args.mhc_sinkhorn_iters, observer)
        links = [StreamLink((sites[2 * i], sites[2 * i + 1])) for i in range(self.args.n_layers)]
        exit = LearnedExit(params, observer) if params.learned_exit else mean_of_streams
        return StreamFlow(expand(x0, self.args.hyper_rate), links, exit)

    # -- the cost model (module docstring; base.Connection) --
    def flops_per_token(self) -> int:
        """Per site: the projection 2 nd (n^2+2n), r 2nd, the Sinkhorn's softmax (4n^2) and its
        2 iters - 1 normalisations (2n^2 each), the read 2nd, the mix 2n^2 d and the write 2nd; the
        learned exit's projection 2 nd n, its r 2nd and its weighted sum 2nd (the mean: nd)."""
        n, d, L, iters = self.args.hyper_rate, self.args.dim, self.args.n_layers, self.args.mhc_sinkhorn_iters
        site = 2 * n * d * (n * n + 2 * n) + 2 * n * d + n * n * (4 + 2 * (2 * iters - 1)) + 2 * n * d * (n + 2)
        exit = 2 * n * d * (n + 2) if self.args.mhc_exit == "learned" else n * d
        return 2 * L * site + exit

    def depth_reads(self) -> tuple[int, int]:
        """Rows of d read per token beyond the baseline's in one training step, (forward, backward),
        as the eager ops read them (every op's inputs but views; tests/test_multistream_connections.py
        counts them with a dispatch mode). Forward: per site H by r's norm, the projection, the
        read, the mix and the write's R (5n) and f once by the write, against the baseline's add of
        the stream and f (2): 5n - 1; the entry's n copies n; the learned exit 3n (r, projection,
        sum), the mean n. Backward (counted): per site 15n + 2; the entry's sum over its copies n;
        the learned exit 6n + 2, the mean n."""
        n, S = self.args.hyper_rate, 2 * self.args.n_layers
        learned = self.args.mhc_exit == "learned"
        return S * (5 * n - 1) + n + (3 * n if learned else n), S * (15 * n + 2) + n + (6 * n + 2 if learned else n)

    def kept_rows(self, ac: str) -> int:
        """Rows of d per token kept for the backward at the end of the forward beyond the baseline's
        (counted like `depth_reads`, with saved-tensor hooks), the learned exit's H (n) included. AC
        none (and "selective", whose block count this does not take: an upper bound): per site H
        (n rows, saved by the projection and the mixing) and f (1, by the write). AC full: per block
        its input H, n rows against the baseline's stream, L (n - 1); while the backward recomputes
        a block, its two sites' rows of AC none, 2 (n + 1), come on top."""
        L = self.args.n_layers
        return self.state_rows(ac) - L if ac == "full" else self.state_rows(ac) + 2 * L

    def state_rows(self, ac: str) -> int:
        """H's rows among what the backward keeps (streams.state_rows): L n under AC full, 2 L n
        otherwise, and the learned exit's H (n; the mean keeps nothing)."""
        n = self.args.hyper_rate
        return state_rows(ac, self.args.n_layers, n, n if self.args.mhc_exit == "learned" else 0)
