"""Checks before anything is built: a job whose memory estimate exceeds the memory it has, a resume at
another seq_len, a job name that would leave the dump folder, hub access that never comes. Each is
one line naming the setting and the fix, exit 2, before the model is built."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from helpers import PATIENCE_S  # noqa: E402
from train_common import ROOT, SAMPLE, debug_argv, debug_cfg  # noqa: E402

import mhar_titan.train as train_module  # noqa: E402
from mhar_titan.components.memory import GIB, MemoryFitError, available_memory, check_memory_fit  # noqa: E402
from mhar_titan.config import load_config  # noqa: E402
from mhar_titan.dryrun import build_meta_model, build_model_args, estimate_memory  # noqa: E402
from mhar_titan.dryrun import main as dryrun_main  # noqa: E402
from mhar_titan.exit_status import read_exit_status  # noqa: E402
from mhar_titan.train import main  # noqa: E402

pytestmark = pytest.mark.skipif(not (SAMPLE / "validation-00000-of-00001.parquet").exists(),
                                reason="run `python -m mhar_titan.data.prepare_shakespeare --out data/shakespeare`")
DEBUG = str(ROOT / "train_configs" / "debug_mhar.toml")
TINY = ["--training.local_batch_size=4", "--training.seq_len=32", "--validation.enable=false"]


@pytest.fixture
def no_model_built(monkeypatch):
    """Records every model the trainer builds (the real build runs)."""
    built = []
    real_build = train_module.build_model
    monkeypatch.setattr(train_module, "build_model", lambda *a, **k: built.append(1) or real_build(*a, **k))
    yield built
    assert built == [], "the model was built before the refusal"


def _error_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.strip()]


# --- case 3: the memory estimate against the memory there is ---------------------------------------------

def _estimate(cfg):
    return estimate_memory(build_meta_model(build_model_args(cfg)), cfg, 1, "cpu")


def test_memory_check_against_a_stated_available_memory():
    """The real estimate of a TINY job at seq_len 10^6 against stated numbers: one byte short refuses
    and says by how much and what to lower; "warn" returns the sentence; "off" and enough memory pass."""
    cfg = load_config(DEBUG, [*TINY, "--training.seq_len=1000000"])
    estimate = _estimate(cfg)
    # 10^6 tokens x the activations (the chunked loss path holds one chunk's logits, not all of them)
    assert estimate.total > 200 * GIB and estimate.loss_path < GIB
    with pytest.raises(MemoryFitError) as e:
        check_memory_fit(estimate, estimate.total - GIB, "stated", cfg)
    msg = str(e.value)
    assert f"its memory estimate per rank is {estimate.total / GIB:,.2f} GiB" in msg
    assert "1.00 GiB more than the" in msg and "(stated)" in msg and "\n" not in msg
    for fix in ("training.seq_len (1000000)", "training.local_batch_size (4", "activation_checkpoint.mode = \"full\"",
                "training.memory_check = \"warn\""):
        assert fix in msg, fix
    assert check_memory_fit(estimate, estimate.total, "stated", cfg) is None  # exactly fits
    warn = load_config(DEBUG, [*TINY, "--training.seq_len=1000000", "--training.memory_check=warn"])
    assert check_memory_fit(estimate, GIB, "stated", warn).startswith("the job does not fit")
    off = load_config(DEBUG, [*TINY, "--training.seq_len=1000000", "--training.memory_check=off"])
    assert check_memory_fit(estimate, GIB, "stated", off) is None
    full = load_config(DEBUG, [*TINY, "--training.seq_len=1000000", "--activation_checkpoint.mode=full"])
    with pytest.raises(MemoryFitError) as e:
        check_memory_fit(_estimate(full), GIB, "stated", full)
    assert "activation_checkpoint.mode" not in str(e.value)  # nothing to turn on


def test_dry_run_says_does_not_fit_for_a_stated_memory(capsys):
    argv = ["--config", DEBUG, *TINY, "--device", "cpu"]
    assert dryrun_main([*argv, "--memory-gib", "1024"]) == 0
    assert "  fit             fits in 1024.00 GiB (--memory-gib)" in capsys.readouterr().out
    assert dryrun_main([*argv, "--training.seq_len=1000000", "--memory-gib", "64"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dry run: the job does not fit:") and "GiB available (--memory-gib)" in err
    assert dryrun_main([*argv, "--training.seq_len=1000000", "--memory-gib", "64", "--training.memory_check=warn"]) == 0
    out = capsys.readouterr().out
    assert "does not fit in 64.00 GiB" in out and "dry run: does not fit (training.memory_check" in out


def test_trainer_refuses_a_job_that_does_not_fit_before_the_model_is_built(tmp_path, capsys, no_model_built):
    import torch

    cfg = load_config(DEBUG, [*TINY, "--training.seq_len=1000000"])
    assert _estimate(cfg).total > available_memory(torch.device("cpu"))[0]  # no test machine has 2.5 TB free
    run = tmp_path / "big"
    assert main(debug_argv(tmp_path, "big", "--training.local_batch_size=4", "--training.seq_len=1000000",
                           "--training.steps=1")) == 2
    err = _error_lines(capsys)
    assert len(err) == 1 and "MemoryFitError: the job does not fit" in err[0] and "host MemAvailable" in err[0], err
    assert read_exit_status(run / "exit_status")["status"] == "bad_input"


def test_resume_at_another_seq_len_is_refused_before_the_model_is_built(tmp_path, capsys, monkeypatch):
    argv = debug_argv(tmp_path, "r", "--training.local_batch_size=2", "--training.steps=1",
                      "--checkpoint.enable=true", "--checkpoint.interval=1")
    assert main(argv) == 0
    capsys.readouterr()
    built = []
    real_build = train_module.build_model
    monkeypatch.setattr(train_module, "build_model", lambda *a, **k: built.append(1) or real_build(*a, **k))
    assert main([*argv, "--training.steps=2", "--training.seq_len=16"]) == 2
    err = _error_lines(capsys)
    assert len(err) == 1 and "trained with training.seq_len = 32" in err[0] and "this start has 16" in err[0], err
    assert "--training.seq_len=32" in err[0] and 'exclude_from_loading = ["dataloader"]' in err[0]
    assert built == []


# --- case 12: hub access that never comes -------------------------------------------------------------------

HUB = ["--data.source=hub", "--data.validation_files=[]", "--data.hub_path=HuggingFaceFW/fineweb-edu",
       "--data.hub_name=sample-10BT", "--training.steps=1", "--training.local_batch_size=2"]


def test_hub_offline_stops_in_one_line_naming_the_dataset_and_the_local_settings(tmp_path, capsys, no_model_built):
    """The tests run with HF_HUB_OFFLINE / HF_DATASETS_OFFLINE (conftest): the machine without hub access."""
    assert main(debug_argv(tmp_path, "hub", *HUB)) == 2
    err = _error_lines(capsys)
    assert len(err) == 1, err
    for needle in ("'HuggingFaceFW/fineweb-edu' (configuration 'sample-10BT')", 'data.source = "local"',
                   'data.files = ["<folder>/*.parquet"]'):
        assert needle in err[0], (needle, err)


@pytest.mark.slow
@pytest.mark.processes
def test_unreachable_hub_stops_after_the_retry_budget(tmp_path):
    """A local stand-in for a hub that never answers: HF_ENDPOINT on a closed local port (connections
    refused, retried by huggingface_hub and by us). With a 1 s budget the first failed attempt is the
    last: exit 2, one line naming the dataset and the local-files settings."""
    import os
    import socket
    import subprocess

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "HF_ENDPOINT": f"http://127.0.0.1:{port}", "HF_HUB_OFFLINE": "0", "HF_DATASETS_OFFLINE": "0",
           "HF_HOME": str(tmp_path / "hf"), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, str(ROOT / "train.py"), *debug_argv(tmp_path, "hub", *HUB),
                        "--data.hub_retry_max_s=1"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=PATIENCE_S)
    assert r.returncode == 2, r.stderr[-3000:]
    last = [line for line in r.stderr.splitlines() if line.startswith("cannot start training")]
    assert len(last) == 1 and "failed after 1 attempt(s)" in last[0] and 'data.source = "local"' in last[0], r.stderr[-3000:]
    assert "'HuggingFaceFW/fineweb-edu'" in last[0]


# --- case 5: a job name is one folder name ------------------------------------------------------------------

def test_job_name_outside_the_dump_folder_exits_2_and_creates_nothing(tmp_path, capsys, no_model_built):
    dump = tmp_path / "a" / "b"
    assert main(debug_argv(dump, "../../escape", *TINY)) == 2
    err = _error_lines(capsys)
    assert len(err) == 1 and err[0].startswith("config error: ") and "'job.name' = '../../escape'" in err[0], err
    assert list(tmp_path.iterdir()) == []  # neither the escaped folder nor the dump folder
