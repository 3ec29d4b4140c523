"""The query probe (MHAR_SPEC 3.3): zero when every slice agrees, positive when slices disagree,
equal to the KL written out by hand, and the model-level probe with its random reference."""

import numpy as np
import pytest
import torch

from helpers import random_tokens, site_sources, tiny_model

from mhar_titan.analysis.probe import query_probe, slice_kl

S = 4


def repeated(piece: torch.Tensor) -> torch.Tensor:
    """S identical contiguous copies of ``piece`` along the last dim."""
    return torch.cat([piece] * S, dim=-1)


def test_identical_slices_give_zero_kl_in_float64():
    g = torch.Generator().manual_seed(0)
    sources = [repeated(torch.randn(2, 5, 8, generator=g, dtype=torch.float64)) for _ in range(6)]
    query = repeated(3 * torch.randn(8, generator=g, dtype=torch.float64))
    norm_weight = repeated(torch.rand(8, generator=g, dtype=torch.float64) + 0.5)
    kl = slice_kl(sources, query, norm_weight, slices=S)
    assert kl.shape == (2, 5, S) and kl.dtype == torch.float64
    assert kl.abs().max().item() < 1e-9
    # the distributions are far from uniform, so zero KL is agreement, not flatness
    logits = torch.stack([(query * s / s.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() * norm_weight).sum(-1)
                          for s in sources])
    assert torch.softmax(logits, 0).max().item() > 0.5


def test_disagreeing_slices_give_the_hand_computed_positive_kl():
    # two sources, d = 4, S = 2 slices: slice 0 of the query reads dim 0, slice 1 reads dim 2;
    # source 0 is large on dim 0, source 1 on dim 2, so slice 0 prefers source 0, slice 1 source 1.
    s0 = torch.tensor([[[2.0, 0.0, 0.1, 0.0]]], dtype=torch.float64)
    s1 = torch.tensor([[[0.1, 0.0, 2.0, 0.0]]], dtype=torch.float64)
    query = torch.tensor([3.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    g = torch.ones(4, dtype=torch.float64)
    kl = slice_kl([s0, s1], query, g, slices=2)
    # by hand: keys = s / rms(s), z = <q, k>, partial z_j over dims [0, 1] and [2, 3]
    keys = [s[0, 0].numpy() / np.sqrt((s[0, 0].numpy() ** 2).mean() + 1e-6) for s in (s0, s1)]
    q = query.numpy()
    z = np.array([q @ k for k in keys])
    parts = np.array([[q[:2] @ k[:2], q[2:] @ k[2:]] for k in keys])  # (N, S)
    p = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
    expected = []
    for j in range(2):
        zj = 2 * parts[:, j]
        pj = np.exp(zj - zj.max()) / np.exp(zj - zj.max()).sum()
        expected.append((p * (np.log(p) - np.log(pj))).sum())
    assert kl[0, 0].numpy() == pytest.approx(expected, rel=1e-12)
    assert kl.mean().item() > 0.5  # clearly positive
    assert np.argmax(parts[:, 0]) == 0 and np.argmax(parts[:, 1]) == 1


def test_slices_must_divide_d():
    x = [torch.randn(1, 2, 6), torch.randn(1, 2, 6)]
    with pytest.raises(ValueError, match="multiple of slices"):
        slice_kl(x, torch.randn(6), torch.ones(6), slices=4)


def test_model_probe_learned_vs_random_reference():
    model = tiny_model(random_queries=True, residual="attn_res", routing_heads=1)
    batches = [random_tokens(seed=3)]
    result = query_probe(model, batches, slices=S, draws=3, seed=7)
    assert result.sites == 2 * model.args.n_layers  # every site but the first (one source)
    assert result.tokens == batches[0].numel()
    assert result.raw_kl > 0 and result.random_kl > 0
    assert result.excess_kl == pytest.approx(result.raw_kl - result.random_kl)
    again = query_probe(model, batches, slices=S, draws=3, seed=7)
    assert (again.raw_kl, again.random_kl) == (result.raw_kl, result.random_kl)  # fixed seeds
    assert query_probe(model, batches, slices=S, draws=3, seed=8).random_kl != result.random_kl
    # the raw number is the mean of slice_kl over probed sites, slices and tokens
    trace = []
    with torch.no_grad():
        trace.extend(site_sources(model, batches[0]))
        kls = [slice_kl(src, model.routing.query[s], model.routing.key_norm[s], S) for s, src in enumerate(trace)
               if len(src) > 1]
    assert result.raw_kl == pytest.approx(torch.stack(kls).double().mean().item(), rel=1e-6)
    probed = [s for s, src in enumerate(trace) if len(src) > 1]
    assert [site for site, _, _ in result.per_site] == probed
    for (site, learned, _), kl in zip(result.per_site, kls):
        assert learned == pytest.approx(kl.double().mean().item(), rel=1e-6)
    assert sum(r for _, _, r in result.per_site) / len(probed) == pytest.approx(result.random_kl, rel=1e-6)
    # fresh zero queries: every slice gives the uniform distribution, and so does the random
    # reference (queries of norm 0)
    fresh = query_probe(tiny_model(residual="attn_res", routing_heads=1), batches)
    assert fresh.raw_kl == 0 and fresh.random_kl == 0
    assert "learned-excess KL" in result.report("probe")


def test_probe_refuses_multi_head_and_baseline_models():
    for kwargs in (dict(residual="attn_res", routing_heads=4), dict()):
        model = tiny_model(**kwargs)
        with pytest.raises(ValueError, match="single-head"):
            query_probe(model, [random_tokens()])


def test_probe_figure_shows_learned_against_random_per_site_at_column_width(tmp_path):
    from matplotlib.text import Text

    from mhar_titan.analysis.plots import pyplot
    from mhar_titan.analysis.probe import plot_probe

    model = tiny_model(random_queries=True, residual="attn_res", routing_heads=1)
    result = query_probe(model, [random_tokens(seed=3)], slices=S, draws=3, seed=1)
    fig = plot_probe(result, model.args.n_routing_sites, tmp_path / "probe.png")
    ax, = fig.axes
    draws, random, learned = ax.lines
    assert list(learned.get_ydata()) == [kl for _, kl, _ in result.per_site]
    assert list(random.get_ydata()) == [kl for _, _, kl in result.per_site]
    # the spread of the random draws: every draw's value per site, and their range as a band
    assert len(result.site_draws) == len(result.per_site) and all(len(d) == 3 for d in result.site_draws)
    for (_, _, mean), per_draw in zip(result.per_site, result.site_draws):
        assert sum(per_draw) / 3 == pytest.approx(mean, rel=1e-12) and max(per_draw) > min(per_draw)
    assert list(draws.get_ydata()) == [v for d in result.site_draws for v in d]
    assert list(draws.get_xdata()) == [i for i, d in enumerate(result.site_draws) for _ in d]
    band, = ax.collections
    (path,) = band.get_paths()
    top = {round(x, 9): y for x, y in path.vertices}
    for i, per_draw in enumerate(result.site_draws):
        assert min(per_draw) - 1e-12 <= top[i] <= max(per_draw) + 1e-12
    ys = path.vertices[:, 1]
    assert ys.min() == pytest.approx(min(min(d) for d in result.site_draws))
    assert ys.max() == pytest.approx(max(max(d) for d in result.site_draws))
    assert sum(result.random_draws) / 3 == pytest.approx(result.random_kl, rel=1e-12)
    report = result.report("tiny")
    assert f"{min(result.random_draws):.4f} to {max(result.random_draws):.4f}" in report
    # labels, legend, fonts at column width
    assert [t.get_text() for t in ax.get_xticklabels()] == ["L0.mlp", "L1.attn", "L1.mlp", "final"]
    assert ax.get_xlabel() == "routing site" and ax.get_ylabel() == "KL(p || p_j), nats"
    legend, = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == ["learned query", "range of the 3 draws", "each random draw",
                                                         "random query, mean"]
    width = fig.get_size_inches()[0]
    texts = [t for t in fig.findobj(Text) if t.get_visible() and t.get_text()]
    assert width <= 3.5 + 1e-9 and len(texts) > 10 and min(t.get_fontsize() for t in texts) >= 8
    assert (tmp_path / "probe.png").stat().st_size > 10_000
    pyplot().close(fig)
