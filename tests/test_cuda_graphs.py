"""``training.cuda_graphs``: refused before anything is built where it cannot work (on CPU, and
with settings a graph cannot capture), named in one line with exit code 2. The capture itself
needs a GPU: bench/gpu_suite.sh's ``trainer_cuda_graphs`` row runs it (losses bitwise against
eager); the step it captures is held capture-safe on CPU by tests/test_capture_safe.py."""
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from train_common import debug_argv, debug_cfg  # noqa: E402

from mhar_titan.components.cuda_graphs import capture_blockers, check_cuda_graphs  # noqa: E402
from mhar_titan.config import ConfigError  # noqa: E402
from mhar_titan.dryrun import build_model_args  # noqa: E402
from mhar_titan.train import main  # noqa: E402


def test_off_by_default(tmp_path):
    cfg = debug_cfg(tmp_path, "off")
    assert cfg.training.cuda_graphs is False
    check_cuda_graphs(cfg, build_model_args(cfg), cuda_available=False)  # nothing to refuse


def test_cpu_run_is_refused_before_anything_is_built(tmp_path, capsys):
    code = main(debug_argv(tmp_path, "cpu", "--training.cuda_graphs=true"))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and "training.cuda_graphs" in err[0] and "CUDA device" in err[0], err
    assert not (tmp_path / "cpu" / "metrics.jsonl").exists()  # nothing was started


@pytest.mark.parametrize("override, key", [
    ("--compile.enable=true", "compile.enable"),
    ("--model.attn_mask_type=block_causal", "model.attn_mask_type"),
    ("--model.routing_kernel=compile", "model.routing_kernel"),
    ("--model.routing_kernel=triton", "model.routing_kernel"),
    ("--model.routing_kernel=auto", "model.routing_kernel"),
    ("--debug.force_nonfinite_loss_steps=[2]", "debug.force_nonfinite_loss_steps"),
])
def test_settings_that_cannot_be_captured_are_named(tmp_path, override, key):
    cfg = debug_cfg(tmp_path, "blocked", "--training.cuda_graphs=true", override)
    args = build_model_args(cfg)
    assert [b for b in capture_blockers(cfg, args) if b.startswith(key)]
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        check_cuda_graphs(cfg, args, cuda_available=True)


def test_a_capturable_gpu_job_passes_the_check(tmp_path):
    cfg = debug_cfg(tmp_path, "ok", "--training.cuda_graphs=true", "--activation_checkpoint.mode=full")
    args = build_model_args(cfg)
    assert capture_blockers(cfg, args) == []
    check_cuda_graphs(cfg, args, cuda_available=True)


def test_dry_run_names_a_blocker(tmp_path, capsys):
    from mhar_titan.dryrun import main as dry_main

    code = dry_main(debug_argv(tmp_path, "dry", "--training.cuda_graphs=true", "--compile.enable=true"))
    assert code == 2  # the dry run's exit code for an invalid job, as train.py's
    err = capsys.readouterr().err
    assert "invalid job" in err and "training.cuda_graphs" in err and "compile.enable" in err
