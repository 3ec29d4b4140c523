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


@contextmanager
def tmpfs(path: Path, size: int):
    """A tmpfs of ``size`` bytes mounted at ``path``; skips the test where mounting is not allowed."""
    path.mkdir(parents=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip() or done.returncode}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


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
