"""The pretokenize command and pretokenized directories: bad input gives clear errors, the CLI runs cleanly."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mhar_titan.data import DataConfig, ManifestError, build_tokenizer, build_train_loader
from mhar_titan.data.prepare_tokenizer import prepare_encoding
from mhar_titan.data.pretokenize import main as pretokenize_main
from mhar_titan.data.tokenizer import default_cache_dir
from helpers import ROOT


@pytest.fixture(scope="module")
def gpt2():
    prepare_encoding("gpt2", default_cache_dir())
    return build_tokenizer(DataConfig(tokenizer="gpt2"))


@pytest.fixture
def pretokenized(gpt2, tmp_path) -> Path:
    src = tmp_path / "train-0.parquet"
    pq.write_table(pa.table({"text": [f"Document number {i} has a few words." for i in range(30)]}), src)
    out = tmp_path / "pretok"
    pretokenize_main(["--files", str(src), "--out", str(out)])
    return out


def _load(folder: Path, tok):
    cfg = DataConfig(source="pretokenized", files=[str(folder)])
    return build_train_loader(cfg, tok, dp_rank=0, dp_world=1, local_batch_size=2, seq_len=8, seed=0)


def test_help_has_no_runpy_warning():
    proc = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-m", "mhar_titan.data.pretokenize",
                           "--help"], capture_output=True, text=True, cwd=ROOT, env=os.environ.copy())
    assert proc.returncode == 0, proc.stderr
    assert "RuntimeWarning" not in proc.stderr and "--files" in proc.stdout and "--out" in proc.stdout
    assert "manifest" in proc.stdout  # every argument has help text


def test_pretokenized_folder_as_input_is_refused(pretokenized, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        pretokenize_main(["--files", str(pretokenized), "--out", str(tmp_path / "again")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert str(pretokenized) in err and "already pretokenized" in err and 'data.source = "pretokenized"' in err
    assert not (tmp_path / "again").exists()


def test_missing_input_file_exits_2_with_message(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        pretokenize_main(["--files", str(tmp_path / "nothing-*.parquet"), "--out", str(tmp_path / "out")])
    assert exit_.value.code == 2 and "matches no file" in capsys.readouterr().err


@pytest.mark.parametrize("damage", ["not json", "missing key", "wrong type"])
def test_corrupt_manifest_names_the_path_and_the_fix(gpt2, pretokenized, damage):
    path = pretokenized / "manifest.json"
    if damage == "not json":
        path.write_text(path.read_text()[:-20])
    else:
        m = json.loads(path.read_text())
        if damage == "missing key":
            del m["shards"][0]["offsets"]
        else:
            m["n_vocab"] = "many"
        path.write_text(json.dumps(m))
    with pytest.raises(ManifestError) as err:
        _load(pretokenized, gpt2)
    assert str(path) in str(err.value) and "re-run python -m mhar_titan.data.pretokenize" in str(err.value)
    if damage == "missing key":
        assert "'offsets'" in str(err.value)


@pytest.mark.parametrize("damage", ["deleted", "truncated"])
def test_missing_or_wrong_offsets_file_is_refused_before_loading(gpt2, pretokenized, damage):
    offsets = pretokenized / "shard-00000.idx.npy"
    if damage == "deleted":
        offsets.unlink()
    else:
        import numpy as np

        np.save(offsets, np.load(offsets)[:-3])
    with pytest.raises(ManifestError) as err:
        _load(pretokenized, gpt2)  # at build time, not inside a worker at the first batch
    assert str(offsets) in str(err.value) and "re-run" in str(err.value)
