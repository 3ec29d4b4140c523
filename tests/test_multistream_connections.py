"""Hyper-Connections and mHC (models/connections/hyper.py, mhc.py, streams.py) against fp64
references written here from their formulas (docs/CONNECTIONS.md, issue 50): the references
wire the model's own sublayers (attention, MLP, their norms) and parameters by hand, stream by
stream and site by site, and share nothing with the connection modules (Sinkhorn is differentiated
by autograd through its plain iterations here, by its recomputing autograd Function there). Also:
Hyper-Connections start at the pre-norm baseline; mHC's comb is doubly stochastic after training,
its logits learn from the first step, its mixing is applied, its mapping stays in fp32 under bf16;
causality with and without document masks; AC full equals none bit for bit and per-block fullgraph
compile equals eager (DenseFormer and MUDDFormer too); the parameter-count formulas."""
import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from mhar_titan.models import ModelArgs, Transformer, count_parameters
from mhar_titan.models.args import CONNECTION_KEYS, connection_parameters
from mhar_titan.models.connections import build_connection
from mhar_titan.models.connections import mhc as mhc_module
from mhar_titan.parallel import _raise_recompile_limits, apply_ac

from test_depth_connections import SHAPE, assert_causal, rms, tokens  # the same shape, tokens, checks

pytestmark = pytest.mark.usefixtures("one_thread")

VARIANTS = {
    "hyper": dict(residual="hyper"),
    "hyper static": dict(residual="hyper", hyper_dynamic=False),
    "mhc": dict(residual="mhc"),
    "mhc mean exit": dict(residual="mhc", mhc_exit="mean"),
}
EPS = 1e-6  # mHC's eps (r, pre, the exit's weights, Sinkhorn)


def build(variant: str, n_layers: int, n: int = 4, seed: int = 0, random: bool = True, **extra) -> Transformer:
    """A model of the variant with seeded weights and, with `random`, trained-like connection
    parameters: Hyper-Connections' static alpha and beta moved by N(0, 0.1^2), W_alpha and W_beta
    N(0, 0.1^2), the scales in [0.1, 0.5], the LayerNorm's weight and bias moved by N(0, 0.1^2);
    mHC's gating factors a in [0.5, 1.5] and biases N(0, 0.5^2) (phi stays xavier-uniform), so that
    pre, post and comb differ from stream to stream and token to token."""
    torch.manual_seed(seed)
    model = Transformer(ModelArgs(**SHAPE, n_layers=n_layers, hyper_rate=n, **VARIANTS[variant], **extra))
    model.init_weights()
    if random:
        generator = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for name, p in model.routing.named_parameters():
                noise = torch.randn(p.shape, generator=generator, dtype=p.dtype)
                if "scale" in name:
                    low, high = (0.5, 1.5) if model.args.residual == "mhc" else (0.1, 0.5)
                    p.copy_(low + (high - low) * torch.rand(p.shape, generator=generator, dtype=p.dtype))
                elif name.endswith("bias") and model.args.residual == "mhc":
                    p.copy_(0.5 * noise)
                elif not name.endswith("phi"):
                    p.add_(0.1 * noise)
    return model


def sublayers(model: Transformer, ids: torch.Tensor):
    """The model's 2L sublayers in order, each f(u) = sublayer(RMSNorm(u)) with its own norm."""
    context = model.attention_context(ids)
    for layer in model.layers:
        yield lambda u, layer=layer: layer.attention(rms(u, layer.attention_norm.weight), context)
        yield lambda u, layer=layer: layer.feed_forward(rms(u, layer.ffn_norm.weight))


def head(model: Transformer, h: torch.Tensor) -> torch.Tensor:
    return F.linear(rms(h, model.norm.weight), model.tok_embeddings.weight)


def hyper_reference(model: Transformer, ids: torch.Tensor) -> torch.Tensor:
    """Hyper-Connections' logits from the formula (Zhu et al. 2025, section 2; issue 50): streams
    H_1..H_n start as the embedding; at site s, alpha = s_alpha tanh(LN(H_i) W_alpha) + alpha_s[i]
    and beta_i = s_beta tanh(LN(H_i) W_beta) + beta_s[i] per stream i (LN over d with weight and
    bias, eps 1e-5; static: alpha_s, beta_s); u = sum_i alpha[i, 0] H_i; H'_c = sum_i alpha[i, c] H_i
    + beta_c f(u); the read-out sum_c H_c."""
    p, args = dict(model.named_parameters()), model.args
    n, dynamic = args.hyper_rate, args.hyper_dynamic
    streams = [model.tok_embeddings(ids)] * n
    for s, f in enumerate(sublayers(model, ids)):
        alpha = [[p["routing.static_alpha"][s, i, c] for c in range(n + 1)] for i in range(n)]
        beta = [p["routing.static_beta"][s, i] for i in range(n)]
        if dynamic:
            for i, h in enumerate(streams):
                centred = h - h.mean(-1, keepdim=True)
                normed = centred / torch.sqrt(centred.pow(2).mean(-1, keepdim=True) + 1e-5)
                normed = normed * p["routing.norm_weight"][s] + p["routing.norm_bias"][s]
                for c in range(n + 1):
                    dynamic_alpha = torch.tanh(normed @ p["routing.dynamic_alpha"][s, :, c])
                    alpha[i][c] = p["routing.scale_alpha"][s] * dynamic_alpha.unsqueeze(-1) + alpha[i][c]
                dynamic_beta = torch.tanh(normed @ p["routing.dynamic_beta"][s])
                beta[i] = p["routing.scale_beta"][s] * dynamic_beta.unsqueeze(-1) + beta[i]
        out = f(sum(alpha[i][0] * streams[i] for i in range(n)))
        streams = [sum(alpha[i][c + 1] * streams[i] for i in range(n)) + beta[c] * out for c in range(n)]
    return head(model, sum(streams))


def sinkhorn_reference(logits: torch.Tensor, iters: int) -> torch.Tensor:
    """Row softmax + eps, columns / (sum + eps), then iters - 1 rounds of rows then columns."""
    m = logits.softmax(-1) + EPS
    m = m / (m.sum(-2, keepdim=True) + EPS)
    for _ in range(iters - 1):
        m = m / (m.sum(-1, keepdim=True) + EPS)
        m = m / (m.sum(-2, keepdim=True) + EPS)
    return m


def mhc_reference(model: Transformer, ids: torch.Tensor) -> torch.Tensor:
    """mHC's logits from the formula (Xie et al. 2025, DeepSeek-V4 hc_pre / hc_post / hc_head;
    issue 50): x = vec(H) = [H_1, ..., H_n]; r = 1/sqrt(mean(x^2) + eps); m = (x phi^T) r; pre =
    sigmoid(a_0 m[:n] + b[:n]) + eps; post = 2 sigmoid(a_1 m[n:2n] + b[n:2n]); comb = Sinkhorn(a_2
    m[2n:] + b[2n:]) as n x n; u = sum_j pre_j H_j; H'_k = post_k f(u) + sum_j comb[j, k] H_j; exit
    sum_j w_j H_j with w = sigmoid(a_h (x phi_h^T) r + b_h) + eps, or the mean of the streams."""
    p, args = dict(model.named_parameters()), model.args
    n = args.hyper_rate
    streams = [model.tok_embeddings(ids)] * n

    def projected(phi):
        x = torch.cat(streams, dim=-1)
        return (x @ phi.T) * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)

    for s, f in enumerate(sublayers(model, ids)):
        a, b = p["routing.scale"][s], p["routing.bias"][s]
        m = projected(p["routing.phi"][s])
        pre = torch.sigmoid(a[0] * m[..., :n] + b[:n]) + EPS
        post = 2 * torch.sigmoid(a[1] * m[..., n:2 * n] + b[n:2 * n])
        comb = sinkhorn_reference((a[2] * m[..., 2 * n:] + b[2 * n:]).reshape(*m.shape[:-1], n, n),
                                  args.mhc_sinkhorn_iters)
        out = f(sum(pre[..., j:j + 1] * streams[j] for j in range(n)))
        streams = [post[..., k:k + 1] * out + sum(comb[..., j, k:k + 1] * streams[j] for j in range(n))
                   for k in range(n)]
    if args.mhc_exit == "mean":
        return head(model, sum(streams) / n)
    w = torch.sigmoid(p["routing.head_scale"] * projected(p["routing.head_phi"]) + p["routing.head_bias"]) + EPS
    return head(model, sum(w[..., j:j + 1] * streams[j] for j in range(n)))


REFERENCES = {"hyper": hyper_reference, "mhc": mhc_reference}


def relative(value: torch.Tensor, reference: torch.Tensor) -> float:
    return ((value.double() - reference).abs().max() / reference.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("n_layers", [2, 4, 12])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_and_every_gradient_equal_the_formula_in_fp64(variant, n_layers, n):
    """Our model against the fp64 formula on the same weights: in fp32, logits and every parameter's
    gradient within 2e-4 relative (each tensor against its own largest entry); in fp64 within 1e-12
    (the same wiring: only rounding could differ)."""
    reference = build(variant, n_layers, n).double()
    ids = tokens()
    expected = REFERENCES[reference.args.residual](reference, ids)
    expected_grads = torch.autograd.grad(expected.logsumexp(-1).sum(), list(reference.parameters()))
    for dtype, rtol in ((torch.float32, 2e-4), (torch.float64, 1e-12)):
        model = build(variant, n_layers, n).to(dtype)
        logits = model(ids)
        assert relative(logits, expected) < rtol, dtype
        grads = torch.autograd.grad(logits.double().logsumexp(-1).sum(), list(model.parameters()))
        for (name, _), got, want in zip(model.named_parameters(), grads, expected_grads):
            assert relative(got, want) < rtol, (dtype, name)


def baseline_with_the_same_weights(model: Transformer) -> Transformer:
    """The pre-norm baseline holding `model`'s weights but for the connection's."""
    keys = {k for keys in CONNECTION_KEYS.values() for k in keys}
    fields = {k: v for k, v in dataclasses.asdict(model.args).items() if k not in keys}
    baseline = Transformer(ModelArgs(**{**fields, "residual": "standard"}))
    baseline.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("routing.")})
    return baseline


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("variant", ["hyper", "hyper static"])
def test_hyper_connections_at_initialisation_are_the_pre_norm_baseline(variant, n):
    """Same weights, connection parameters as initialised: every stream carries the pre-norm stream
    h, so the read-out is n h (within 1e-6 relative), and after the final norm the hidden states
    and the logits equal the baseline's within 5e-3 relative (the harness's bound). What remains
    there is the final RMSNorm's eps against mean((n h)^2) instead of mean(h^2): 4e-4 (n = 2) and
    5e-4 (n = 4) relative on these weights (N(0, 0.02^2), a small stream), 0 at n = 1."""
    model = build(variant, 6, n, random=False)
    baseline = baseline_with_the_same_weights(model)
    ids = tokens()
    with torch.no_grad():
        assert relative(model.hidden_states(ids), n * baseline.hidden_states(ids).double()) < 1e-6
        hidden, expected = model.norm(model.hidden_states(ids)), baseline.norm(baseline.hidden_states(ids))
        assert relative(hidden, expected.double()) < 5e-3
        assert relative(model(ids), baseline(ids).double()) < 5e-3
        if n == 1:
            assert relative(hidden, expected.double()) < 1e-6


def test_mhc_at_initialisation_is_near_but_not_at_the_pre_norm_baseline():
    """mhc_init = "zero" (b = 0, a = 0.01): the hidden states after the final norm are within 2% of
    the baseline's, and not equal to them (pre, post and the exit's weights move with a m per token:
    0.33% at 6 layers, 0.86% at 24, measured); "prenorm" (b_pre = b_h = logit(1/n), b_res = 10 I)
    starts as far (0.31%, 0.78%): the gap is post's and the exit's a m terms, not pre's or comb's."""
    ids = tokens()
    differences = {}
    for init in ("zero", "prenorm"):
        model = build("mhc", 6, random=False, mhc_init=init)
        baseline = baseline_with_the_same_weights(model)
        with torch.no_grad():
            hidden = model.norm(model.hidden_states(ids))
            differences[init] = relative(hidden, baseline.norm(baseline.hidden_states(ids)).double())
    assert 1e-5 < differences["zero"] < 2e-2 and 1e-5 < differences["prenorm"] < 2e-2, differences


def sites_seen(model: Transformer, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every mixing weight the observer sees in one forward, by name."""
    seen = {}
    with model.observe_routing(lambda name, weights: seen.__setitem__(name, weights)), torch.no_grad():
        model(ids)
    return seen


def train(model: Transformer, steps: int, lr: float = 1e-2) -> None:
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    ids = tokens(12)
    for _ in range(steps):
        optimizer.zero_grad()
        model(ids[:, :-1], ids[:, 1:]).backward()
        optimizer.step()


@pytest.mark.parametrize("n", [2, 4])
def test_mhc_comb_is_doubly_stochastic_at_every_site_after_a_training_step(n):
    """From initialisation, after one AdamW step, every site's comb (B, T, n, n) has row and column
    sums within 1e-3 of 1, and the observer sees pre, post and comb at each of the 2L sites and the
    exit's weights. With trained-like mappings (`build`: comb entries from 0.003 to 0.98) the column
    sums stay within 1e-5 of 1 (the iterations end on the columns), while 20 iterations leave the
    row sums up to 8e-3 off (measured): Sinkhorn converges slowly towards a permutation."""
    model = build("mhc", 4, n, random=False)
    train(model, 1)
    seen = sites_seen(model, tokens())
    assert set(seen) == {f"site {s} {w}" for s in range(8) for w in ("pre", "post", "comb")} | {"exit"}
    for s in range(8):
        comb = seen[f"site {s} comb"]
        assert comb.shape == (2, 10, n, n) and comb.dtype == torch.float32
        assert (comb.sum(-1) - 1).abs().max() < 1e-3, s
        assert (comb.sum(-2) - 1).abs().max() < 1e-3, s
        assert (seen[f"site {s} pre"] > 0).all() and (seen[f"site {s} post"] < 2).all()
    trained_like = sites_seen(build("mhc", 4, n), tokens())
    for s in range(8):
        assert (trained_like[f"site {s} comb"].sum(-2) - 1).abs().max() < 1e-5, s


def comb_logit_grads(model: Transformer, monkeypatch) -> list[torch.Tensor]:
    """The gradient reaching each site's comb logits (the Sinkhorn's input) in one backward."""
    grads, real = [], mhc_module.sinkhorn

    def spy(logits, iters, eps=EPS):
        logits.register_hook(grads.append)
        return real(logits, iters, eps)

    monkeypatch.setattr(mhc_module, "sinkhorn", spy)
    ids = tokens(12)
    model(ids[:, :-1], ids[:, 1:]).backward()
    monkeypatch.setattr(mhc_module, "sinkhorn", real)
    return grads[::-1]  # the hooks run in backward order


@pytest.mark.parametrize("init", ["zero", "prenorm"])
def test_mhc_comb_logits_get_a_gradient_at_initialisation_and_after_ten_steps(init, monkeypatch):
    """The underflow failure (Sinkhorn's exp of logits far apart is 0, and the routing parameters
    get exactly zero gradient): at initialisation and after 10 AdamW steps every site but the first
    gets a non-zero, finite gradient on its comb logits, and so do its b_res and phi's comb rows.
    The first site's comb never learns, by construction: its n input streams are copies of the
    embedding, which any column-stochastic comb leaves unchanged (its gradient is below 1e-4 of the
    others', rounding and eps)."""
    model = build("mhc", 4, random=False, mhc_init=init)
    for step in (0, 10):
        train(model, step)
        model.zero_grad()
        grads = comb_logit_grads(model, monkeypatch)
        largest = [g.abs().max().item() for g in grads]
        assert len(grads) == 8 and all(torch.isfinite(g).all() for g in grads)
        assert min(largest[1:]) > 0, (step, largest)
        assert largest[0] < 1e-4 * max(largest[1:]), (step, largest)
        assert model.routing.bias.grad[1:, 8:].abs().amax(-1).min() > 0, step
        assert model.routing.phi.grad[1:, 8:].abs().amax((-1, -2)).min() > 0, step


def test_mhc_residual_mixing_is_applied(monkeypatch):
    """Replacing comb by the identity (the bug two public ports shared: the residual mix never
    applied) changes the logits: the model mixes its streams with comb."""
    model = build("mhc", 4)
    ids = tokens()
    with torch.no_grad():
        mixed = model(ids)
        monkeypatch.setattr(mhc_module, "sinkhorn", lambda logits, iters, eps=EPS: torch.eye(
            logits.shape[-1], dtype=logits.dtype).expand(logits.shape))
        unmixed = model(ids)
    assert relative(unmixed, mixed.double()) > 1e-3


@pytest.mark.parametrize("mask", ["causal", "block_causal"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_token_changes_no_earlier_logits(variant, mask):
    """Perturbing token t leaves the logits before t unchanged (with document masks too)."""
    model = build(variant, 4, attn_mask_type=mask)
    assert_causal(model)


OTHERS = {"dense": dict(residual="dense"), "mudd": dict(residual="mudd"),
          "mudd plain": dict(residual="mudd", mudd_prepost_norm=False)}
"""DenseFormer and MUDDFormer, for the AC and compile checks of the depth connections (issue 49)."""


def any_connection(name: str, n_layers: int = 3) -> Transformer:
    """A `build` model of `VARIANTS`, or DenseFormer / MUDDFormer with every connection parameter
    moved by N(0, 0.05^2) off its initialisation."""
    if name in VARIANTS:
        return build(name, n_layers)
    torch.manual_seed(0)
    model = Transformer(ModelArgs(**SHAPE, n_layers=n_layers, **OTHERS[name]))
    model.init_weights()
    with torch.no_grad():
        for p in model.routing.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    return model


def loss_and_grads(model: Transformer, ids: torch.Tensor):
    loss = model(ids[:, :-1], ids[:, 1:])
    loss.backward()
    clean = lambda name: name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")  # noqa: E731
    return loss.detach(), {clean(n): p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", [*VARIANTS, *OTHERS])
def test_full_activation_checkpointing_equals_none_bit_for_bit(name):
    """AC full (every block re-run in the backward from its input, the n-stream state) gives the
    same loss and every gradient as AC none, bit for bit."""
    ids = tokens(12)
    loss, grads = loss_and_grads(any_connection(name), ids)
    model = any_connection(name)
    assert apply_ac(model, SimpleNamespace(mode="full", selective_ac_option="1", preserve_rng_state=False)) == 3
    ac_loss, ac_grads = loss_and_grads(model, ids)
    assert torch.equal(ac_loss, loss)
    assert ac_grads.keys() == grads.keys()
    assert all(torch.equal(ac_grads[k], grads[k]) for k in grads), [k for k in grads if not torch.equal(ac_grads[k],
                                                                                                         grads[k])]


@pytest.mark.parametrize("name", [*VARIANTS, "dense", "mudd", pytest.param("mudd plain", marks=pytest.mark.slow)])
def test_per_block_fullgraph_compile_equals_eager(name):  # mudd plain: 44 s on 2 cores, measured
    """Every block compiled with fullgraph=True (as parallel.apply_compile does; aot_eager on CPU):
    the loss and every gradient within 1e-5 relative of the eager model's (the Sinkhorn and the
    projection's autograd Functions and the autocast switch trace without a graph break)."""
    ids = tokens(12)
    loss, grads = loss_and_grads(any_connection(name), ids)
    model = any_connection(name)
    _raise_recompile_limits(len(model.layers))
    for i, block in enumerate(model.layers):
        model.layers[i] = torch.compile(block, fullgraph=True, backend="aot_eager")
    model.compiled_blocks = True
    compiled_loss, compiled_grads = loss_and_grads(model, ids)
    assert relative(compiled_loss, loss.double()) < 1e-5
    assert compiled_grads.keys() == grads.keys()
    for k, grad in grads.items():
        assert relative(compiled_grads[k], grad.double()) < 1e-5, k


class MatmulDtypes(TorchDispatchMode):
    """Records (output's last dimension, input dtypes) of every matrix product run under it."""

    PRODUCTS = {torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default}

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self.PRODUCTS:
            self.seen.append((out.shape[-1], tuple(a.dtype for a in args if isinstance(a, torch.Tensor))))
        return out


@pytest.mark.parametrize("precision", ["bf16 model", "bf16 autocast"])
def test_mhc_mapping_stays_in_fp32_under_bf16(precision):
    """A bf16 model (FSDP2's bf16 parameters) and an fp32 model under bf16 autocast: every site's
    projection (output n^2 + 2n = 24 wide) and the exit's (n = 4) multiply fp32 operands in the
    forward and the backward, pre, post and comb come out in fp32, while the sublayers and the
    mixing (the stream products) run in bf16; the parameters' gradients keep their dtypes."""
    model = build("mhc", 2)
    if precision == "bf16 model":
        model = model.to(torch.bfloat16)
    seen_weights = {}
    ids = tokens(12)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16 autocast")
    with MatmulDtypes() as products, autocast, model.observe_routing(
            lambda name, weights: seen_weights.__setitem__(name, weights)):
        loss = model(ids[:, :-1], ids[:, 1:])
    with MatmulDtypes() as backward_products:
        loss.backward()
    assert {w.dtype for w in seen_weights.values()} == {torch.float32} and len(seen_weights) == 13
    mapping = [dtypes for width, dtypes in products.seen if width in (24, 4)]
    assert len(mapping) == 5 and all(set(d) == {torch.float32} for d in mapping), mapping
    others = [dtypes for width, dtypes in products.seen if width not in (24, 4)]
    assert others and all(set(d) == {torch.bfloat16} for d in others), others
    assert any(width in (24, 4 * 32) and set(d) == {torch.float32} for width, d in backward_products.seen)
    parameter_dtype = torch.bfloat16 if precision == "bf16 model" else torch.float32
    assert all(p.grad.dtype == parameter_dtype for p in model.routing.parameters())


def test_sinkhorn_and_the_projection_have_the_gradients_of_their_formulas():
    """torch.autograd.gradcheck (fp64) of the Sinkhorn Function against finite differences, and its
    gradient against autograd through the plain iterations; its forward keeps only the logits (not
    the 2 x iters - 1 intermediate matrices); the projection's gradient against autograd of
    (x phi^T) / sqrt(mean(x^2) + eps)."""
    generator = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(5, 4, 4, generator=generator, dtype=torch.float64)).requires_grad_()
    assert torch.autograd.gradcheck(lambda x: mhc_module.sinkhorn(x, 20), (logits,))
    direction = torch.randn(5, 4, 4, generator=generator, dtype=torch.float64)
    got = torch.autograd.grad((mhc_module.sinkhorn(logits, 20) * direction).sum(), logits)[0]
    want = torch.autograd.grad((sinkhorn_reference(logits, 20) * direction).sum(), logits)[0]
    assert relative(got, want) < 1e-12
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        mhc_module.sinkhorn(logits, 20)
    assert saved == [logits.shape]
    x = torch.randn(3, 7, 32, generator=generator, dtype=torch.float64, requires_grad=True)
    phi = torch.randn(24, 32, generator=generator, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, phi: mhc_module.RmsProjection.apply(x, phi, EPS), (x, phi))


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("n_layers", [1, 2, 5, 24])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_parameter_counts_follow_the_formulas(variant, n_layers, n):
    """Hyper-Connections per site n(n+2) static, plus d(n+2) + 2d + 2 dynamic; mHC per site
    (n^2+2n) nd + n^2 + 2n + 3 (96d + 27 at n = 4), plus the learned exit's n nd + n + 1."""
    args = ModelArgs(**SHAPE, n_layers=n_layers, hyper_rate=n, **VARIANTS[variant])
    with torch.device("meta"):
        model = Transformer(args)
    assert sum(p.numel() for p in model.parameters()) == count_parameters(args).total
    d, sites = args.dim, 2 * n_layers
    if args.residual == "hyper":
        expected = sites * (n * (n + 2) + (d * (n + 2) + 2 * d + 2 if args.hyper_dynamic else 0))
    else:
        expected = sites * ((n * n + 2 * n) * n * d + n * n + 2 * n + 3)
        if n == 4:
            assert expected == sites * (96 * d + 27)
        expected += n * n * d + n + 1 if args.mhc_exit == "learned" else 0
    assert connection_parameters(args) == expected
    assert sum(p.numel() for p in model.routing.parameters()) == expected


def test_the_keys_are_checked_before_the_model_is_built():
    """Each key needs its connection (hyper_rate either multi-stream one), named in one line."""
    with pytest.raises(ValueError, match=r"hyper_rate=2 configures residual='hyper' or 'mhc', not residual='dense'"):
        ModelArgs(residual="dense", hyper_rate=2)
    with pytest.raises(ValueError, match=r"mhc_exit='mean' configures residual='mhc', not residual='hyper'"):
        ModelArgs(residual="hyper", mhc_exit="mean")
    with pytest.raises(ValueError, match=r"unknown mhc_exit 'head'"):
        ModelArgs(residual="mhc", mhc_exit="head")
    with pytest.raises(ValueError, match=r"mhc_res_bias=5.0 is the residual-mixing bias of mhc_init='prenorm'"):
        ModelArgs(residual="mhc", mhc_res_bias=5.0)
    with pytest.raises(ValueError, match=r"needs hyper_rate >= 2"):
        ModelArgs(residual="mhc", mhc_init="prenorm", hyper_rate=1)
    with pytest.raises(ValueError, match=r"ModelArgs.hyper_rate must be a positive integer"):
        ModelArgs(residual="hyper", hyper_rate=0)
    assert ModelArgs(residual="mhc", hyper_rate=2, mhc_init="prenorm", mhc_res_bias=5.0).hyper_rate == 2


class ActivationReads(TorchDispatchMode):
    """Rows of d read per token by every op run under it (its tensor inputs, views excepted) of the
    activations of a (B, T) batch: tensors of at least B T d elements, a multiple of B T (B T = 111
    divides no parameter of these models)."""

    SKIPPED = {torch.ops.aten.detach.default, torch.ops.aten._unsafe_view.default}

    def __init__(self, tokens: int, dim: int):
        super().__init__()
        self.tokens, self.dim, self.rows = tokens, dim, 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func not in self.SKIPPED:
            for a in torch.utils._pytree.tree_leaves((args, kwargs)):
                if isinstance(a, torch.Tensor) and a.is_floating_point() and a.numel() % self.tokens == 0 \
                        and a.numel() >= self.tokens * self.dim:
                    self.rows += a.numel() / (self.tokens * self.dim)
        return func(*args, **(kwargs or {}))


COST_SHAPE = dict(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=128, max_seq_len=64)


def counted_step(fields: dict, ac: str = "none") -> dict:
    """One eager training step of a (3, 37) batch: the activation rows (of d, per token) its forward
    and backward read (`ActivationReads`), the rows saved for the backward (distinct storages, by
    saved-tensor hooks, under AC `ac`) and the matrix products' forward FLOPs per token."""
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    model = Transformer(ModelArgs(**COST_SHAPE, **fields))
    model.init_weights()
    apply_ac(model, SimpleNamespace(mode=ac, selective_ac_option="1", preserve_rng_state=False))
    B, T, d = 3, 37, COST_SHAPE["dim"]
    ids = torch.randint(0, 128, (B, T), generator=torch.Generator().manual_seed(0))
    saved = {}

    def keep(t):
        if t.is_floating_point() and t.numel() % (B * T) == 0 and t.numel() >= B * T * d:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes() / t.element_size() / (B * T * d)
        return t

    with FlopCounterMode(display=False) as flops:
        model(ids)
    with ActivationReads(B * T, d) as forward, torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        loss = model(ids, ids)
    with ActivationReads(B * T, d) as backward:
        loss.backward()
    return dict(forward=forward.rows, backward=backward.rows, kept=sum(saved.values()),
                flops=flops.get_total_flops() / (B * T))


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_cost_hooks_count_what_the_eager_step_reads_keeps_and_multiplies(variant, n):
    """depth_reads: the activation rows the eager forward and backward read beyond the baseline's,
    within 5% (a dispatch-mode count of every op's inputs); kept_rows: the rows saved for the
    backward beyond the baseline's under AC none and full, within 5%; flops_per_token: its matrix
    products equal the FLOPs torch's counter sees beyond the baseline's (the rest, elementwise, is the
    write's 2nd per site, r's 2nd, the Sinkhorn's n^2 (4 + 2 (2 iters - 1)) and the read-outs')."""
    fields = dict(VARIANTS[variant], hyper_rate=n)
    connection = build_connection(ModelArgs(**COST_SHAPE, **fields))
    ours, baseline = counted_step(fields), counted_step({})
    forward, backward = connection.depth_reads()
    assert forward == pytest.approx(ours["forward"] - baseline["forward"], rel=0.05)
    assert backward == pytest.approx(ours["backward"] - baseline["backward"], rel=0.05)
    assert connection.kept_rows("none") == pytest.approx(ours["kept"] - baseline["kept"], rel=0.05)
    full, baseline_full = counted_step(fields, "full"), counted_step({}, "full")
    assert connection.kept_rows("full") == pytest.approx(full["kept"] - baseline_full["kept"], rel=0.05)
    d, S = COST_SHAPE["dim"], 2 * COST_SHAPE["n_layers"]
    if fields["residual"] == "hyper":
        elementwise = S * 2 * n * d + (n - 1) * d
    else:
        iters, learned = 20, fields.get("mhc_exit", "learned") == "learned"
        elementwise = S * (4 * n * d + n * n * (4 + 2 * (2 * iters - 1))) + (2 * n * d if learned else n * d)
    assert connection.flops_per_token() - elementwise == ours["flops"] - baseline["flops"]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_connection_parameters_are_routing_never_decayed_never_muon(variant):
    """Every parameter of Hyper-Connections and mHC is in the routing group, which Muon never takes,
    and in an AdamW group without weight decay under AdamW and under Muon (the harness's choice:
    decay pulls the mixing towards none, and HC's static alpha and beta towards 0); the blocks'
    matrices are still decayed."""
    from mhar_titan.config.sections import Optimizer
    from mhar_titan.optim import build_optimizer, param_group_of
    from mhar_titan.optim.build import optimizer_split

    model = build(variant, 2)
    connection = {f"routing.{n}" for n, _ in model.routing.named_parameters()}
    assert {param_group_of(model)[n] for n in connection} == {"routing"}
    decayed = {id(p) for p in model.parameters() if p.dim() == 2 and p is not model.tok_embeddings.weight}
    by_id = {id(p): n for n, p in model.named_parameters()}
    for cfg in (Optimizer(weight_decay=0.1), Optimizer(name="Muon", weight_decay=0.1, muon_groups=["other"])):
        optimizer = build_optimizer(model, cfg)
        groups = [g for opt in getattr(optimizer, "optimizers", [optimizer]) for g in opt.param_groups]
        decay_of = {by_id[id(p)]: g["weight_decay"] for g in groups for p in g["params"]}
        assert all(decay_of[n] == 0.0 for n in connection)
        assert any(decay_of[by_id[i]] == 0.1 for i in decayed)
        assert not connection & dict(optimizer_split(model, cfg)["Muon"]).keys()
