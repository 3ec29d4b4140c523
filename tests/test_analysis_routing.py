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
    assert heat.heads_path is None and heat.heads_figure is None and sorted(tmp_path.iterdir()) == [heat.path]
    # uniform routing is drawn in the colour map's neutral middle colour
    pixels = read_png(heat.path)
    neutral = np.array(pyplot().get_cmap(heat.cmap)(0.5)[:3])
    name = next(iter(heat.panels))
    x, y = heat.axes[name].transData.transform((0, len(summary.sites) - 1))
    assert np.abs(pixels[int(round(pixels.shape[0] - y)), int(round(x))] - neutral).max() < 2 / 255
    pyplot().close(heat.figure)


def _texts(figure):
    """Every visible, non-empty text of a figure (ticks, titles, labels, legends, colour bars)."""
    from matplotlib.text import Text

    return [t for t in figure.findobj(Text) if t.get_visible() and t.get_text()]


def test_heatmap_mean_fits_a_column_and_the_heads_get_a_compact_grid(tmp_path):
    model = tiny_model(random_queries=True, residual="attn_res", routing_heads=8, n_layers=6)
    heat = plot_routing_heatmaps(routing_summary(model, [random_tokens()]), tmp_path / "h.png", title="t")
    assert not heat.heads_agree and len(heat.panels) == 9
    # the mean over heads: a column-sized square with one heatmap, its side panel and one colour bar
    assert tuple(heat.figure.get_size_inches()) == (3.5, 3.5)
    assert [ax.get_title() for ax in heat.figure.axes if ax.get_title()] == ["mean over heads", "spread"]
    assert heat.path_of("mean over heads") == heat.path and heat.path.stat().st_size > 10_000
    # its effective-sources panel: a named axis and a legend for both curves
    side = heat.axes["effective sources"]
    assert side.get_xlabel() == "effective sources"
    assert [t.get_text() for t in side.get_legend().get_texts()] == ["exp(entropy)", "N (uniform)"]
    eff, uniform = side.lines
    assert np.allclose(eff.get_xdata(), routing_summary(model, [random_tokens()]).effective_sources())
    assert list(uniform.get_xdata()) == list(range(1, 2 * 6 + 2))  # N of site s = s + 1 sources
    # the heads: their own file, a 2 x 4 grid on a page's width, site names on the first column only,
    # source names on the bottom row only, one colour bar
    assert heat.heads_path == tmp_path / "h_heads.png" and heat.heads_path.stat().st_size > 10_000
    assert all(heat.path_of(f"head {h}") == heat.heads_path for h in range(8))
    width, height = heat.heads_figure.get_size_inches()
    assert width == 7.0 and height < width
    for h in range(8):
        ax = heat.axes[f"head {h}"]
        assert ax.figure is heat.heads_figure
        assert ax.yaxis.get_tick_params()["labelleft"] == (h % 4 == 0)
        assert ax.xaxis.get_tick_params()["labelbottom"] == (h >= 4)
        assert ax.get_xlabel() == "" and ax.get_ylabel() == ""
    assert heat.heads_figure.get_supxlabel() == "source" and heat.heads_figure.get_supylabel() == "routing site"
    assert len(heat.heads_figure.axes) == 8 + 1  # the panels and one colour bar
    # fonts: at least 8 pt everywhere
    for figure in (heat.figure, heat.heads_figure):
        texts = _texts(figure)
        assert len(texts) > 20 and min(t.get_fontsize() for t in texts) >= 8
    heat.close()
    # two heads fit a column
    two = plot_routing_heatmaps(routing_summary(tiny_model(random_queries=True, residual="attn_res", routing_heads=2),
                                                [random_tokens()]), tmp_path / "two.png")
    assert two.heads_figure.get_size_inches()[0] == 3.5 and not two.heads_agree
    two.close()


def test_heatmap_fixed_colour_range_is_honoured_in_both_figures(tmp_path):
    summaries = [routing_summary(tiny_model(random_queries=True, residual="attn_res", routing_heads=2, seed=seed),
                                 [random_tokens()]) for seed in (0, 1)]
    automatic = [plot_routing_heatmaps(s, tmp_path / f"auto{k}.png") for k, s in enumerate(summaries)]
    assert automatic[0].vmax != automatic[1].vmax  # each run's own range by default
    for k, summary in enumerate(summaries):
        heat = plot_routing_heatmaps(summary, tmp_path / f"fixed{k}.png", vmax=0.5)
        assert (heat.vmin, heat.vmax) == (-0.5, 0.5)
        images = [image for figure in (heat.figure, heat.heads_figure) for ax in figure.axes for image in ax.images]
        assert len(images) == 3 and all(image.get_clim() == (-0.5, 0.5) for image in images)
        bars = [ax for figure in (heat.figure, heat.heads_figure) for ax in figure.axes if ax.get_label() == "<colorbar>"]
        assert len(bars) == 2 and all(bar.get_xlim() == (-0.5, 0.5) or bar.get_ylim() == (-0.5, 0.5) for bar in bars)
        # the pixels: values beyond the range take its end colours
        step = 1.0 / (pyplot().get_cmap(heat.cmap).N - 1)
        for name, array in heat.panels.items():
            pixels = read_png(heat.path_of(name))
            for row, col in zip(*np.nonzero(np.isfinite(array))):
                got = decode_heatmap_cell(pixels, heat, name, row, col)
                assert abs(got - np.clip(array[row, col], -0.5, 0.5)) <= 3 * step, (name, row, col)
        assert any(np.nanmax(np.abs(a)) > 0.5 for a in heat.panels.values())  # some cells are clipped
        heat.close()
    for heat in automatic:
        heat.close()
    for bad in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="vmax must be a finite number > 0"):
            plot_routing_heatmaps(summaries[0], tmp_path / "bad.png", vmax=bad)
    assert not (tmp_path / "bad.png").exists()


def test_heatmap_command_refuses_a_bad_vmax_before_loading(tmp_path, capsys):
    from mhar_titan.analysis.__main__ import main

    with pytest.raises(SystemExit) as stop:  # the shared parser's one line (mhar_titan.cli_args)
        main(["heatmap", str(tmp_path / "no_such_run"), "--vmax", "0"])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("python -m mhar_titan.analysis heatmap: error: argument --vmax: must be a number > 0")
    assert "\n" not in err and "no_such_run" not in err  # refused before the run folder is read


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
    assert_not_blank(heat.heads_path)
    weights = model_weights(model, x)
    step = (heat.vmax - heat.vmin) / (pyplot().get_cmap(heat.cmap).N - 1)
    assert not heat.heads_agree and set(heat.panels) == {"mean over heads", "head 0", "head 1"}
    for name in heat.panels:
        pixels = read_png(heat.path_of(name))
        for row, w in enumerate(weights):
            per_head = w.double().mean((1, 2)).T.numpy()  # (H, N)
            mean = per_head.mean(0) if name.startswith("mean") else per_head[int(name.split()[-1])]
            expected = np.log2(mean * w.shape[0])  # relative to uniform 1/N
            assert np.allclose(heat.panels[name][row, :w.shape[0]], expected, rtol=0, atol=1e-9)
            assert np.isnan(heat.panels[name][row, w.shape[0]:]).all()
            for col, value in enumerate(expected):
                got = decode_heatmap_cell(pixels, heat, name, row, col)
                assert abs(got - np.clip(value, heat.vmin, heat.vmax)) <= 3 * step, (name, row, col, got, value)
    heat.close()


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
