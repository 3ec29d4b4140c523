"""Every writer on a real full filesystem: a small tmpfs mounted for the test and filled up.

Libraries report a full disk in their own exceptions (safetensors' ``SafetensorError``, DCP's
``CheckpointException``, tensorboard's writer thread, pyarrow's and matplotlib's ``OSError``);
each command must still end in the one-line ``cannot write ...: the disk is full`` error
(``mhar_titan.files``, the one owner), exit status 2, with nothing half-written left. Mounting
needs root (CAP_SYS_ADMIN); where it is not allowed the tests skip and say so.
"""
from __future__ import annotations

from pathlib import Path

import pytest
from helpers import tiny_model, tmpfs

from mhar_titan.files import WriteError


def _left(folder: Path) -> list[str]:
    """What is in the filesystem besides the filler: should be nothing."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.name != "fill")


def _one_error_line(capsys) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1, err
    assert "the disk is full" in err[0] and "ENOSPC" in err[0] and "Traceback" not in err[0], err
    return err[0]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A model-only DCP checkpoint of a tiny MHAR model (byte tokenizer; about 170 KB of weights)."""
    from mhar_titan.convert.dcp_io import save_model_dcp

    path = tmp_path_factory.mktemp("ckpt") / "step-0"
    save_model_dcp(tiny_model(vocab_size=320), path, tokenizer="bytes")
    return path


def test_convert_export_on_a_full_disk_fails_in_one_line_and_leaves_nothing(checkpoint, tmp_path, capsys):
    """64 KiB free: the small JSON files fit, the safetensors weights do not (safetensors raises
    ``SafetensorError ... (os error 28)``, not an ``OSError``)."""
    from mhar_titan.convert.__main__ import main

    with tmpfs(tmp_path / "fs", "1m", leave=1 << 16) as fs:
        assert main(["export", str(checkpoint), str(fs / "out")]) == 2
        line = _one_error_line(capsys)
        assert line.startswith(f"python -m mhar_titan.convert export: error: cannot write {fs / 'out'}/shard-"), line
        assert _left(fs) == []


def test_convert_import_on_a_full_disk_fails_in_one_line_and_leaves_nothing(checkpoint, tmp_path, capsys):
    """DCP's writer reports the full disk inside a ``CheckpointException`` (per-rank failures)."""
    from mhar_titan.convert.__main__ import main

    assert main(["export", str(checkpoint), str(tmp_path / "hf")]) == 0
    capsys.readouterr()
    with tmpfs(tmp_path / "fs", "1m", leave=1 << 12) as fs:
        assert main(["import", str(tmp_path / "hf"), str(fs / "ckpt")]) == 2
        assert _one_error_line(capsys).startswith("python -m mhar_titan.convert import: error: cannot write ")
        assert _left(fs) == []


def test_safetensors_writer_raises_write_error_and_keeps_the_earlier_file(tmp_path):
    import torch

    from mhar_titan.convert.safetensors_io import ShardedWriter
    from mhar_titan.files import write_bytes

    with tmpfs(tmp_path / "fs", "256k", leave=1 << 12) as fs:
        write_bytes(fs / "earlier.bin", b"x" * 100)
        with pytest.raises(WriteError, match=r"cannot write .*: the disk is full .*ENOSPC"):
            writer = ShardedWriter(fs, 1 << 30)
            writer.add("w", torch.zeros(1 << 16))
            writer.close()
        assert _left(fs) == ["earlier.bin"] and (fs / "earlier.bin").read_bytes() == b"x" * 100


def _curves_run(folder: Path) -> Path:
    """A run folder with only a metrics file: what `analysis compare` reads."""
    folder.mkdir()
    rows = [f'{{"step": {s}, "loss": {5 - s / 10}, "tokens_seen": {64 * s}, "val_loss": {5.1 - s / 10}}}'
            for s in range(1, 9)]
    (folder / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    return folder


def test_a_figure_on_a_full_disk_fails_in_one_line_and_leaves_nothing(tmp_path, capsys):
    from mhar_titan.analysis.__main__ import main

    a, b = _curves_run(tmp_path / "a"), _curves_run(tmp_path / "b")
    with tmpfs(tmp_path / "fs", "256k", leave=0) as fs:
        assert main(["compare", str(a), str(b), "-k", "2", "--out", str(fs / "cmp")]) == 2
        line = _one_error_line(capsys)
        assert line.startswith("python -m mhar_titan.analysis compare: error: cannot write ") and ".png" in line
        assert [p for p in _left(fs) if p != "cmp"] == []  # the output folder itself may exist, empty


def test_prepared_parquet_shards_on_a_full_disk_raise_write_error_and_leave_nothing(tmp_path):
    """pyarrow's parquet writer (prepare_shakespeare's shards) into a folder renamed into place."""
    from mhar_titan.data.prepare_shakespeare import VALIDATION_WORKS, write_shards

    text = "To be, or not to be, that is the question. " * 200
    rows = {name: [{"text": text, "id": f"{name}/1", "title": name, "part": 1, "file_path": name, "language": "en",
                    "token_count": len(text)}] for name in (*VALIDATION_WORKS, "hamlet", "macbeth")}
    with tmpfs(tmp_path / "fs", "256k", leave=1 << 12) as fs:
        with pytest.raises(WriteError, match=r"cannot write .*shards: the disk is full .*ENOSPC"):
            write_shards(rows, fs / "shards", 2)
        assert _left(fs) == []


def test_pretokenize_on_a_full_disk_fails_in_one_line_and_leaves_nothing(tmp_path, capsys):
    from mhar_titan.data.pretokenize import main

    source = tmp_path / "docs.jsonl"
    source.write_text("".join('{"text": "' + "word " * 400 + f'{i}"}}\n' for i in range(20)))
    with tmpfs(tmp_path / "fs", "256k", leave=1 << 12) as fs:
        with pytest.raises(SystemExit) as exit_:
            main(["--files", str(source), "--out", str(fs / "tokens"), "--tokenizer", "bytes"])
        assert exit_.value.code == 2
        assert "the disk is full" in capsys.readouterr().err
        assert _left(fs) == []


def test_metric_sinks_on_a_full_disk_raise_write_error(tmp_path, capsys):
    """The trainer's TensorBoard event file (written by tensorboard's own thread) and JSONL log:
    the full disk is one ``WriteError`` (train.main prints it in one line, exit 2), and the
    writer thread prints no traceback of its own."""
    from mhar_titan.metrics import JSONLSink, TensorBoardSink

    with tmpfs(tmp_path / "fs", "256k", leave=0) as fs:
        with pytest.raises(WriteError, match=r"cannot write .*tb: the disk is full .*ENOSPC"):
            sink = TensorBoardSink(fs / "tb")
            for step in range(1, 10_000):
                sink.log(step, {"loss": 1.0 / step})
        sink = JSONLSink(fs / "metrics.jsonl")
        with pytest.raises(WriteError, match=r"cannot write .*metrics\.jsonl: the disk is full .*ENOSPC"):
            for step in range(1, 10_000):
                sink.log(step, {"loss": 1.0 / step, "note": "x" * 100})
                sink.flush()
        sink.close()
    err = capsys.readouterr().err
    assert "Traceback" not in err and "Exception in thread" not in err, err


def test_only_os_failures_become_write_errors(tmp_path):
    """A bug inside a write keeps its own exception (and the temporary file goes); a library error
    that names an OS errno in its text, or a DCP failure over one, is an OS failure."""
    from mhar_titan.files import atomic_path, os_error_of

    with pytest.raises(ZeroDivisionError):
        with atomic_path(tmp_path / "x.bin") as tmp:
            tmp.write_bytes(b"partial")
            1 / 0
    assert list(tmp_path.iterdir()) == []
    assert os_error_of(ValueError("shape mismatch in layer 3")) is None
    safetensors_text = "Error while serializing: I/O error: No space left on device (os error 28)"
    assert os_error_of(RuntimeError(safetensors_text)).errno == 28
    try:
        try:
            raise OSError(30, "Read-only file system")
        except OSError as inner:
            raise RuntimeError("wrapped") from inner
    except RuntimeError as outer:
        assert os_error_of(outer).errno == 30


@pytest.mark.lm_eval
def test_lm_eval_results_on_a_full_disk_fail_in_one_line_and_leave_nothing(checkpoint, tmp_path, capsys, monkeypatch):
    """lm-eval's results writer catches its own failed write and only logs it (leaving an empty
    results file): the command still ends in the one disk-full line, exit 2, and removes it."""
    pytest.importorskip("lm_eval")
    from helpers import ROOT

    from mhar_titan.eval.__main__ import main

    monkeypatch.chdir(ROOT)  # the local task files name their data relative to the repository root
    with tmpfs(tmp_path / "fs", "256k", leave=1 << 11) as fs:
        assert main(["lm-eval", str(checkpoint), "--tasks", "shakespeare_choice", "--include-path", "eval_tasks",
                     "--limit", "2", "--output-path", str(fs / "results"), "--log-samples"]) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if "error:" in line or "Could not" in line]
        assert len(err) == 1 and err[0].startswith("python -m mhar_titan.eval lm-eval: error: cannot write "), err
        assert "the disk is full" in err[0] and "ENOSPC" in err[0], err
        assert [p for p in _left(fs) if p != "results"] == []


def test_training_on_a_disk_that_fills_up_stops_in_one_line_and_its_log_reads_back(tmp_path, capsys):
    """The disk fills while the trainer appends its JSONL log: one line naming the file, exit 2;
    the torn last row is left out by every reader (the end-of-run summary, a resumed sink, compare)."""
    import json
    import shutil

    from train_common import SAMPLE, debug_argv

    from mhar_titan.analysis.compare import read_run
    from mhar_titan.metrics import JSONLSink, read_jsonl_rows
    from mhar_titan.train import main

    if not (SAMPLE / "validation-00000-of-00001.parquet").exists():
        pytest.skip("run `python -m mhar_titan.data.prepare_shakespeare --out data/shakespeare`")
    with tmpfs(tmp_path / "fs", "256k", leave=12 << 10) as fs:
        assert main(debug_argv(fs, "r", "--training.local_batch_size=2", "--data.tokenizer=bytes",
                               "--training.steps=400")) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(err) == 1 and err[0].startswith(f"training stopped: WriteError: cannot write {fs / 'r'}"
                                                   "/metrics.jsonl: the disk is full"), err
        shutil.copytree(fs / "r", tmp_path / "r", ignore=shutil.ignore_patterns(".lock"))
    log = tmp_path / "r" / "metrics.jsonl"
    lines = log.read_text().splitlines()
    with pytest.raises(json.JSONDecodeError):
        json.loads(lines[-1])  # the row the full disk cut
    rows = read_jsonl_rows(log)
    assert len(rows) == len(lines) - 1 and [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    assert read_run(tmp_path / "r").train[-1][0] == rows[-1]["step"]
    JSONLSink(log, resume_step=rows[-1]["step"]).close()  # a resumed run drops the torn row before appending
    assert log.read_text() == "".join(line + "\n" for line in lines[:-1])
