"""Routing statistics and heatmaps: the recorder against the model's own routing weights,
uniform routing at init, and PNG pixels decoded back to the plotted mean weights."""
import math

import numpy as np
import pytest
import torch

from helpers import assert_not_blank, decode_heatmap_cell, random_tokens, read_png, site_sources, tiny_model

from mhar_titan.analysis.heatmap import plot_routing_heatmaps, routing_report
from mhar_titan.analysis.plots import pyplot
from mhar_titan.analysis.routing import RoutingRecorder, routing_entropy, routing_summary
from mhar_kernels.reference import route_reference

FAMILIES = {
    "attn_res H=1": dict(residual="attn_res", routing_heads=1),
    "mhar H=8": dict(residual="attn_res", routing_heads=8),
    "block": dict(residual="attn_res", routing_heads=4, routing_granularity="block", routing_block_layers=1),
    "delta+null": dict(residual="attn_res", routing_heads=2, routing_mode="delta", routing_null_source=True),
}


def model_weights(model, x):
    """Per-site weights (N, B, T, H) returned by the model's reference routing for batch x."""
    trace = []
    with torch.no_grad():
        trace.extend(site_sources(model, x))
        return [route_reference(sources, model.routing.query[s], model.routing.key_norm[s],
                                model.args.resolved_routing_heads, model.args.routing_eps, return_weights=True)[1]
                for s, sources in enumerate(trace)]


@pytest.mark.parametrize("family", FAMILIES)
def test_fresh_model_routes_uniformly_and_heatmap_means_are_one_over_n(family, tmp_path):
    model = tiny_model(**FAMILIES[family])
    x = random_tokens()
    recorder = RoutingRecorder(model, keep_weights=True)
    with torch.no_grad(), model.observe_routing(recorder):
        model.hidden_states(x)
    summary = recorder.summary()
    assert len(summary.sites) == model.args.n_routing_sites
    for site, w in zip(summary.sites, recorder.weights):
        n = w.shape[0]
        assert torch.equal(w, torch.full_like(w, 1.0 / n))  # fl(1/N) for every token and head
        assert site.n_sources == n and site.tokens == x.numel()
        assert np.abs(site.mean_weights.numpy() - 1.0 / n).max() < 1e-6
        assert site.entropy == pytest.approx(math.log(n), abs=1e-6)
        assert site.effective_sources == pytest.approx(n, rel=1e-6)
    heat = plot_routing_heatmaps(summary, tmp_path / "fresh.png")
    n_of_site = np.array([site.n_sources for site in summary.sites], dtype=np.float64)[:, None]
    for name, array in heat.panels.items():
        filled = ~np.isnan(array)
        assert (filled.sum(1) == n_of_site[:, 0]).all()
        assert np.abs(np.where(filled, array, 0.0)).max() < 1e-6, name  # log2(w N) = 0: uniform
    assert heat.heads_agree and len(heat.panels) == 1  # identical heads are collapsed into one panel
    # uniform routing is drawn in the colour map's neutral middle colour
    pixels = read_png(heat.path)
    neutral = np.array(pyplot().get_cmap(heat.cmap)(0.5)[:3])
    name = next(iter(heat.panels))
    x, y = heat.axes[name].transData.transform((0, len(summary.sites) - 1))
    assert np.abs(pixels[int(round(pixels.shape[0] - y)), int(round(x))] - neutral).max() < 2 / 255
    pyplot().close(heat.figure)


def test_heatmap_fonts_are_readable_at_column_width(tmp_path):
    model = tiny_model(random_queries=True, residual="attn_res", routing_heads=4, n_layers=6)
    heat = plot_routing_heatmaps(routing_summary(model, [random_tokens()]), tmp_path / "h.png", title="t")
    width = heat.figure.get_size_inches()[0]
    assert width <= 3.5 + 1e-9 and not heat.heads_agree and len(heat.panels) == 5
    texts = [t for ax in heat.figure.axes for t in (*ax.get_xticklabels(), *ax.get_yticklabels(), ax.title,
                                                     ax.xaxis.label, ax.yaxis.label) if t.get_text()]
    texts += [t for ax in heat.figure.axes if ax.get_legend() for t in ax.get_legend().get_texts()]
    assert len(texts) > 40 and min(t.get_fontsize() for t in texts) * 3.5 / width >= 8
    pyplot().close(heat.figure)


@pytest.mark.parametrize("family", ["attn_res H=1", "mhar H=8", "delta+null"])
def test_recorder_means_and_entropy_equal_the_models_weights(family):
    model = tiny_model(random_queries=True, **FAMILIES[family])
    batches = [random_tokens(seed=1), random_tokens(seed=2)]
    summary = routing_summary(model, batches)
    weights = [torch.cat(ws, dim=1) for ws in zip(*(model_weights(model, x) for x in batches))]
    for site, w in zip(summary.sites, weights):
        assert torch.allclose(site.mean_weights, w.double().mean((1, 2)).T, rtol=0, atol=1e-12)
        ent = -(w.double() * w.double().clamp_min(1e-300).log()).sum(0).mean().item()
        assert site.entropy == pytest.approx(ent, abs=1e-6)
    assert max(abs(site.mean_weights.sum(1) - 1).max().item() for site in summary.sites) < 1e-6  # float32 softmax
    # random queries route far from uniform: entropy below log N on the last site
    assert summary.sites[-1].entropy < math.log(summary.sites[-1].n_sources) - 0.05
    report = routing_report(summary, "tiny")
    assert report.count("\n| L") == 2 * model.args.n_layers and "| final |" in report


def test_routing_entropy_metric_runs_through_the_forward():
    model = tiny_model(random_queries=True, residual="attn_res", routing_heads=4)
    x = random_tokens(batch=1)
    expected = routing_summary(model, [x]).mean_entropy()
    assert routing_entropy(model, x) == pytest.approx(expected, rel=1e-12)
    fresh = tiny_model(residual="attn_res", routing_heads=4)
    n_sources = range(1, 2 * fresh.args.n_layers + 2)
    assert routing_entropy(fresh, x) == pytest.approx(sum(map(math.log, n_sources)) / len(n_sources), rel=1e-6)
    assert routing_entropy(tiny_model(), x) is None  # the baseline has no routing
    with pytest.raises(ValueError, match="no depth routing"):
        RoutingRecorder(tiny_model())


def test_heatmap_png_pixels_decode_to_the_mean_weights(tmp_path):
    model = tiny_model(random_queries=True, residual="attn_res", routing_heads=2)
    x = random_tokens()
    summary = routing_summary(model, [x])
    heat = plot_routing_heatmaps(summary, tmp_path / "heat.png", title="tiny")
    assert_not_blank(heat.path)
    pixels = read_png(heat.path)
    weights = model_weights(model, x)
    step = (heat.vmax - heat.vmin) / (pyplot().get_cmap(heat.cmap).N - 1)
    assert not heat.heads_agree and set(heat.panels) == {"mean over heads", "head 0", "head 1"}
    for name in heat.panels:
        for row, w in enumerate(weights):
            per_head = w.double().mean((1, 2)).T.numpy()  # (H, N)
            mean = per_head.mean(0) if name.startswith("mean") else per_head[int(name.split()[-1])]
            expected = np.log2(mean * w.shape[0])  # relative to uniform 1/N
            assert np.allclose(heat.panels[name][row, :w.shape[0]], expected, rtol=0, atol=1e-9)
            assert np.isnan(heat.panels[name][row, w.shape[0]:]).all()
            for col, value in enumerate(expected):
                got = decode_heatmap_cell(pixels, heat, name, row, col)
                assert abs(got - np.clip(value, heat.vmin, heat.vmax)) <= 3 * step, (name, row, col, got, value)
    pyplot().close(heat.figure)


def test_heatmap_columns_are_the_models_sources():
    labels = {family: routing_summary(m, [random_tokens()]).column_labels()
              for family, m in ((f, tiny_model(random_queries=True, **FAMILIES[f])) for f in FAMILIES)}
    assert labels["mhar H=8"] == ["emb", "a0", "m0", "a1", "m1"]
    assert labels["delta+null"] == ["null", "emb", "a0", "m0", "a1", "m1"]
    # one-layer blocks: the completed block n is the partial sum after layer n-1's MLP, read by the
    # next layer; the MLP site of layer i reads the open block's partial after a_i
    assert labels["block"] == ["emb", "b1~a0", "b1~m0", "b2~a1", "b2~m1"]
    model = tiny_model(random_queries=True, **FAMILIES["block"])
    summary = routing_summary(model, [random_tokens()])
    weights = summary.mean_weights()
    for s, site in enumerate(model.plan.sites):
        read = ~torch.isnan(weights[0, s])
        assert [summary.columns()[c] for c in read.nonzero()[:, 0].tolist()] == list(site.reads)
        assert torch.allclose(weights[:, s, read], summary.sites[s].mean_weights)
