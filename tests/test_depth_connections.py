"""DenseFormer and MUDDFormer (models/connections/dense.py, mudd.py) against fp64 references written
here from their formulas (docs/CONNECTIONS.md): the references wire the model's own sublayers
(attention, MLP, their norms) and parameters by hand, block by block, and share nothing with the
connection modules. Also: both start exactly as the pre-norm baseline, every connection parameter
learns, causality with and without document masks, and the parameter-count formulas."""
import math

import pytest
import torch
import torch.nn.functional as F

from mhar_titan.models import ModelArgs, Transformer, count_parameters
from mhar_titan.models.args import connection_parameters

pytestmark = pytest.mark.usefixtures("one_thread")

SHAPE = dict(dim=32, n_heads=4, n_kv_heads=2, ffn_dim=48, vocab_size=96, max_seq_len=24, eos_id=1)
VARIANTS = {
    "dense": dict(residual="dense"),
    "dense k=2 p=2": dict(residual="dense", dense_dilation=2, dense_period=2),
    "dense k=3": dict(residual="dense", dense_dilation=3),
    "mudd pre/post norm": dict(residual="mudd"),
    "mudd plain": dict(residual="mudd", mudd_prepost_norm=False),
}


def build(variant: str, n_layers: int, seed: int = 0, random: bool = True, **extra) -> Transformer:
    """A model of the variant with seeded weights and, with `random`, connection parameters (and the
    MUDDFormer stream norms) moved off their initialisation by N(0, 0.05^2) each: W2 = 0 and the
    one-hot a_i become trained-like values. (Plain MUDDFormer's fp32 rounding grows fast with its
    generator's output weights: at 12 layers its gradients are 1.5e-4 off the fp64 formula at
    N(0, 0.1^2) and 2.8e-4 at N(0, 0.2^2), measured; the fp64 model equals the formula exactly at any
    size, `test_logits_and_every_gradient_equal_the_formula_in_fp64`.)"""
    torch.manual_seed(seed)
    model = Transformer(ModelArgs(**SHAPE, n_layers=n_layers, **VARIANTS[variant], **extra))
    model.init_weights()
    if random:
        generator = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.startswith("routing.") or ".attention_norm." in name:
                    noise = torch.randn(p.shape, generator=generator)
                    p.add_(0.05 * noise)  # around the initialisation (one-hot a_i, unit norms): trained-like
    return model


def tokens(length: int = 10) -> torch.Tensor:
    x = torch.randint(2, SHAPE["vocab_size"], (2, length), generator=torch.Generator().manual_seed(3))
    x[0, 4] = SHAPE["eos_id"]
    return x


def rms(x, weight=None, eps=1e-6):
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight


def dense_reference(model: Transformer, ids: torch.Tensor) -> torch.Tensor:
    """DenseFormer's logits from its formula (Pagliardini et al. 2024, section 3): X_0 = emb; block i
    maps Y_i to X_{i+1} (pre-norm, additive inside); Y_{i+1} = sum_j alpha_{i,j} X_j over j <= i+1,
    j = i+1 (mod k), where (i+1) % p == 0, else X_{i+1}. alpha: the flat parameter, block after
    block, each block's weights in source order."""
    args, p = model.args, dict(model.named_parameters())
    k, period = args.dense_dilation, args.dense_period
    context = model.attention_context(ids)
    xs = [model.tok_embeddings(ids)]
    y, offset = xs[0], 0
    for i, layer in enumerate(model.layers):
        h = y + layer.attention(rms(y, layer.attention_norm.weight), context)
        x = h + layer.feed_forward(rms(h, layer.ffn_norm.weight))
        xs.append(x)
        if (i + 1) % period == 0:
            reads = list(range((i + 1) % k, i + 2, k))
            alpha = p["routing.alpha"][offset:offset + len(reads)]
            offset += len(reads)
            y = sum(a * xs[j] for a, j in zip(alpha, reads))
        else:
            y = x
    return F.linear(rms(y, model.norm.weight), model.tok_embeddings.weight)


def mudd_reference(model: Transformer, ids: torch.Tensor) -> torch.Tensor:
    """MUDDFormer's logits from its formula (Xiao et al. 2025, section 3, and the pre/post DA norm of
    the reference's JAX code): after block i with output X_{i+1}, dw = W2 GELU(W1 n(X_{i+1})) + a_i
    over sources S_0..S_{i+1}; streams c = Q, K, V, R (R alone after the last block): DA_c =
    sum_j dw[c, j] S_j; plain: S_j = X_j, n = RMSNorm without scale, stream = DA; pre/post: S_j =
    RMSNorm_j(X_j), n = RMSNorm with scale, stream = X_{i+1} + DA (R: + post-RMSNorm(DA)). Block
    i > 0: h = R + attn(norm_q Q, norm_k K, norm_v V); X = h + MLP(norm h)."""
    args, p = model.args, dict(model.named_parameters())
    L, prepost = args.n_layers, args.mudd_prepost_norm
    context = model.attention_context(ids)
    x0 = model.tok_embeddings(ids)
    sources = [rms(x0, p["routing.source_norm.0.weight"]) if prepost else x0]
    q = k = v = r = x0
    for i, layer in enumerate(model.layers):
        if i == 0:
            a = layer.attention(rms(x0, layer.attention_norm.weight), context)
        else:
            norms = layer.attention_norm
            a = layer.attention((rms(q, norms.q.weight), rms(k, norms.k.weight), rms(v, norms.v.weight)), context)
        h = r + a
        x = h + layer.feed_forward(rms(h, layer.ffn_norm.weight))
        sources.append(rms(x, p[f"routing.source_norm.{i + 1}.weight"]) if prepost else x)
        n = rms(x, p[f"routing.generator_norm.{i}.weight"]) if prepost else rms(x)
        C = 1 if i == L - 1 else 4
        dw = F.gelu(n @ p[f"routing.w1.{i}.weight"].T) @ p[f"routing.w2.{i}.weight"].T
        dw = dw.reshape(*dw.shape[:-1], C, i + 2) + p[f"routing.static.{i}"]
        streams = []
        for c in range(C):
            da = sum(dw[..., c, j:j + 1] * sources[j] for j in range(i + 2))
            if prepost:
                da = x + (rms(da, p[f"routing.post_norm.{i}.weight"]) if c == C - 1 else da)
            streams.append(da)
        if C == 1:
            r = streams[0]
        else:
            q, k, v, r = streams
    return F.linear(rms(r, model.norm.weight), model.tok_embeddings.weight)


REFERENCES = {"dense": dense_reference, "mudd": mudd_reference}


def relative(value: torch.Tensor, reference: torch.Tensor) -> float:
    return ((value.double() - reference).abs().max() / reference.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("n_layers", [2, 4, 12])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_and_every_gradient_equal_the_formula_in_fp64(variant, n_layers):
    """Our model against the fp64 formula on the same weights: in fp32, logits and every parameter's
    gradient within 2e-4 relative (each tensor against its own largest entry); in fp64 within 1e-12
    (the same wiring: only rounding could differ)."""
    if VARIANTS[variant].get("dense_dilation", 1) > n_layers:
        pytest.skip("the dilation is larger than the model")
    reference = build(variant, n_layers).double()
    ids = tokens()
    expected = REFERENCES[reference.args.residual](reference, ids)
    expected_grads = torch.autograd.grad(expected.logsumexp(-1).sum(), list(reference.parameters()))
    for dtype, rtol in ((torch.float32, 2e-4), (torch.float64, 1e-12)):
        model = build(variant, n_layers).to(dtype)
        logits = model(ids)
        assert relative(logits, expected) < rtol, dtype
        grads = torch.autograd.grad(logits.double().logsumexp(-1).sum(), list(model.parameters()))
        for (name, _), got, want in zip(model.named_parameters(), grads, expected_grads):
            assert relative(got, want) < rtol, (dtype, name)


@pytest.mark.parametrize("n_layers", [1, 3, 6])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_at_initialisation_the_model_is_the_pre_norm_baseline(variant, n_layers):
    """Same weights, connection parameters as initialised: the baseline's logits within 1e-6 (fp32)."""
    if VARIANTS[variant].get("dense_dilation", 1) > n_layers:
        pytest.skip("the dilation is larger than the model")
    model = build(variant, n_layers, random=False)
    torch.manual_seed(0)
    baseline = Transformer(ModelArgs(**SHAPE, n_layers=n_layers))
    baseline.init_weights()
    baseline_state = baseline.state_dict()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in baseline_state:
                p.copy_(baseline_state[name])
            elif ".attention_norm." in name:  # MUDDFormer's stream norms: the baseline's one norm
                layer = name.split(".")[1]
                p.copy_(baseline_state[f"layers.{layer}.attention_norm.weight"])
    ids = tokens()
    assert (model(ids) - baseline(ids)).abs().max().item() <= 1e-6


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_connection_parameter_gets_a_gradient_and_learns(variant):
    """Finite gradients at initialisation for every connection parameter, and a non-zero one after
    one optimizer step (W2 = 0 and a_i = 0 at init make some exactly zero at first: the step moves
    them)."""
    model = build(variant, 4, random=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = tokens()
    for step in range(2):
        optimizer.zero_grad()
        model(ids[:, :-1], ids[:, 1:]).backward()
        connection = {n: p.grad for n, p in model.named_parameters() if n.startswith("routing.")}
        assert connection and all(g is not None and torch.isfinite(g).all() for g in connection.values())
        if step == 1:
            assert all(g.abs().sum() > 0 for g in connection.values()), [n for n, g in connection.items()
                                                                         if g.abs().sum() == 0]
        optimizer.step()


@pytest.mark.parametrize("mask", ["causal", "block_causal"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_token_changes_no_earlier_logits(variant, mask):
    """Perturbing token t leaves the logits before t unchanged (with document masks too: and the
    logits of an earlier document's tokens are also unchanged by a later document)."""
    model = build(variant, 4, attn_mask_type=mask)
    assert_causal(model)


def assert_causal(model, t: int = 7) -> None:
    """Changing token t of `tokens()` leaves the logits before t equal bit for bit and changes later ones."""
    ids = tokens()
    changed = ids.clone()
    changed[:, t] = (changed[:, t] + 5) % SHAPE["vocab_size"]
    changed[:, t] = torch.where(changed[:, t] == SHAPE["eos_id"], 2, changed[:, t])
    with torch.no_grad():
        before, after = model(ids), model(changed)
    assert torch.equal(before[:, :t], after[:, :t])
    assert not torch.allclose(before[:, t:], after[:, t:])


@pytest.mark.parametrize("n_layers", [1, 2, 5, 24])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_parameter_counts_follow_the_formulas(variant, n_layers):
    """DenseFormer: one weight per (block, source read), L(L+3)/2 at k = p = 1; MUDDFormer: sum_i d K_i
    + K_i C_i (i+2) + C_i (i+2), plus the pre/post DA norms' scales and the K and V stream norms."""
    fields = VARIANTS[variant]
    if fields.get("dense_dilation", 1) > n_layers or fields.get("dense_period", 1) > n_layers:
        pytest.skip("the dilation or period is larger than the model")
    args = ModelArgs(**SHAPE, n_layers=n_layers, **fields)
    with torch.device("meta"):
        model = Transformer(args)
    assert sum(p.numel() for p in model.parameters()) == count_parameters(args).total
    d, L = args.dim, n_layers
    if args.residual == "dense":
        k, p = args.dense_dilation, args.dense_period
        expected = sum((i + 1) // k + 1 for i in range(L) if (i + 1) % p == 0)
        if k == p == 1:
            assert expected == L * (L + 3) // 2
    else:
        C = [4] * (L - 1) + [1]
        K = [(C[i] * (i + 2) * (4 if i == L - 1 else 1) // 64 + 1) * 64 for i in range(L)]
        expected = sum(d * K[i] + K[i] * C[i] * (i + 2) + C[i] * (i + 2) for i in range(L))
        expected += ((L + 1) * d + 2 * L * d if args.mudd_prepost_norm else 0) + 2 * (L - 1) * d
    assert connection_parameters(args) == expected


def test_a_hook_that_replaces_a_sublayers_output_reaches_the_routing_on_the_fused_kernels():
    """A forward hook on a block's attention that replaces its output: the fused kernels' depth buffer
    holds the replaced output (each sublayer output is copied into its slot after the sublayer ran),
    so the fused path computes what the eager path does (it once wrote the output projection's
    result into the slot from inside the projection, and the hook's value never reached routing)."""
    import model_equivalence as me

    combination = dict(residual="attn_res", routing_heads=4, ac="none")
    reference = me.reference_model(me.model_args(combination))
    fused = me.copy_of(reference, me.model_args(combination, "triton"), torch.float64)
    for model in (reference, fused):
        for layer in model.layers:
            layer.attention.register_forward_hook(lambda module, inputs, output: 2.0 * output)
    ids = me.batch()
    failures = me.compare("triton float64", me.loss_and_grads(fused, ids), me.loss_and_grads(reference, ids), 1e-9)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_eager_path_mixes_depth_buffer_rows_without_a_stack(variant):
    """Eager, every depth mix reads its sources as rows of one depth buffer (mhar_kernels.depth_mix,
    one node of the autograd graph per mix):
    no stack or concatenation of sources runs in the forward (RoPE's rotate-half concatenates one
    (B, T, d) tensor's halves: nothing larger is concatenated), and the compiled
    blocks' list path (a sum of scaled entries) gives the same logits and gradients within 1e-5."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.joined = []  # numel of every stack / cat output

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if str(func.overloadpacket) in ("aten.stack", "aten.cat"):
                self.joined.append(out.numel())
            return out

    model, listed = build(variant, 4), build(variant, 4)
    listed.compiled_blocks = True  # the compiled blocks' path, run eagerly
    ids = tokens()
    with Ops() as ops:
        loss = model(ids[:, :-1], ids[:, 1:])
    loss.backward()
    assert ops.joined and max(ops.joined) <= ids.shape[0] * (ids.shape[1] - 1) * SHAPE["dim"]
    listed_loss = listed(ids[:, :-1], ids[:, 1:])
    listed_loss.backward()
    assert abs(loss.item() - listed_loss.item()) <= 1e-5 * abs(loss.item())
    for (name, p), q in zip(model.named_parameters(), listed.parameters()):
        assert relative(p.grad, q.grad.double()) < 1e-4, name
