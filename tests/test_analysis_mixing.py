"""The mixing heatmaps of DenseFormer, MUDDFormer, Hyper-Connections and mHC (analysis/mixing.py)
and the analysis commands on their runs: the heatmap command draws their mixing weights, the query
probe refuses them (and every model but single-head AttnRes) in one line before anything is loaded."""
import json

import numpy as np
import pytest
import torch

from helpers import assert_not_blank, tiny_model
from train_common import ROOT, SAMPLE, debug_argv

from mhar_titan.analysis.__main__ import main as analysis_main
from mhar_titan.analysis.mixing import MixRecorder, mixes, mixing_report, mixing_summary, plot_mixing
from mhar_titan.analysis.plots import pyplot
from mhar_titan.analysis.routing import routing_entropy

TOKENS = [torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(s)) for s in range(2)]


def test_densformer_panel_is_its_weight_matrix_and_the_observer_sees_the_same_rows():
    """DenseFormer: one panel, alpha, `DenseWeights.matrix()` (no forward); the per-block weights
    the observer sees in a forward are its rows over the sources each average reads."""
    model = tiny_model(random_queries=True, residual="dense", n_layers=4, vocab_size=512)
    summary = mixing_summary(model, [])
    assert list(summary.panels) == ["alpha"] and summary.tokens == 0
    assert np.array_equal(summary.panels["alpha"], model.routing.matrix().double().numpy())
    recorder = MixRecorder()
    with model.observe_routing(recorder):
        model(TOKENS[0])
    for i in range(4):
        assert np.allclose(recorder.mean(f"block {i}")[0].numpy(), summary.panels["alpha"][i, :i + 2])
    assert summary.column_labels() == ["emb", "b0", "b1", "b2", "b3"]


@pytest.mark.parametrize("prepost", [True, False])
def test_mudd_panels_are_the_mean_dynamic_weights_per_stream(prepost):
    """MUDDFormer: one panel per stream (Q, K, V, R), row i the mean over every token of the batches
    of block i's dw over its sources S_0..S_{i+1} (the observer's per-token weights, averaged here
    directly), NaN beyond them; the last block's row holds the R stream only."""
    model = tiny_model(random_queries=True, residual="mudd", mudd_prepost_norm=prepost, n_layers=3, vocab_size=512)
    seen = {}

    def keep(name, weights):
        seen.setdefault(name, []).append(weights.double().flatten(0, 1))

    for x in TOKENS:
        with model.observe_routing(keep):
            model(x)
    summary = mixing_summary(model, TOKENS)
    assert list(summary.panels) == ["Q", "K", "V", "R"] and summary.tokens == 36
    for i in range(3):
        direct = torch.cat(seen[f"block {i}"]).mean(0).numpy()  # (C, i+2)
        streams = ["R"] if i == 2 else ["Q", "K", "V", "R"]
        for c, name in enumerate(streams):
            row = summary.panels[name][i]
            assert np.allclose(row[:i + 2], direct[c]) and np.isnan(row[i + 2:]).all()
    assert np.isnan(summary.panels["Q"][2]).all()
    report = mixing_report(summary, "mudd")
    assert "| R | 2 |" in report and "| Q | 2 |" not in report
    json.dumps(summary.to_dict())  # NaN written as null


@pytest.mark.parametrize("fields", [dict(residual="hyper"), dict(residual="hyper", hyper_dynamic=False, hyper_rate=2),
                                    dict(residual="mhc"), dict(residual="mhc", mhc_exit="mean", hyper_rate=2)],
                         ids=["hyper", "hyper static n=2", "mhc", "mhc mean n=2"])
def test_stream_panels_are_the_mean_weights_per_site(fields):
    """Hyper-Connections (alpha, beta) and mHC (pre, post, comb; the learned exit): one panel per
    kind, row s the mean over every token of site s's weights as its observer sees them, flattened
    (alpha's column i,0 the read of stream i); static Hyper-Connections' rows are its parameters;
    mHC's comb columns sum to 1 at every site (Sinkhorn ends on a column normalisation)."""
    model = tiny_model(random_queries=True, n_layers=3, vocab_size=512, **fields)
    n, sites = model.args.hyper_rate, 6
    seen = {}

    def keep(name, weights):  # alpha (n, 1+n) and comb (n, n), the others (n,); per token after (B, T)
        own = 2 if name.endswith(("alpha", "comb")) else 1
        seen.setdefault(name, []).append(weights.double().reshape(-1, *weights.shape[weights.dim() - own:]))

    for x in TOKENS:
        with model.observe_routing(keep):
            model(x)
    summary = mixing_summary(model, TOKENS)
    kinds = {"hyper": ["alpha", "beta"], "mhc": ["pre", "post", "comb"]}[fields["residual"]]
    kinds += ["exit"] if fields["residual"] == "mhc" and "mhc_exit" not in fields else []
    assert list(summary.panels) == kinds and summary.tokens == 36
    for kind in kinds:
        rows = ["exit"] if kind == "exit" else [f"site {s} {kind}" for s in range(sites)]
        direct = np.stack([torch.cat(seen[r]).mean(0).flatten().numpy() for r in rows])
        assert np.allclose(summary.panels[kind], direct, rtol=1e-12, atol=1e-12), kind
        assert summary.row_labels(kind) == (["exit"] if kind == "exit" else ["0 attn", "0 mlp", "1 attn", "1 mlp",
                                                                           "2 attn", "2 mlp"])
    if fields["residual"] == "hyper":
        assert summary.column_labels("alpha")[:n + 2] == [f"0,{j}" for j in range(n + 1)] + ["1,0"]
        assert summary.column_labels("beta") == [f"H{i}" for i in range(n)]
    if fields.get("hyper_dynamic") is False:  # the same weights for every token: the parameters
        assert np.allclose(summary.panels["alpha"], model.routing.static_alpha.detach().double().flatten(1).numpy())
        assert np.allclose(summary.panels["beta"], model.routing.static_beta.detach().double().numpy())
    if fields["residual"] == "mhc":
        comb = summary.panels["comb"].reshape(sites, n, n)
        assert np.allclose(comb.sum(1), 1, atol=1e-5)
        assert len(summary.column_labels("comb")) == n * n and summary.column_labels("comb")[1] == "0,1"
    report = mixing_report(summary, fields["residual"])
    assert f"| {kinds[-1]} | " in report and "Mixing weights per site; mean over 36 tokens." in report
    data = json.loads(json.dumps(summary.to_dict()))
    assert list(data["panels"]) == kinds and data["rows"][kinds[0]][0] == "0 attn"


def test_plot_and_what_is_drawn(tmp_path):
    model = tiny_model(random_queries=True, residual="mudd", n_layers=3, vocab_size=512)
    fig = plot_mixing(mixing_summary(model, TOKENS[:1]), tmp_path / "m.png", title="mudd", dpi=80)
    pyplot().close(fig)
    assert_not_blank(tmp_path / "m.png")
    fig = plot_mixing(mixing_summary(tiny_model(residual="mhc", n_layers=2, vocab_size=512), TOKENS[:1]),
                      tmp_path / "mhc.png", title="mhc", dpi=80)
    pyplot().close(fig)
    assert_not_blank(tmp_path / "mhc.png")
    assert mixes(model) and mixes(tiny_model(residual="dense"))
    assert mixes(tiny_model(residual="hyper")) and mixes(tiny_model(residual="mhc"))
    assert not mixes(tiny_model(residual="attn_res", routing_heads=2)) and not mixes(tiny_model())
    assert routing_entropy(model, TOKENS[0]) is None  # no depth softmax: the trainer logs none
    with pytest.raises(ValueError, match="no mixing weights"):
        mixing_summary(tiny_model(), TOKENS)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Run folders of debug DenseFormer, MUDDFormer, Hyper-Connections and mHC: 2 steps of 2 x 32
    tokens, a checkpoint."""
    from mhar_titan.train import main as train_main

    if not (SAMPLE / "validation-00000-of-00001.parquet").exists():
        pytest.skip("run `python -m mhar_titan.data.prepare_shakespeare --out data/shakespeare`")
    root = tmp_path_factory.mktemp("runs")
    for name in ("debug_dense", "debug_mudd", "debug_hyper", "debug_mhc"):
        argv = debug_argv(root, name, "--training.steps=2", "--training.local_batch_size=2",
                          "--checkpoint.enable=true", "--checkpoint.interval=2",
                          config=ROOT / "train_configs" / f"{name}.toml")
        assert train_main(argv) == 0
    return root


@pytest.mark.parametrize("name, static, panels", [("debug_dense", True, ["alpha"]),
                                                  ("debug_mudd", False, ["Q", "K", "V", "R"]),
                                                  ("debug_hyper", False, ["alpha", "beta"]),
                                                  ("debug_mhc", False, ["pre", "post", "comb", "exit"])])
def test_heatmap_command_draws_the_mixing_weights(runs, tmp_path, name, static, panels, capsys):
    out = tmp_path / "out"
    assert analysis_main(["heatmap", str(runs / name), "--batches", "1", "--out", str(out)]) == 0
    assert_not_blank(out / "mixing_step2.png")
    data = json.loads((out / "mixing_step2.json").read_text())
    assert list(data["panels"]) == panels
    assert (data["tokens"] == 0) == static
    assert "Mixing weights of" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["debug_dense", "debug_mudd", "debug_hyper", "debug_mhc"])
def test_probe_refuses_other_connections_before_loading(runs, name, capsys, monkeypatch):
    import mhar_titan.analysis.__main__ as commands

    monkeypatch.setattr(commands, "load_run", lambda *a, **k: pytest.fail("the model was loaded"))
    assert analysis_main(["probe", str(runs / name)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "single-head AttnRes" in err and "residual=" in err
