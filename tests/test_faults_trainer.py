"""Faults a user meets, on the trainer: bad data stops every rank early and in one line (exit 2),
the validation loss does not depend on the batch layout, a relaunch of the same job after a crash
starts again, an initial checkpoint loads with checkpointing off, retention cannot leave a folder
that looks complete, and RNG states are the same with and without a resume."""
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from helpers import PATIENCE_S  # noqa: E402
from train_common import ROOT, SAMPLE, debug_argv, debug_cfg  # noqa: E402

import mhar_titan.train as train_module  # noqa: E402
from mhar_titan.checkpoint.items import rng_state  # noqa: E402
from mhar_titan.checkpoint.layout import MARKER, is_complete, step_folders  # noqa: E402
from mhar_titan.exit_status import read_exit_status  # noqa: E402
from mhar_titan.train import Trainer, main  # noqa: E402

pytestmark = pytest.mark.skipif(not (SAMPLE / "validation-00000-of-00001.parquet").exists(),
                                reason="run `python -m mhar_titan.data.prepare_shakespeare --out data/shakespeare`")
TINY = ("--training.local_batch_size=4",)
TRAIN_GLOB = f"{SAMPLE}/train-*.parquet"


def rows(run_dir, name="metrics.jsonl"):
    path = Path(run_dir) / name
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def losses(run_dir):
    return {r["step"]: r["loss"] for r in rows(run_dir) if "loss" in r}


# --- bad input: before the model is built, one line, exit 2 ---------------------------------------------

def _bad_files(tmp_path):
    empty, nulls, ints = tmp_path / "empty.parquet", tmp_path / "nulls.parquet", tmp_path / "ints.parquet"
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), empty)
    pq.write_table(pa.table({"text": pa.array([None] * 4, pa.string())}), nulls)
    pq.write_table(pa.table({"text": [1, 2, 3]}), ints)
    tiny_val = tmp_path / "tiny_val.parquet"
    pq.write_table(pa.table({"text": ["To be.", "Or not.", "That is the question."]}), tiny_val)
    return {
        "empty shard": ([f'--data.files=["{TRAIN_GLOB}", "{empty}"]'], f"parquet file {empty} has no rows"),
        "all-null text": ([f'--data.files=["{TRAIN_GLOB}", "{nulls}"]'], f"{nulls}: all 4 values of column 'text'"),
        "int text column": ([f'--data.files=["{TRAIN_GLOB}", "{ints}"]'], f"{ints}: column 'text' has type int64"),
        "glob matching nothing": ([f'--data.files=["{tmp_path}/none-*.parquet"]'], "matches no file"),
        "validation set too small": ([f'--data.validation_files=["{tiny_val}"]', "--validation.enable=true",
                                      "--validation.sequences=4"], "hold fewer than 33 tokens"),
    }


def test_bad_data_is_refused_before_the_model_is_built_in_one_line(tmp_path, monkeypatch, capsys):
    built = []
    real_build = train_module.build_model
    monkeypatch.setattr(train_module, "build_model", lambda *a, **k: built.append(1) or real_build(*a, **k))
    for case, (overrides, expected) in _bad_files(tmp_path).items():
        run = tmp_path / "runs" / case.replace(" ", "_")
        assert main(debug_argv(tmp_path / "runs", run.name, *TINY, *overrides)) == 2, case
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(err) == 1 and expected in err[0], (case, err)
        assert read_exit_status(run / "exit_status")["status"] == "bad_input"
    assert built == []  # every one refused before a model was built


def test_validation_set_too_small_suggests_a_value_the_config_accepts(tmp_path, capsys):
    val = tmp_path / "val.parquet"
    pq.write_table(pa.table({"text": [" ".join(["word"] * 60)] * 3}), val)  # 183 tokens: 5 windows of 33
    argv = debug_argv(tmp_path, "v", *TINY, f'--data.validation_files=["{val}"]', "--validation.enable=true",
                      "--validation.sequences=16", "--training.steps=1")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "set validation.sequences to at most 5" in err
    assert main([*argv, "--validation.sequences=5"]) == 0


# --- the validation loss does not depend on micro-batch size, accumulation or its own batch size -------

def test_validation_loss_equal_across_micro_batch_and_accumulation(tmp_path):
    val_losses = []
    for layout in (("--training.local_batch_size=4", "--training.global_batch_size=4", "--validation.sequences=10"),
                   ("--training.local_batch_size=1", "--training.global_batch_size=4",
                    "--validation.local_batch_size=3", "--validation.tokens=320")):  # 10 sequences of 32
        cfg = debug_cfg(tmp_path, f"val{len(val_losses)}", *layout, "--validation.enable=true")
        trainer = Trainer(cfg)
        try:
            val_losses.append(trainer.validate())
        finally:
            trainer.close()
    assert val_losses[0] == pytest.approx(val_losses[1], rel=1e-5), val_losses


# --- crash recovery: relaunch, initial load, RNG states ---------------------------------------------------

def test_relaunch_initial_load_and_rng_states(tmp_path):
    ckpt = ("--checkpoint.enable=true", "--checkpoint.interval=1")
    # straight: 2 steps; resumed: 1 step, then resumed to 2. The RNG states after step 2 agree.
    straight = debug_argv(tmp_path, "straight", *TINY, *ckpt, "--training.steps=2")
    assert main(straight) == 0
    rng_straight = rng_state()
    assert main(debug_argv(tmp_path, "resumed", *TINY, *ckpt, "--training.steps=1")) == 0
    assert main(debug_argv(tmp_path, "resumed", *TINY, *ckpt, "--training.steps=2")) == 0
    rng_resumed = rng_state()
    assert rng_resumed["python"] == rng_straight["python"] and rng_resumed["numpy"] == rng_straight["numpy"]
    assert torch.equal(rng_resumed["torch"], rng_straight["torch"])
    assert losses(tmp_path / "resumed") == losses(tmp_path / "straight")

    # a job killed before its first complete checkpoint: no folder is complete any more
    run = tmp_path / "straight"
    first = losses(run)
    for folder in step_folders(run / "checkpoints").values():
        (folder / MARKER).unlink()
    assert main(debug_argv(tmp_path, "straight", *TINY, *ckpt, "--training.steps=2", "--optimizer.lr=1e-4")) == 2
    assert main(straight) == 0  # the same job starts again
    assert losses(run) == first and len(rows(run)) == len(rows(run, "metrics.jsonl.aborted-1"))

    # an initial checkpoint with checkpointing off: loaded (model only), nothing saved
    argv = debug_argv(tmp_path, "from_init", *TINY, "--checkpoint.enable=false", "--training.steps=1",
                      f"--checkpoint.initial_load_path={run / 'checkpoints' / 'step-1'}")
    assert main(argv) == 0
    assert losses(tmp_path / "from_init")[1] < first[1] - 0.01  # the same first batch, after one step on it
    assert not (tmp_path / "from_init" / "checkpoints").exists()


def test_retention_deletes_the_marker_first_and_a_folder_missing_a_file_is_incomplete(tmp_path, monkeypatch):
    from mhar_titan.checkpoint import manager as manager_module
    from mhar_titan.config.checkpoint import CheckpointConfig

    mgr = manager_module.CheckpointManager(CheckpointConfig(enable=True, keep_latest_k=1), tmp_path,
                                           model=torch.nn.Linear(2, 2))
    for step in (1, 2):
        mgr.save(step, force=True)
    folders = step_folders(tmp_path / "checkpoints")
    assert sorted(folders) == [2] and is_complete(folders[2])  # step-1 deleted by retention
    mgr.save(3, force=True)
    data = next(p for p in step_folders(tmp_path / "checkpoints")[3].iterdir() if p.suffix == ".distcp")
    data.rename(data.with_suffix(".moved"))
    assert not is_complete(data.parent)  # a folder that lost a data file is not complete
    data.with_suffix(".moved").rename(data)
    from mhar_titan.checkpoint import layout
    monkeypatch.setattr(layout.shutil, "rmtree", lambda *a, **k: None)  # killed as deletion starts
    mgr.save(4, force=True)
    folders = step_folders(tmp_path / "checkpoints")
    assert sorted(folders) == [3, 4] and not is_complete(folders[3])  # files left, marker gone
    assert is_complete(folders[4])


# --- a bad row met by one rank in the middle of training stops every rank in that step --------------------

@pytest.mark.processes
def test_bad_row_on_one_rank_stops_every_rank_in_that_step_with_exit_2(tmp_path):
    rng, words = random.Random(0), "to be or not that is the question whether tis nobler".split()
    shards = []
    for s in range(2):
        docs = [{"text": " ".join(rng.choice(words) for _ in range(rng.randint(20, 40)))} for _ in range(60)]
        if s == 1:
            docs[30] = {"text": ["not", "text"]}  # rank 1 owns shard 1 (document sharding, no shuffle)
        path = tmp_path / f"shard{s}.jsonl"
        path.write_text("".join(json.dumps(d) + "\n" for d in docs))
        shards.append(str(path))
    (tmp_path / "exit").mkdir()
    argv = debug_argv(tmp_path, "bad_row", *TINY, "--training.steps=200", "--data.sharding=document",
                      "--data.shuffle=false", f"--data.files={json.dumps(shards)}")
    proc = _torchrun(argv, tmp_path / "exit")
    out, _ = proc.communicate(timeout=PATIENCE_S)  # a hang guard only
    lines = out.splitlines()
    assert any(line.startswith("step ") for line in lines), out[-3000:]
    assert {p.name: p.read_text() for p in (tmp_path / "exit").iterdir()} == {"rank0.rc": "2", "rank1.rc": "2"}
    error = [line for line in lines if "training stopped: DataError" in line]
    assert any(f"{shards[1]} row 30: the text field holds a list, not text" in line for line in error), out[-3000:]
    # rank 0 stopped in the step where rank 1 met the row, told by the per-step agreement, not by a
    # collective timeout (an event in the output instead of a time measured under whatever load)
    told = [line for line in error if "rank 1 stopped at step" in line]
    assert len(told) == 1 and "timed out" not in out.lower(), out[-3000:]
    assert out.count("Traceback") == 1 and "ChildFailedError" in out  # torchrun's own report of exit code 2 only
    assert read_exit_status(tmp_path / "bad_row" / "exit_status")["status"] == "bad_input"

    # a relaunch with another config into that folder is refused on both ranks alike (exit 2, no abort)
    for rc in (tmp_path / "exit").iterdir():
        rc.unlink()
    refused = _torchrun([*argv, "--optimizer.lr=1e-4"], tmp_path / "exit")
    out, _ = refused.communicate(timeout=PATIENCE_S)
    assert {p.name: p.read_text() for p in (tmp_path / "exit").iterdir()} == {"rank0.rc": "2", "rank1.rc": "2"}, out
    assert "already holds a run" in out and "SIGABRT" not in out and "terminate called" not in out


def _torchrun(argv, exit_dir):
    """``torchrun --nproc_per_node=2 train.py ARGV`` (through tests/ckpt_train_entry.py, which records
    each rank's exit code in ``exit_dir``), output on stdout."""
    return subprocess.Popen([str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc_per_node=2",
                             "tests/ckpt_train_entry.py", *argv], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "CKPT_EXIT_DIR": str(exit_dir), "OMP_NUM_THREADS": "1"})


# --- every folder the run writes is checked at start; a save that fails later is not "done" -------------

@pytest.mark.parametrize("setting, flags, blocked", [
    ("checkpoint.folder", ["--checkpoint.enable=true"], "checkpoints"),
    ("metrics.jsonl_file's folder", ["--metrics.jsonl_file=logs/metrics.jsonl"], "logs"),
    ("metrics.save_tb_folder", ["--metrics.enable_tensorboard=true"], "tb"),
    ("the wandb folder (metrics.enable_wandb)", ["--metrics.enable_wandb=true"], "wandb"),
    ("profiling.save_traces_folder", ["--profiling.enable_profiling=true"], "profile_traces"),
    ("profiling.save_memory_snapshot_folder", ["--profiling.enable_memory_snapshot=true"], "memory_snapshot"),
])
def test_an_unwritable_output_folder_is_refused_before_the_model_is_built(tmp_path, monkeypatch, capsys, setting,
                                                                          flags, blocked):
    """A regular file where the run would write a folder (the check a read-only folder fails too):
    exit 2 on every rank, one line naming the setting, before the model is built and before any step."""
    built = []
    real_build = train_module.build_model
    monkeypatch.setattr(train_module, "build_model", lambda *a, **k: built.append(1) or real_build(*a, **k))
    run = tmp_path / "run"
    run.mkdir()
    (run / blocked).write_text("not a folder\n")
    assert main(debug_argv(tmp_path, "run", *TINY, "--training.steps=2", *flags)) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and f"{setting}: {run / blocked}" in err[0] and "is a regular file" in err[0], err
    assert built == [] and not (run / "metrics.jsonl").exists()


def test_a_save_that_fails_later_stops_the_run_without_a_done_summary(tmp_path, capsys):
    """A file where step 2's checkpoint goes (found only when step 2 saves): the summary's first line
    says the run stopped and why, then one error line; exit 2; the stray file is left alone."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "step-2").write_text("a stray file\n")
    argv = debug_argv(tmp_path, "run", *TINY, "--training.steps=3", "--checkpoint.enable=true",
                      "--checkpoint.interval=2")
    assert main(argv) == 2
    out, err = capsys.readouterr()
    summary = [line for line in out.splitlines() if " | stopped " in line or " | done " in line]
    assert len(summary) == 1 and summary[0].startswith("step 2/3 | stopped (CheckpointSaveError, below) | 2 steps")
    err = [line for line in err.splitlines() if line.strip() and not line.startswith(("ERROR", "WARNING"))]
    assert err[-1].startswith("training stopped: CheckpointSaveError: checkpoint ") and "move it away" in err[-1]
    assert (run / "checkpoints" / "step-2").read_text() == "a stray file\n"
    assert read_exit_status(run / "exit_status")["status"] == "bad_input"
