"""Independent float64 oracle for depth routing, shared by the kernel tests (a helper, no tests).

Plain autograd on a stacked float64 tensor (MHAR_SPEC section 2, delta mode section 1.4),
written without the reference's helpers and without the storage-dtype rounding of the key:
the mathematical function the kernels approximate.
"""
from __future__ import annotations

import torch
from torch import Tensor


def oracle_route(sources, query, norm_weight, heads, eps=1e-6, *, partial=None, alpha=None, null_source=None) -> Tensor:
    """float64 result of mix (or partial + alpha * mix); differentiable in float64."""
    shape = sources[0].shape
    srcs = ([null_source] if null_source is not None else []) + list(sources)
    x = torch.stack([s.double().expand(shape) for s in srcs])  # (N, B, T, d)
    key = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.double()
    split = x.shape[:-1] + (heads, x.shape[-1] // heads)
    logits = (key.reshape(split) * query.double().reshape(heads, -1)).sum(-1)  # (N, B, T, H)
    weights = torch.softmax(logits, dim=0)
    mix = (weights.unsqueeze(-1) * x.reshape(split)).sum(0).reshape(shape)
    if partial is None:
        return mix
    return partial.double() + alpha.double() * mix


def rel_err(x: Tensor, ref: Tensor, floor: float = 1e-6) -> float:
    """||x - ref|| / max(||ref||, floor) in float64 (the floor covers references that are zero)."""
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm().clamp_min(floor)).item()


# The kernel tests run on CUDA where there is one (the GPU suite), else on CPU (interpreter).
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def make_inputs(n, d, heads, dtype, *, batch=2, seq=7, delta=False, seed=0, device=DEVICE):
    """Random routing inputs on `device`: n sources (batch, seq, d), query scaled so logits are
    O(1) per head, norm weight near 1; with delta=True also partial, alpha (1,) and a null
    source (d,). Drawn on the CPU, so every device gets the same values."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device, dtype).requires_grad_()

    k = d // heads
    inputs = dict(
        sources=[randn(batch, seq, d) for _ in range(n)],
        query=randn(d, scale=1.5 / k**0.5),
        norm_weight=(1 + 0.2 * torch.randn(d, generator=gen)).to(device, dtype).requires_grad_(),
    )
    if delta:
        inputs.update(partial=randn(batch, seq, d), alpha=randn(1, scale=0.5), null_source=randn(d, scale=0.5))
    return inputs


def leaves(inputs: dict) -> list[Tensor]:
    """Differentiable inputs in a fixed order: sources, query, norm weight, then delta extras."""
    out = list(inputs["sources"]) + [inputs["query"], inputs["norm_weight"]]
    return out + [inputs[k] for k in ("partial", "alpha", "null_source") if k in inputs]


def leaf_names(inputs: dict) -> list[str]:
    n = len(inputs["sources"])
    extras = [k for k in ("partial", "alpha", "null_source") if k in inputs]
    return [f"source{i}" for i in range(n)] + ["query", "norm_weight"] + extras


def route_with_state(sources, query, norm_weight, heads, eps=1e-6, *, state=None, null_source=None):
    """The fused forward kernel's online-softmax state (HAS_STATE, no autograd): route `sources`
    continuing from `state` = (mix (B, T, d) normalised, lse (B*T, H) fp32) of earlier sources
    routed with the same query and norm weight; returns the new state, fp32. Raises as
    `mhar_kernels.route` (ValueError, RuntimeError where the kernels cannot run)."""
    from mhar_kernels import contract, op
    from mhar_kernels.triton_routing import route_forward

    sources = list(sources)
    heads = contract.check_route_args(sources, query, norm_weight, heads, null_source=null_source)
    op._require(sources[0].device, sources[0].shape[-1], heads)
    slots = torch.arange(len(sources), dtype=torch.int32, device=sources[0].device)
    null = None if null_source is None else null_source.to(sources[0].dtype)
    with torch.no_grad():  # the sources as rows 0..n-1 of a depth buffer of their own
        out, _, stats = route_forward(torch.stack(sources), slots, query, norm_weight, heads, eps, null=null,
                                      state=state, out_dtype=torch.float32)
    return out, stats[-1]


def merge_states(a, b):
    """Merge two routing states over disjoint source sets: lse = logaddexp, mixes weighted by
    exp(lse_i - lse). Shapes: mix (B, T, d), lse (B*T, H); returns fp32."""
    (mix_a, lse_a), (mix_b, lse_b) = a, b
    lse = torch.logaddexp(lse_a.float(), lse_b.float())
    bt, heads = lse.shape
    wa, wb = (torch.exp(x.float() - lse).unsqueeze(-1) for x in (lse_a, lse_b))
    mix = wa * mix_a.float().reshape(bt, heads, -1) + wb * mix_b.float().reshape(bt, heads, -1)
    return mix.reshape(mix_a.shape), lse


def random_routing_model(args, query_std: float, dtype: torch.dtype, kernel: str):
    """(model, device): a seeded `Transformer(args)` with random routing parameters (pseudo-queries
    N(0, query_std^2), key norms in [0.5, 1.5], open gates 0.7, non-zero null sources: a non-uniform
    depth softmax), in `dtype`, on the kernels' device for kernel="triton" (CUDA, else CPU through
    the interpreter), else on the CPU."""
    from mhar_titan.models.model import Transformer

    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    with torch.no_grad():
        model.routing.query.normal_(std=query_std)
        model.routing.key_norm.uniform_(0.5, 1.5)
        if model.routing.alpha is not None:
            model.routing.alpha.fill_(0.7)
        if model.routing.null_source is not None:
            model.routing.null_source.normal_()
    device = DEVICE if kernel == "triton" else torch.device("cpu")
    return model.to(device, dtype), device
