"""The study's byte-level tokenizer, its committed configs and the smoke run of its sweep."""
import math
import shlex

import pytest

from mhar_titan.config import load_config
from mhar_titan.data import DataConfig, build_tokenizer
from mhar_titan.dryrun import build_model_args
from mhar_titan.experiments.sweep import load_sweep
from mhar_titan.models.args import logit_scale
from helpers import read_metrics
from train_common import ROOT


def test_byte_tokenizer_needs_no_file_and_round_trips(tmp_path):
    tok = build_tokenizer(DataConfig(tokenizer="bytes", tokenizer_cache_dir=str(tmp_path / "empty")))
    assert (tok.n_vocab, tok.eos_id) == (257, 256)
    assert tok.encode("Aé<|endoftext|>") == [65, 195, 169, *b"<|endoftext|>"]
    assert tok.decode(tok.encode("ROMEO: ünïcödé") + [tok.eos_id]) == "ROMEO: ünïcödé"
    with pytest.raises(ValueError, match="reads no file"):
        build_tokenizer(DataConfig(tokenizer="bytes", tokenizer_file=str(tmp_path)))


STUDY_FAMILIES = ("baseline", "attnres", "mhar_h2", "mhar_h4", "mhar_h8", "attnres_tau", "attnres_learned",
                  "mhar_h8_learned", "dense", "mudd", "hyper", "mhc")


def test_study_sweep_pairs_twelve_families_over_three_seeds():
    sweep = load_sweep(ROOT / "train_configs" / "sweeps" / "study_bytes.toml")
    assert [r.name for r in sweep.runs] == [f"{f}_s{s}" for s in (1, 2, 3) for f in STUDY_FAMILIES]
    args = {r.family: build_model_args(r.config) for r in sweep.runs if r.seed == 3}
    assert (args["mhar_h8"].vocab_size, args["mhar_h8"].resolved_routing_heads, args["mhar_h8"].n_routing_sites) \
        == (384, 8, 25)
    resolved = {f: (a.resolved_routing_heads, logit_scale(a.routing_logit_scale), a.routing_temperature)
                for f, a in args.items() if f not in ("baseline", "mhar_h2", "mhar_h4", "dense", "mudd", "hyper", "mhc")}
    assert resolved == {"attnres": (1, 1.0, "fixed"), "mhar_h8": (8, 1.0, "fixed"),
                        "attnres_tau": (1, 1 / math.sqrt(8), "fixed"), "attnres_learned": (1, 1.0, "learned"),
                        "mhar_h8_learned": (8, 1.0, "learned")}
    assert sweep.pairs == (("attnres", "attnres_tau"), ("attnres_tau", "mhar_h8"), ("attnres", "attnres_learned"),
                           ("mhar_h8", "mhar_h8_learned"))
    assert build_model_args(load_config(str(ROOT / "train_configs" / "study_bytes.toml"))).vocab_size == 384
    assert (args["dense"].residual, args["mudd"].residual, args["mudd"].mudd_prepost_norm) == ("dense", "mudd", True)
    assert sweep.arms["dense"] == "dense" and sweep.arms["mudd"] == "mudd"
    assert (args["hyper"].residual, args["hyper"].hyper_dynamic, args["mhc"].residual, args["mhc"].mhc_exit) \
        == ("hyper", True, "mhc", "learned")
    assert sweep.arms["hyper"] == "hyper" and sweep.arms["mhc"] == "mhc"


def test_results_md_quotes_the_generated_family_table():
    """RESULTS.md shows the per-family table that the documented results command wrote into
    docs/study/RESULTS.md, unchanged, and links the plot it wrote."""
    def family_rows(text):
        return [line for line in text.splitlines() if line.startswith("| ") and "| 3 |" in line and "_s" not in line]

    generated = (ROOT / "docs" / "study" / "RESULTS.md").read_text()
    quoted = (ROOT / "RESULTS.md").read_text()
    assert len(family_rows(generated)) == 5 and family_rows(quoted) == family_rows(generated)
    assert "docs/study/loss_vs_tokens.png" in quoted and (ROOT / "docs" / "study" / "loss_vs_tokens.png").exists()


def header_commands(path) -> list[list[str]]:
    """The smoke-test commands of a sweep file's header comment, as argument lists (after
    ``python -m mhar_titan.experiments``), continuation lines joined."""
    lines = path.read_text().split("# Smoke test", 1)[1].split("\n\n", 1)[0].splitlines()
    text = " ".join(line.lstrip("#").strip() for line in lines[1:]).replace("\\ ", "")
    commands = ["python -m mhar_titan.experiments " + c for c in text.split("python -m mhar_titan.experiments ")[1:]]
    return [shlex.split(c)[3:] for c in commands]


@pytest.mark.slow
def test_the_study_smoke_run_trains_the_temperature_arms_and_prints_their_rows(tmp_path, monkeypatch, warm_python):
    """The header's smoke commands (2 steps per run), for seed 1 of the temperature arms and the
    families they are paired with (`--only`): every run completes, and `results` prints the
    arms, their paired rows and the pairs' differences with the values of their metrics files;
    the plotted temperature is the one the checkpoint holds. The commands and the trainings they
    start are processes forked from the warm interpreter (tests/warm_python.py)."""
    from mhar_titan.eval.load import load_run
    from mhar_titan.metrics import TEMPERATURE_KEYS

    sweep_file = ROOT / "train_configs" / "sweeps" / "study_bytes.toml"
    run_cmd, results_cmd = header_commands(sweep_file)
    assert run_cmd[:2] == ["run", "train_configs/sweeps/study_bytes.toml"] and results_cmd[0] == "results"
    assert "training.steps=2" in run_cmd and "outputs/sweeps/study_smoke" in run_cmd
    folder = str(tmp_path / "smoke")
    swap = {"outputs/sweeps/study_smoke": folder}
    names = [f"{f}_s1" for f in ("baseline", "attnres", "mhar_h8", "attnres_tau", "attnres_learned", "mhar_h8_learned")]
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the trainings are child processes; one thread each is quickest here

    def experiments_main(argv):
        done = warm_python.run(["-m", "mhar_titan.experiments", *argv])
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        return done.stdout

    printed = experiments_main([swap.get(a, a) for a in run_cmd] + ["--only", *names])
    assert f"sweep study_bytes: {len(names)} completed, 0 already done, 0 failed" in printed
    printed = experiments_main([swap.get(a, a) for a in results_cmd] + ["--out", str(tmp_path / "results")])

    def val_tail(name):  # the tail mean (tail_evals = 5: both of the smoke run's evaluations), in bits per byte
        vals = [r["val_loss"] for r in read_metrics(tmp_path / "smoke" / name) if "val_loss" in r]
        assert len(vals) == 2
        return sum(vals) / 2 / math.log(2)

    tails = {name: val_tail(name) for name in names}
    for name in names[1:]:
        assert (f"| {name} | 1 | {tails[name]:.4f} | 2 | {tails[name] - tails['baseline_s1']:+.4f} | yes | 8,192 |"
                in printed), name
    assert "| attnres_tau | attn_res H=1 + routing_logit_scale=match_heads:8 |" in printed
    assert "| mhar_h8_learned | mhar H=8 + routing_temperature=learned |" in printed
    for a, b in (("attnres", "attnres_tau"), ("attnres_tau", "mhar_h8"), ("mhar_h8", "mhar_h8_learned")):
        delta = tails[f"{b}_s1"] - tails[f"{a}_s1"]
        assert f"| {b} - {a} | - | 1 | {delta:+.4f} | n/a | yes |" in printed
    assert "| attnres_tau_s2 | 2 | not run |" in printed
    assert (tmp_path / "results" / "routing_temperature.png").is_file()
    # the learned temperature logged at the last step is the checkpoint's exp(log_temperature)
    for name, heads in (("attnres_learned_s1", 1), ("mhar_h8_learned_s1", 8)):
        last = [r for r in read_metrics(tmp_path / "smoke" / name) if TEMPERATURE_KEYS[0] in r][-1]
        assert last["step"] == 2
        t = load_run(tmp_path / "smoke" / name).model.routing.log_temperature.detach().double().exp()
        assert t.shape == (25, heads)
        assert [last[k] for k in TEMPERATURE_KEYS] == pytest.approx([t.mean().item(), t.min().item(), t.max().item()],
                                                                    rel=1e-6)
    assert not any(TEMPERATURE_KEYS[0] in r for r in read_metrics(tmp_path / "smoke" / "attnres_tau_s1"))


@pytest.mark.slow
def test_the_study_smoke_run_trains_the_depth_connections_and_prints_every_arms_row(tmp_path, monkeypatch, capsys):
    """The header's smoke commands (2 steps per run) for seed 1 of the baseline, MHAR, DenseFormer,
    MUDDFormer, Hyper-Connections and mHC: every run completes, and `results` prints each arm's row in the per-family
    table and in the table at equal steps and equal wall-clock time, with its tokens/s (the median
    of the run's logged rate after step 1) and the paired difference at equal steps (the tail
    means of its metrics file)."""
    import statistics

    sweep_file = ROOT / "train_configs" / "sweeps" / "study_bytes.toml"
    run_cmd, results_cmd = header_commands(sweep_file)
    folder = str(tmp_path / "smoke")
    swap = {"outputs/sweeps/study_smoke": folder}
    names = [f"{f}_s1" for f in ("baseline", "mhar_h8", "dense", "mudd", "hyper", "mhc")]
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    from mhar_titan.experiments.__main__ import main as experiments_main

    assert experiments_main([swap.get(a, a) for a in run_cmd] + ["--only", *names]) == 0
    assert f"sweep study_bytes: {len(names)} completed, 0 already done, 0 failed" in capsys.readouterr().out
    assert experiments_main([swap.get(a, a) for a in results_cmd] + ["--out", str(tmp_path / "results")]) == 0
    printed = capsys.readouterr().out
    rows = {name: read_metrics(tmp_path / "smoke" / name) for name in names}
    # the results' losses are in bits per byte (byte tokens: nats / ln 2), every table alike
    tail = {n: statistics.mean(r["val_loss"] for r in rows[n] if "val_loss" in r) / math.log(2) for n in names}
    speed = {n: statistics.median(r["tokens_per_s"] for r in rows[n] if "tokens_per_s" in r and r["step"] > 1)
             for n in names}
    assert f"| baseline | - | {speed['baseline_s1']:,.0f} | - | baseline |" in printed
    for family in ("mhar_h8", "dense", "mudd", "hyper", "mhc"):
        name = f"{family}_s1"
        diff = tail[name] - tail["baseline_s1"]
        assert f"| {family} | - | 1 | {tail[name]:.4f} | {diff:+.4f} | n/a | 1 |" in printed, family
        ratio = speed[name] / speed["baseline_s1"]
        assert f"| {family} | - | {speed[name]:,.0f} | {ratio:.2f} | {diff:+.4f} | n/a | " in printed, family
    assert "| dense_s2 | 2 | not run |" in printed


@pytest.mark.parametrize("scale", ["100m", "350m", "1b"])
def test_depth_connection_sweeps_and_flavors_differ_from_mhar_only_in_the_connection(scale):
    """depth_connections_<scale>: baseline, AttnRes, MHAR with H = KV heads, the temperature-matched
    single head (1/sqrt(KV)), DenseFormer, MUDDFormer with the pre/post DA norm, dynamic
    Hyper-Connections and mHC (n = 4), 3 paired seeds; and the flavor configs
    {dense,mudd,hyper,mhc}_<scale>.toml are mhar_<scale>.toml's job but for the connection (and the
    job's name and description)."""
    import dataclasses

    sweep = load_sweep(ROOT / "train_configs" / "sweeps" / f"depth_connections_{scale}.toml")
    families = ("baseline", "attnres", "mhar", "attnres_tau", "dense", "mudd", "hyper", "mhc")
    assert [r.name for r in sweep.runs] == [f"{f}_s{s}" for s in (1, 2, 3) for f in families]
    assert sweep.baseline == "baseline" and sweep.pairs == ()
    args = {r.family: build_model_args(r.config) for r in sweep.runs if r.seed == 1}
    kv = args["mhar"].n_kv_heads
    assert args["mhar"].resolved_routing_heads == kv and args["attnres"].resolved_routing_heads == 1
    assert logit_scale(args["attnres_tau"].routing_logit_scale) == pytest.approx(1 / math.sqrt(kv))
    assert (args["dense"].residual, args["mudd"].residual, args["mudd"].mudd_prepost_norm) == ("dense", "mudd", True)
    assert (args["hyper"].residual, args["hyper"].hyper_rate, args["hyper"].hyper_dynamic) == ("hyper", 4, True)
    assert (args["mhc"].residual, args["mhc"].hyper_rate, args["mhc"].mhc_exit) == ("mhc", 4, "learned")
    mhar = load_config(str(ROOT / "train_configs" / f"mhar_{scale}.toml"))
    for family in ("dense", "mudd", "hyper", "mhc"):
        cfg = load_config(str(ROOT / "train_configs" / f"{family}_{scale}.toml"))
        assert build_model_args(cfg).residual == family
        for section in dataclasses.fields(cfg):
            if section.name not in ("model", "job"):
                assert getattr(cfg, section.name) == getattr(mhar, section.name), (family, section.name)
        unnamed = dict(description="", name="")
        assert dataclasses.replace(cfg.job, **unnamed) == dataclasses.replace(mhar.job, **unnamed)
        assert cfg.model.flavor == mhar.model.flavor
