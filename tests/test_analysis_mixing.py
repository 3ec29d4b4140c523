"""The mixing heatmaps of DenseFormer and MUDDFormer (analysis/mixing.py) and the analysis
commands on their runs: the heatmap command draws their mixing weights, the query probe refuses
them (and every model but single-head AttnRes) in one line before anything is loaded."""
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


def test_plot_and_what_is_drawn(tmp_path):
    model = tiny_model(random_queries=True, residual="mudd", n_layers=3, vocab_size=512)
    fig = plot_mixing(mixing_summary(model, TOKENS[:1]), tmp_path / "m.png", title="mudd", dpi=80)
    pyplot().close(fig)
    assert_not_blank(tmp_path / "m.png")
    assert mixes(model) and mixes(tiny_model(residual="dense"))
    assert not mixes(tiny_model(residual="attn_res", routing_heads=2)) and not mixes(tiny_model())
    assert routing_entropy(model, TOKENS[0]) is None  # no depth softmax: the trainer logs none
    with pytest.raises(ValueError, match="no mixing weights"):
        mixing_summary(tiny_model(), TOKENS)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Run folders of debug DenseFormer and MUDDFormer: 2 steps of 2 x 32 tokens, a checkpoint."""
    from mhar_titan.train import main as train_main

    if not (SAMPLE / "validation-00000-of-00001.parquet").exists():
        pytest.skip("run `python -m mhar_titan.data.prepare_shakespeare --out data/shakespeare`")
    root = tmp_path_factory.mktemp("runs")
    for name in ("debug_dense", "debug_mudd"):
        argv = debug_argv(root, name, "--training.steps=2", "--training.local_batch_size=2",
                          "--checkpoint.enable=true", "--checkpoint.interval=2",
                          config=ROOT / "train_configs" / f"{name}.toml")
        assert train_main(argv) == 0
    return root


@pytest.mark.parametrize("name, static", [("debug_dense", True), ("debug_mudd", False)])
def test_heatmap_command_draws_the_mixing_weights(runs, tmp_path, name, static, capsys):
    out = tmp_path / "out"
    assert analysis_main(["heatmap", str(runs / name), "--batches", "1", "--out", str(out)]) == 0
    assert_not_blank(out / "mixing_step2.png")
    data = json.loads((out / "mixing_step2.json").read_text())
    assert list(data["panels"]) == (["alpha"] if static else ["Q", "K", "V", "R"])
    assert (data["tokens"] == 0) == static
    assert "Mixing weights of" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["debug_dense", "debug_mudd"])
def test_probe_refuses_other_connections_before_loading(runs, name, capsys, monkeypatch):
    import mhar_titan.analysis.__main__ as commands

    monkeypatch.setattr(commands, "load_run", lambda *a, **k: pytest.fail("the model was loaded"))
    assert analysis_main(["probe", str(runs / name)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "single-head AttnRes" in err and "residual=" in err
