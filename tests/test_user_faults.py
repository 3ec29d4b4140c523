"""Faults a careless user meets, each refused in one line (exit 2) before anything expensive runs,
or handled the way a user expects: mixture weights whose normalisation fails, eval output paths
that cannot be written, Muon settings left beside AdamW, and the end-of-run summary's validation line.
"""
import logging

import pytest
from helpers import assert_config_refused_in_one_line

from mhar_titan.config import load_config
from mhar_titan.data.mixture import thresholds
from mhar_titan.dryrun import main as dryrun
from mhar_titan.train import main

# --------------------------------------------------------------------------- mixture weights


def _mixture_toml(*weights) -> str:
    return "[data]\ntokenizer = \"bytes\"\n" + "".join(
        f"[[data.sources]]\nname = \"s{i}\"\nweight = {w}\nfiles = [\"x{i}\"]\n" for i, w in enumerate(weights))


BAD_WEIGHTS = {
    # the sum overflows a float: each weight passes, their shares would be 0 / 0
    "sum_overflows": (("1e308", "1e308"), "the weights of data.sources sum to inf"),
    "sum_overflows_three": (("9e307", "9e307", "0"), "the weights of data.sources sum to inf"),
    "huge_integer": (("1" + "0" * 400, "1"), "'data.sources[0].weight' must be a finite number"),
    # a weight > 0 whose share rounds to nothing would never be drawn
    "share_underflows": (("5e-324", "1e10"), "data.sources[0] ('s0').weight = 4.94066e-324 is a share of 0 "),
    "share_below_resolution": (("1e-25", "1"), "data.sources[0] ('s0').weight = 1e-25 is a share of 1e-25"),
}


@pytest.mark.parametrize("case", sorted(BAD_WEIGHTS))
def test_mixture_weights_that_do_not_normalise_exit_2_in_one_line_before_the_model(tmp_path, capsys, case):
    weights, needle = BAD_WEIGHTS[case]
    path = tmp_path / "job.toml"
    path.write_text(_mixture_toml(*weights))
    assert_config_refused_in_one_line(path, needle, tmp_path, capsys, match="data.sources")
    # the dry run refuses the same job in the same line, without a traceback
    assert dryrun(["--config", str(path), "--device", "cpu"]) != 0
    out = capsys.readouterr()
    assert needle in out.err and "Traceback" not in out.err and len(out.err.strip().splitlines()) == 1


@pytest.mark.parametrize("weights, shares", [
    (("1e300", "3e300"), [0.25, 0.75]),          # large weights whose sum a float holds
    (("5e-324", "5e-324"), [0.5, 0.5]),          # subnormal weights: only their ratio matters
    (("2", "0", "6"), [0.25, 0.0, 0.75]),        # a zero weight keeps its share of 0
])
def test_mixture_weights_that_normalise_are_kept_as_their_ratios(tmp_path, weights, shares):
    path = tmp_path / "job.toml"
    path.write_text(_mixture_toml(*weights))
    specs = load_config(str(path)).data.mixture()
    assert [m.weight for m in specs] == shares
    upper = thresholds([m.weight for m in specs])  # the draws' intervals: each share > 0 owns a non-empty one
    bounds = [0, *upper, 2 ** 64]
    assert [bounds[i + 1] > bounds[i] for i in range(len(shares))] == [s > 0 for s in shares]


# --------------------------------------------------------------------------- Muon settings beside AdamW


def _optimizer_warnings(caplog, *overrides) -> list[str]:
    from helpers import tiny_model

    from mhar_titan.optim import build_optimizer

    cfg = load_config(None, list(overrides)).optimizer
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mhar_titan.optim"):
        optimizer = build_optimizer(tiny_model(), cfg)
    assert type(optimizer).__name__ == ("MuonWithAdamW" if cfg.name == "Muon" else "AdamW")
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_muon_settings_beside_adamw_are_warned_about_once_by_name(caplog):
    warned = _optimizer_warnings(caplog, "--optimizer.muon_lr=0.02", "--optimizer.muon_ns_steps=3")
    assert len(warned) == 1
    assert ("optimizer.muon_lr = 0.02, optimizer.muon_ns_steps = 3 are ignored: optimizer.name = 'AdamW'"
            in warned[0]) and "muon_momentum" not in warned[0]
    assert _optimizer_warnings(caplog) == []  # defaults: nothing to say
    assert _optimizer_warnings(caplog, "--optimizer.name=Muon", "--optimizer.muon_lr=0.02") == []  # used


def test_training_with_muon_settings_beside_adamw_warns_once(tmp_path, caplog):
    from train_common import debug_argv

    argv = debug_argv(tmp_path, "adamw", "--training.steps=1", "--lr_scheduler.warmup_steps=0",
                      "--optimizer.muon_momentum=0.9")
    with caplog.at_level(logging.WARNING):
        assert main(argv) == 0
    warned = [r.getMessage() for r in caplog.records if "muon" in r.getMessage()]
    assert len(warned) == 1 and "optimizer.muon_momentum = 0.9 is ignored" in warned[0]


# --------------------------------------------------------------------------- the summary after an early stop


def test_early_preemption_summary_says_validation_is_on_but_not_due_yet(tmp_path, capsys):
    import os
    import signal

    from train_common import debug_cfg

    from mhar_titan.train import Trainer, check_config

    cfg = debug_cfg(tmp_path, "early", "--training.steps=50", "--validation.enable=true", "--validation.freq=20",
                    "--validation.sequences=2")
    trainer = Trainer(cfg, check_config(cfg))
    try:
        os.kill(os.getpid(), signal.SIGTERM)  # a real stop signal, recorded by the trainer's handler
        trainer.train()
    finally:
        trainer.close()
    assert trainer.preempted and trainer.state.step == 1  # stopped after the step the signal preceded
    out = capsys.readouterr().out
    (line,) = [text for text in out.splitlines() if "| val loss |" in text]
    assert "validation.enable = false" not in line
    assert line.endswith("| val loss | none in this run (validation.freq = 20: the run stopped at step 1, before a "
                         "validation finished)")


# --------------------------------------------------------------------------- eval paired: output paths first


def _paired_outputs(tmp_path, kind: str):
    """Two inputs of ``kind`` ("scored": folders of results; "runs": run folders whose checkpoints
    would be scored: empty here, so any loading would fail with another message)."""
    runs = []
    for name in ("a_in", "b_in"):
        folder = tmp_path / name
        folder.mkdir()
        if kind == "scored":
            (folder / "results_2026-01-01T00-00-00.json").write_text('{"results": {}}')
        runs.append(str(folder))
    return runs


@pytest.mark.parametrize("kind", ["scored", "runs"])
@pytest.mark.parametrize("fault", ["output_is_a_file", "a_is_a_file", "json_is_a_folder", "under_a_file"])
def test_eval_paired_refuses_an_output_path_it_cannot_write_before_any_work(tmp_path, monkeypatch, capsys, kind,
                                                                              fault):
    from helpers import ROOT

    from mhar_titan.eval.__main__ import main as eval_main

    monkeypatch.chdir(ROOT)  # --include-path eval_tasks
    run_a, run_b = _paired_outputs(tmp_path, kind)
    out = tmp_path / "paired"
    if fault == "output_is_a_file":
        out.write_text("not a folder")
        needle = f"--output-path: {out} is a regular file"
    elif fault == "under_a_file":
        out.write_text("not a folder")
        out = out / "inner"
        needle = f"--output-path: {out} is under the regular file"
    elif fault == "a_is_a_file":
        out.mkdir()
        (out / "a").write_text("not a folder")
        needle = f"{out / 'a'} is a regular file"
    else:
        (out / "paired.json").mkdir(parents=True)
        needle = f"{out / 'paired.json'} is a folder"
    if fault == "a_is_a_file" and kind == "scored":  # nothing is written under a/ when A is scored already
        needle = f"{out / 'paired.json'}"
        (out / "paired.json").mkdir()
    code = eval_main(["paired", run_a, run_b, "--tasks", "shakespeare_choice", "--include-path", "eval_tasks",
                      "--output-path", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and needle in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_experiments_slurm_refuses_an_out_that_is_a_folder_before_planning(tmp_path, capsys):
    from helpers import ROOT

    from mhar_titan.experiments.__main__ import main as experiments_main

    code = experiments_main(["slurm", str(ROOT / "train_configs" / "sweeps" / "study_bytes.toml"),
                             "--out", str(tmp_path), "--check"])
    err = capsys.readouterr().err
    assert code == 2 and f"--out {tmp_path} is a folder" in err and len(err.strip().splitlines()) == 1, err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("out_kind", ["folder_with_files", "file"])
def test_prepare_shakespeare_refuses_an_existing_out_before_reading_anything(tmp_path, capsys, out_kind):
    from mhar_titan.data.prepare_shakespeare import main as prepare

    out = tmp_path / "out"
    if out_kind == "file":
        out.write_text("x")
    else:
        out.mkdir()
        (out / "train-00000-of-00004.parquet").write_text("an earlier run's shard")
    sdist = tmp_path / "not-a-tarball.tar.gz"  # reading it would fail with another message
    sdist.write_text("x")
    with pytest.raises(SystemExit) as done:
        prepare(["--out", str(out), "--sdist", str(sdist)])
    err = capsys.readouterr().err
    assert done.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"--out {out} already exists and is not empty" in err


@pytest.mark.parametrize("weights", [[1e308, 1e308], [0.0, 0.0], [1.0, float("nan")], [1.0, float("inf")], [-1.0, 2.0]])
def test_mixture_draws_refuse_weights_that_do_not_normalise_from_python_too(weights):
    from mhar_titan.data.mixture import window_sources

    with pytest.raises(ValueError, match=r"must be finite numbers >= 0 whose sum is finite and > 0"):
        window_sources(0, "global", weights, 0, 10)
