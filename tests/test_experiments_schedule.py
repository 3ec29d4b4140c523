"""Schedule-matched arms (``python -m mhar_titan.experiments compare --check-schedule``): the shipped
8B plain and delta-MHAR configs match; a pair differing in one LR setting, the tokens per step or
the data order is refused, naming the first difference; a trained run folder matches its config."""
import dataclasses

import pytest
from helpers import ROOT
from train_common import SAMPLE, debug_cfg, train

from mhar_titan.config import ConfigError, load_config
from mhar_titan.experiments.__main__ import main
from mhar_titan.experiments.schedule import (LR_SETTINGS, check_schedule, load_schedule, planned_schedule,
                                             schedule_differences)

PLAIN = ROOT / "train_configs" / "midtrain_llama3_8b_plain.toml"
DELTA = ROOT / "train_configs" / "midtrain_llama3_8b_delta_mhar.toml"


def test_the_shipped_8b_arms_are_schedule_matched_and_differ_only_in_the_model(capsys):
    assert main(["compare", "--check-schedule", "--world-size", "8", str(PLAIN), str(DELTA)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("schedule-matched:") and "9,500 steps" in out and "1,048,576 tokens per step" in out
    assert "fineweb_edu=1" in out
    plain, delta = load_config(str(PLAIN)), load_config(str(DELTA))
    differ = [f.name for f in dataclasses.fields(plain) if getattr(plain, f.name) != getattr(delta, f.name)]
    assert differ == ["job", "model"]  # job: name and description
    assert plain.model.overrides["residual"] == "standard" and delta.model.overrides["routing_mode"] == "delta"
    assert plain.data.is_mixture and plain.checkpoint.initial_load_path == delta.checkpoint.initial_load_path


CHANGED = {"optimizer.lr": "3e-4", "lr_scheduler.warmup_steps": "400", "lr_scheduler.decay_ratio": "0.2",
           "lr_scheduler.decay_type": "cosine", "lr_scheduler.min_lr_factor": "0.1", "training.steps": "9000"}


@pytest.mark.parametrize("key", sorted(CHANGED))
def test_a_pair_differing_in_one_lr_setting_is_refused_naming_it(key):
    assert sorted(CHANGED) == sorted(f"{s}.{k}" for s, k in LR_SETTINGS)
    a = planned_schedule(load_config(str(PLAIN)), 8)
    b = planned_schedule(load_config(str(DELTA), [f"--{key}={CHANGED[key]}"]), 8)
    diffs = schedule_differences(a, b)
    assert diffs[0].startswith(f"{key} = ") and len([d for d in diffs if " = " in d]) == 1, diffs
    assert any(d.startswith("LR at step ") for d in diffs), diffs  # and the first step whose LR differs
    with pytest.raises(ConfigError, match="not schedule-matched: " + key.replace(".", r"\.")):
        check_schedule(a, b)


def test_the_command_refuses_with_the_setting_and_the_first_step(tmp_path, capsys):
    other = tmp_path / "plain_warmup400.toml"
    other.write_text(PLAIN.read_text().replace("warmup_steps = 500", "warmup_steps = 400"))
    assert main(["compare", "--check-schedule", str(other), str(DELTA)]) == 1
    err = capsys.readouterr().err
    assert "not schedule-matched: lr_scheduler.warmup_steps = 400 vs 500" in err
    assert "LR at step 1: 1e-06 vs 8e-07" in err and len(err.strip().splitlines()) == 1
    assert main(["compare", "--check-schedule", str(tmp_path / "missing.toml"), str(DELTA)]) == 2


@pytest.mark.parametrize("override, needle", [
    ("--training.global_batch_size=128", "tokens per step 1,048,576 vs 524,288"),
    ("--data.seed=7", "data order: different data.seed"),
    ("--data.shuffle_buffer=64", "data order: different data.shuffle_buffer"),
    ('--data.sources=[{name = "fineweb_edu", weight = 1.0, source = "hub", hub_name = "sample-100BT"}]',
     "data order: different data.sources (fineweb_edu.hub_name 'sample-10BT' vs 'sample-100BT')"),
    ('--data.sources=[{name = "fineweb_edu", weight = 1.0, source = "hub"}, {name = "code", weight = 0.2, '
     'files = ["x"]}]', "data order: different data.sources (sources ['fineweb_edu'] vs ['fineweb_edu', 'code'])"),
])
def test_tokens_per_step_and_data_order_are_checked(override, needle):
    a = planned_schedule(load_config(str(PLAIN)), 8)
    b = planned_schedule(load_config(str(DELTA), [override]), 8)
    assert schedule_differences(a, b)[0] == needle or needle in schedule_differences(a, b), schedule_differences(a, b)
    # settings that do not change the tokens a step sees are no difference
    c = planned_schedule(load_config(str(DELTA), ["--data.num_workers=4", "--data.allow_weight_change=true"]), 8)
    assert schedule_differences(a, c) == []


@pytest.mark.skipif(not (SAMPLE / "validation-00000-of-00001.parquet").exists(), reason="needs data/shakespeare")
def test_a_trained_run_folder_matches_its_config_and_not_another(tmp_path):
    cfg = debug_cfg(tmp_path, "arm", "--training.steps=3", "--metrics.log_freq=1")
    train(cfg)
    run = tmp_path / "arm"
    logged, planned = load_schedule(run), planned_schedule(cfg)
    assert sorted(logged.lr) == [1, 2, 3] and logged.tokens_per_step == 8 * 32
    assert "schedule-matched" in check_schedule(logged, planned)
    other = planned_schedule(dataclasses.replace(cfg, optimizer=dataclasses.replace(cfg.optimizer, lr=1e-3)))
    assert schedule_differences(logged, other)[0] == f"optimizer.lr = {cfg.optimizer.lr:.6g} vs 0.001"
