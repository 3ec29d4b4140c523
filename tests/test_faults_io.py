"""Faults of files and saving: a full disk during a checkpoint save, a non-finite state, files
written with the umask's mode and all-or-nothing, unwritable output folders, empty run configs."""
import errno
import json
import logging
import os
import shutil
import stat
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from helpers import tmpfs  # noqa: E402
from train_common import SAMPLE, debug_argv  # noqa: E402

from mhar_titan.checkpoint.layout import is_complete, step_folders  # noqa: E402
from mhar_titan.exit_status import read_exit_status  # noqa: E402
from mhar_titan.train import main  # noqa: E402

needs_sample = pytest.mark.skipif(not (SAMPLE / "validation-00000-of-00001.parquet").exists(),
                                  reason="run `python -m mhar_titan.data.prepare_shakespeare --out data/shakespeare`")
# byte tokenizer: a model of a few MB, so a checkpoint fits a small tmpfs and a run takes seconds
SMALL = ("--training.local_batch_size=4", "--data.tokenizer=bytes", "--checkpoint.enable=true",
         "--checkpoint.interval=2", "--checkpoint.keep_latest_k=1", "--training.steps=4")


def losses(run_dir):
    path = Path(run_dir) / "metrics.jsonl"
    return {r["step"]: r["loss"] for r in map(json.loads, path.read_text().splitlines()) if "loss" in r}


def err_lines(capsys):
    return [line for line in capsys.readouterr().err.splitlines() if line.strip()]


@needs_sample
def test_full_disk_save_fails_in_one_line_keeps_the_last_checkpoint_and_resumes_bitwise(tmp_path, capsys, caplog):
    # the run that never fails: its step-2 folder's size sizes the small filesystem
    ref = tmp_path / "ref"
    assert main(debug_argv(tmp_path, "ref", *SMALL, "--checkpoint.keep_latest_k=0")) == 0
    one = sum(p.stat().st_size for p in (ref / "checkpoints" / "step-2").iterdir())
    capsys.readouterr()

    with tmpfs(tmp_path / "small", one + one // 2) as small:
        run = small / "full"
        with caplog.at_level(logging.WARNING, logger="mhar_titan.checkpoint.manager"):
            assert main(debug_argv(small, "full", *SMALL)) == 2
        assert any("a coming save will fail" in r.getMessage() for r in caplog.records)  # warned before the first save
        err = err_lines(capsys)
        assert len(err) == 1, err
        assert "disk is full" in err[0] and str(run / "checkpoints" / "step-4") in err[0] and "bytes" in err[0]
        assert read_exit_status(run / "exit_status")["status"] == "bad_input"
        folders = step_folders(run / "checkpoints")
        assert sorted(folders) == [2] and is_complete(folders[2])  # the half-written step-4 is gone
        config = (run / "config.toml").read_text()
        assert config.strip()

        # a relaunch on the same full disk fails the same way and loses nothing (config.toml kept whole)
        assert main(debug_argv(small, "full", *SMALL)) == 2
        assert "disk is full" in err_lines(capsys)[-1]
        assert (run / "config.toml").read_text() == config
        assert sorted(step_folders(run / "checkpoints")) == [2]
        shutil.copytree(run, tmp_path / "moved", ignore=shutil.ignore_patterns(".lock"))

    # the kept checkpoint resumes, on a filesystem with room, bitwise like the run that never failed
    assert main(debug_argv(tmp_path, "moved", *SMALL)) == 0
    assert losses(tmp_path / "moved") == losses(ref)


class _FullDisk:
    """A DCP stream that raises ENOSPC once ``limit`` bytes were written (as a full filesystem does)."""

    def __init__(self, stream, budget):
        self._stream, self._budget = stream, budget

    def write(self, data):
        if self._budget[0] < len(data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self._budget[0] -= len(data)
        return self._stream.write(data)

    def __getattr__(self, name):
        return getattr(self._stream, name)


@needs_sample
@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_a_write_failing_with_enospc_is_reported_and_removed_sync_and_async(tmp_path, capsys, monkeypatch, mode):
    from torch.distributed.checkpoint.filesystem import FileSystem

    real = FileSystem.create_stream
    budget = [10 ** 5]

    @contextmanager
    def create_stream(self, path, mode_):
        with real(self, path, mode_) as stream:
            yield _FullDisk(stream, budget) if "w" in mode_ else stream

    monkeypatch.setattr(FileSystem, "create_stream", create_stream)
    assert main(debug_argv(tmp_path, "r", *SMALL, f"--checkpoint.async_mode={mode}")) == 2
    err = err_lines(capsys)
    assert len(err) == 1 and "disk is full" in err[0] and "ENOSPC" in err[0], err
    assert str(tmp_path / "r" / "checkpoints" / "step-2") in err[0]  # the first save failed
    assert step_folders(tmp_path / "r" / "checkpoints") == {}


def test_a_nonfinite_state_is_never_saved_and_the_previous_checkpoint_stays_newest(tmp_path):
    from mhar_titan.checkpoint import CheckpointConfig, CheckpointManager, CheckpointSaveError

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    ckpt = CheckpointManager(CheckpointConfig(enable=True, interval=1, keep_latest_k=2), tmp_path,
                             model=model, optimizer=optimizer)
    assert ckpt.save(1)
    with torch.no_grad():
        model[1].bias[0] = float("inf")
    with pytest.raises(CheckpointSaveError, match=r"refusing to save .*step-2.*1\.bias.*newest checkpoint stays .*step-1"):
        ckpt.save(2)
    with torch.no_grad():
        model[1].bias[0] = 0.0
        next(iter(optimizer.state.values()))["exp_avg"][0] = float("nan")  # the optimizer state too
    with pytest.raises(CheckpointSaveError, match="exp_avg"):
        ckpt.save(3)
    assert sorted(step_folders(tmp_path / "checkpoints")) == [1]


# --- files others can read, written all-or-nothing ------------------------------------------------------

@contextmanager
def umask(mask):
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def modes(folder):
    return {p.relative_to(folder).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in Path(folder).rglob("*")}


@pytest.mark.parametrize("mask", [0o022, 0o027], ids=["umask022", "umask027"])
def test_convert_outputs_have_the_umask_mode(tmp_path, mask):
    pytest.importorskip("safetensors")
    from helpers import tiny_model

    from mhar_titan.convert.__main__ import main as convert_main
    from mhar_titan.convert.dcp_io import save_model_dcp

    ckpt = save_model_dcp(tiny_model(vocab_size=320), tmp_path / "ckpt")
    with umask(mask):
        assert convert_main(["export", str(ckpt), str(tmp_path / "mhar"), "--format", "mhar",
                             "--tokenizer", "bytes"]) == 0
        assert convert_main(["export", str(ckpt), str(tmp_path / "sharded"), "--format", "mhar",
                             "--max-shard-gb", "0.0001", "--tokenizer", "bytes"]) == 0
        assert convert_main(["import", str(tmp_path / "mhar"), str(tmp_path / "back")]) == 0
    for out in ("mhar", "sharded", "back"):
        found = modes(tmp_path / out)
        assert found == {name: 0o666 & ~mask for name in found}, (out, found)  # model.safetensors was 0600
        assert stat.S_IMODE((tmp_path / out).stat().st_mode) == 0o777 & ~mask
    assert "model.safetensors" in modes(tmp_path / "mhar") and "model.safetensors.index.json" in modes(tmp_path / "sharded")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left


def test_written_files_have_the_umask_mode_and_a_failed_write_keeps_the_old_file(tmp_path, monkeypatch):
    from mhar_titan.exit_status import write_exit_status
    from mhar_titan.files import WriteError, write_text

    with umask(0o027):
        write_exit_status(tmp_path, "completed", 0, 3)
        write_text(tmp_path / "config.toml", "[training]\n")
    assert modes(tmp_path) == {"exit_status": 0o640, "config.toml": 0o640}

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)  # the data does not reach the disk
    with pytest.raises(WriteError, match=r"cannot write .*config\.toml: the disk is full .*ENOSPC"):
        write_text(tmp_path / "config.toml", "[job]\n")
    assert (tmp_path / "config.toml").read_text() == "[training]\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.toml", "exit_status"]  # no temporary left


def test_an_interrupted_data_preparation_leaves_no_folder_and_keeps_an_earlier_one(tmp_path, monkeypatch):
    import pyarrow.parquet as pq

    from mhar_titan.data import prepare_shakespeare, pretokenize

    rows = {"hamlet": [{"text": "To be.", "token_count": 2}], "lear": [{"text": "Nothing.", "token_count": 1}],
            **{name: [{"text": "Sooth.", "token_count": 1}] for name in prepare_shakespeare.VALIDATION_WORKS}}
    real_write = pq.write_table
    calls = []

    def interrupted(table, where, *a, **k):
        calls.append(where)
        if len(calls) == 2:
            raise KeyboardInterrupt  # Ctrl-C after the validation shard
        return real_write(table, where, *a, **k)

    monkeypatch.setattr(prepare_shakespeare.pq, "write_table", interrupted)
    out = tmp_path / "shakespeare"
    with pytest.raises(KeyboardInterrupt):
        prepare_shakespeare.write_shards(rows, out, 2)
    assert list(tmp_path.iterdir()) == []  # not the validation shard alone (make's target)
    monkeypatch.setattr(prepare_shakespeare.pq, "write_table", real_write)
    files = prepare_shakespeare.write_shards(rows, out, 2)
    assert sorted(p.name for p in out.iterdir()) == sorted(files)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    calls.clear()
    monkeypatch.setattr(prepare_shakespeare.pq, "write_table", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare_shakespeare.write_shards(rows, out, 2)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before and len(list(tmp_path.iterdir())) == 1

    class Tok:
        name, n_vocab, eos_id = "bytes", 260, 256

    def shards(fail_at=None):
        for k in range(2):
            if k == fail_at:
                raise KeyboardInterrupt
            yield f"src{k}", "0" * 64, [torch.arange(5).numpy()]

    tokens = tmp_path / "tokens"
    with pytest.raises(KeyboardInterrupt):
        pretokenize.write_pretokenized(tokens, shards(fail_at=1), Tok())
    assert not tokens.exists()
    assert pretokenize.write_pretokenized(tokens, shards(), Tok())["shards"][1]["n_tokens"] == 5


# --- run configs that are empty or unreadable ---------------------------------------------------------

def test_readers_refuse_an_empty_or_broken_run_config_instead_of_defaults(tmp_path, capsys):
    from mhar_titan.analysis.__main__ import main as analysis_main
    from mhar_titan.eval.__main__ import main as eval_main
    from mhar_titan.generate import main as generate_main

    run = tmp_path / "run"
    run.mkdir()
    for text, needle in (("", "is empty (0 bytes"), ("[job]\nname = 'run'\n", "no [training] table"),
                         ("[training\n", "not valid TOML")):
        (run / "config.toml").write_text(text)
        for command in (lambda: eval_main(["perplexity", str(run)]), lambda: generate_main([str(run)]),
                        lambda: analysis_main(["heatmap", str(run)])):
            assert command() == 2
            err = err_lines(capsys)
            assert len(err) == 1 and needle in err[0] and str(run / "config.toml") in err[0], err


# --- output folders that cannot be written ------------------------------------------------------------

@needs_sample
def test_unwritable_output_folders_are_refused_in_one_line_before_anything_is_built(tmp_path, capsys, monkeypatch):
    import mhar_titan.train as train_module
    from mhar_titan.analysis.__main__ import main as analysis_main
    from mhar_titan.convert.__main__ import main as convert_main
    from mhar_titan.experiments.__main__ import main as experiments_main

    built = []
    monkeypatch.setattr(train_module, "Trainer", lambda *a, **k: built.append(1))
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    under = blocker / "runs"

    assert main(debug_argv(under, "r")) == 2
    err = err_lines(capsys)
    assert len(err) == 1 and f"{under / 'r'} is under the regular file {blocker}" in err[0], err
    assert convert_main(["export", str(tmp_path / "missing"), str(under / "out")]) == 2
    assert f"is under the regular file {blocker}" in err_lines(capsys)[0]
    assert analysis_main(["compare", str(tmp_path), "--out", str(under)]) == 2
    assert f"is under the regular file {blocker}" in err_lines(capsys)[0]
    sweep = Path(__file__).resolve().parents[1] / "train_configs" / "sweeps" / "study_bytes.toml"
    assert experiments_main(["run", str(sweep), "--dump-folder", str(under)]) == 2
    assert f"is under the regular file {blocker}" in err_lines(capsys)[0]

    with tmpfs(tmp_path / "ro", 1 << 20) as ro:
        subprocess.run(["mount", "-o", "remount,ro", str(ro)], check=True)
        assert main(debug_argv(ro, "r")) == 2
        err = err_lines(capsys)
        assert len(err) == 1 and str(ro / "r") in err[0] and "read-only (EROFS)" in err[0], err
        assert convert_main(["export", str(tmp_path / "missing"), str(ro / "out")]) == 2
        assert "read-only (EROFS)" in err_lines(capsys)[0]
    assert built == []
