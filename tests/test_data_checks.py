"""Data errors come before the model is built, in one line naming the file (check_data_files), and
errors met later while reading name the file and row, also from a loader worker."""
import json
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mhar_titan.data import DataConfig, DataError, build_tokenizer, build_train_loader
from mhar_titan.data.checks import check_data_files
from mhar_titan.data.prepare_tokenizer import prepare_encoding
from mhar_titan.data.tokenizer import default_cache_dir

WORDS = "a small corpus of plain words for checking the data files".split()


def _texts(n, seed=0):
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 50))) for _ in range(n)]


@pytest.fixture
def good(tmp_path):
    path = tmp_path / "good.parquet"
    pq.write_table(pa.table({"text": _texts(8)}), path)
    return str(path)


def _check(files, world=1, **kw):
    check_data_files(DataConfig(files=files, **kw), dp_world=world, seed=0, validation=bool(kw.get("validation_files")))


BAD_PARQUET = {
    "empty": (pa.table({"text": pa.array([], pa.string())}), "has no rows (an empty shard)"),
    "all_null": (pa.table({"text": pa.array([None, None, None], pa.string())}), "all 3 values of column 'text' are null"),
    "int_column": (pa.table({"text": [1, 2, 3]}), "column 'text' has type int64, not text"),
    "list_column": (pa.table({"text": [["a"], ["b"]]}), "column 'text' has type list<element: string>, not text"),
    "no_column": (pa.table({"body": ["a", "b"]}), "has no column 'text'"),
}


@pytest.mark.parametrize("kind", sorted(BAD_PARQUET))
@pytest.mark.parametrize("role", ["training", "validation"])
def test_bad_parquet_is_one_line_naming_the_file(tmp_path, good, kind, role):
    table, expected = BAD_PARQUET[kind]
    bad = tmp_path / f"{kind}.parquet"
    pq.write_table(table, bad)
    with pytest.raises(DataError) as err:
        if role == "training":
            _check([good, str(bad)])
        else:
            _check([good], validation_files=[str(bad)])
    msg = str(err.value)
    assert expected in msg and str(bad) in msg and "\n" not in msg


def test_globs_jsonl_types_and_empty_jsonl(tmp_path, good):
    with pytest.raises(DataError, match=r"'.*/nothing-\*.parquet' matches no file"):
        _check([good, str(tmp_path / "nothing-*.parquet")])
    ints = tmp_path / "ints.jsonl"
    ints.write_text(json.dumps({"text": 5}) + "\n")
    with pytest.raises(DataError, match=rf"{ints}:1: key 'text' holds a int, not text"):
        _check([good, str(ints)])
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match=rf"jsonl file {empty} is empty"):
        _check([good, str(empty)])
    _check([good, str(tmp_path / "*.parquet")])  # a good glob passes


def test_too_few_documents_for_ranks_and_workers_in_document_sharding(tmp_path):
    path = tmp_path / "three.parquet"
    pq.write_table(pa.table({"text": _texts(3)}), path)
    _check([str(path)], world=2, sharding="document", num_workers=1)  # 2 readers, 3 rows
    _check([str(path)], world=2, sharding="window", num_workers=2)    # every reader reads the whole stream
    with pytest.raises(DataError) as err:
        _check([str(path)], world=2, sharding="document", num_workers=2)  # 4 readers, 3 rows
    msg = str(err.value)
    assert "3 documents in 1 shard(s), too few for data.sharding = 'document' with 2 rank(s) x 2" in msg
    assert "rank 1 worker 1 would read nothing" in msg


def test_error_met_while_reading_names_file_and_row_in_one_line_from_a_worker(tmp_path):
    prepare_encoding("gpt2", default_cache_dir())
    path = tmp_path / "late.jsonl"
    rows = [{"text": t} for t in _texts(40)]
    rows[30] = {"text": ["not", "text"]}
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = DataConfig(files=[str(path)], num_workers=2, shuffle=False)
    check_data_files(cfg, dp_world=1, seed=0, validation=False)  # row 30 is past what the checks read
    loader = build_train_loader(cfg, build_tokenizer(cfg), dp_rank=0, dp_world=1, local_batch_size=2, seq_len=8,
                                seed=0)
    with pytest.raises(DataError) as err:
        for _ in loader:
            pass
    assert str(err.value) == f"{path} row 30: the text field holds a list, not text; check data.text_field"


TEXT_TYPES = {
    "string": pa.string(),
    "large_string": pa.large_string(),
    "string_view": pa.string_view(),
    "binary": pa.binary(),
    "dictionary_of_strings": pa.dictionary(pa.int32(), pa.string()),
    "dictionary_of_strings_int8": pa.dictionary(pa.int8(), pa.string()),
}


def _first_batch(path, num_workers=0):
    cfg = DataConfig(files=[str(path)], shuffle=False, num_workers=num_workers)
    check_data_files(cfg, dp_world=1, seed=0, validation=False)
    loader = build_train_loader(cfg, build_tokenizer(cfg), dp_rank=0, dp_world=1, local_batch_size=2, seq_len=8,
                                seed=0)
    return next(iter(loader))


@pytest.mark.parametrize("kind", sorted(TEXT_TYPES))
def test_every_arrow_string_like_column_is_text(tmp_path, kind):
    """A text column of any string-like Arrow type (dictionary-encoded included) passes the checks
    and reads as the same documents as a plain string column."""
    prepare_encoding("gpt2", default_cache_dir())
    texts = _texts(8)
    plain, other = tmp_path / "plain.parquet", tmp_path / f"{kind}.parquet"
    pq.write_table(pa.table({"text": pa.array(texts, pa.string())}), plain)
    values = pa.array([t.encode() for t in texts] if kind == "binary" else texts, pa.string() if kind != "binary"
                      else pa.binary())
    pq.write_table(pa.table({"text": values.cast(TEXT_TYPES[kind])}), other)
    assert pq.ParquetFile(other).schema_arrow.field("text").type == TEXT_TYPES[kind]
    expected, got = _first_batch(plain), _first_batch(other)
    assert all(a.tolist() == b.tolist() for a, b in zip(expected, got))
