"""Data pipeline: resume, sharding coverage, world-size invariance, packing, validation, bad input,
pretokenized shards (acceptance items 1-6, 8, 9)."""
import hashlib
import itertools
import json
import logging
import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from mhar_titan.data import (DataConfig, DataError, DataStateError, ManifestError, Tokenizer, build_tokenizer,
                             build_train_loader, build_validation_loader)
from mhar_titan.data.pretokenize import main as pretokenize_main
from mhar_titan.data.pretokenize import write_pretokenized
from mhar_titan.data.prepare_tokenizer import prepare_encoding
from mhar_titan.data.sources import with_retries
from mhar_titan.data.stream import epoch_parts, split_parts
from mhar_titan.data.tokenizer import default_cache_dir

WORDS = "the of and to in that it is was he for on are as with his they at be this from have or by one had".split()


@pytest.fixture(scope="session")
def gpt2():
    prepare_encoding("gpt2", default_cache_dir())  # milliseconds; TIKTOKEN_CACHE_DIR comes from conftest
    return build_tokenizer(DataConfig(tokenizer="gpt2"))


def _doc(rng: random.Random, i: int) -> str:
    return f"Document {i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 120))) + "."


@pytest.fixture(scope="session")
def text_files(tmp_path_factory):
    """6 training parquet shards (40 documents each, 2 row groups) and one validation shard."""
    root, rng = tmp_path_factory.mktemp("text"), random.Random(0)
    train = []
    for s in range(6):
        path = root / f"train-{s}.parquet"
        pq.write_table(pa.table({"text": [_doc(rng, 100 * s + i) for i in range(40)], "id": list(range(40))}),
                       path, row_group_size=25)
        train.append(str(path))
    val = root / "validation-0.parquet"
    pq.write_table(pa.table({"text": [_doc(rng, 10_000 + i) for i in range(30)]}), val)
    return train, str(val)


def _cfg(files, **kw) -> DataConfig:
    base = dict(source="local", files=list(files), shuffle_buffer=8, seed=7)
    base.update(kw)
    return DataConfig(**base)


def _hub_cfg(files, **kw) -> DataConfig:
    """The hub code path (datasets.load_dataset(..., streaming=True)) on local parquet files."""
    return _cfg([], source="hub", hub_path="parquet", hub_name=None, hub_data_files=list(files), **kw)


def _digest(batches) -> str:
    h = hashlib.sha256()
    for inputs, labels in batches:
        h.update(inputs.numpy().tobytes())
        h.update(labels.numpy().tobytes())
    return h.hexdigest()


def _loader(cfg, tok, rank=0, world=1, batch=2, seq_len=32):
    return build_train_loader(cfg, tok, dp_rank=rank, dp_world=world, local_batch_size=batch, seq_len=seq_len, seed=0)


# 1. exact resume with shuffling ------------------------------------------------------------------------
@pytest.mark.parametrize("source", ["local", "hub"])
@pytest.mark.parametrize("sharding", ["window", "document"])
@pytest.mark.parametrize("workers", [0, 2])
def test_resume_at_batch_10_reproduces_batches_11_to_20(gpt2, text_files, source, sharding, workers):
    files = text_files[0]
    cfg = (_cfg if source == "local" else _hub_cfg)(files, sharding=sharding, num_workers=workers)
    straight = list(itertools.islice(_loader(cfg, gpt2, rank=1, world=2), 20))
    first = _loader(cfg, gpt2, rank=1, world=2)
    it = iter(first)
    for _ in range(10):
        next(it)
    state = first.state_dict()
    resumed = _loader(cfg, gpt2, rank=1, world=2)
    resumed.load_state_dict(state)
    after = list(itertools.islice(resumed, 10))
    assert _digest(after) == _digest(straight[10:])
    assert _digest(straight[10:]) != _digest(straight[:10])
    assert all(x.shape == (2, 32) and x.dtype == torch.int64 for b in after for x in b)


# 2. coverage of every (rank, step) window ----------------------------------------------------------------
DOC_LEN, EOS = 100, 0


@pytest.fixture(scope="module")
def synthetic_tokens(tmp_path_factory):
    """7 pretokenized shards (not divisible by 4 ranks) of 10 documents of 100 unique tokens each."""
    tok = Tokenizer(name="synthetic-ids", n_vocab=1 << 20, eos_id=EOS, encode=None, decode=None)
    out = tmp_path_factory.mktemp("synthetic")
    shards = [(f"synthetic-{s}", "-", [np.arange(DOC_LEN) + 1 + DOC_LEN * (10 * s + d) for d in range(10)])
              for s in range(7)]
    write_pretokenized(out, shards, tok)
    return tok, out, 70


def _all_windows(cfg, tok, world, batch, seq_len):
    """rank -> list of windows (seq_len + 1 tokens) over a whole finite epoch."""
    out = {}
    for rank in range(world):
        windows = []
        for inputs, labels in _loader(cfg, tok, rank=rank, world=world, batch=batch, seq_len=seq_len):
            assert torch.equal(inputs[:, 1:], labels[:, :-1])
            windows += torch.cat([inputs, labels[:, -1:]], dim=1).tolist()
        out[rank] = windows
    return out


def _check_windows_in_bounds(windows, n_docs):
    for w in windows:
        for a, b in zip(w, w[1:]):
            assert 0 <= a <= n_docs * DOC_LEN and 0 <= b <= n_docs * DOC_LEN
            # inside a document tokens are consecutive; a document ends with exactly one EOS
            if a != EOS and (a - 1) % DOC_LEN != DOC_LEN - 1:
                assert b == a + 1
            elif a != EOS:
                assert b == EOS
            else:
                assert b != EOS and (b - 1) % DOC_LEN == 0


@pytest.mark.parametrize("sharding,workers", [("window", 0), ("document", 0), ("document", 2)])
def test_coverage_world4_no_token_twice_and_bounded_leftover(synthetic_tokens, sharding, workers, caplog):
    tok, folder, n_docs = synthetic_tokens
    world, batch, seq_len = 4, 2, 8
    window = seq_len + 1
    cfg = _cfg([str(folder)], source="pretokenized", sharding=sharding, infinite=False, shuffle_buffer=4,
               num_workers=workers)
    with caplog.at_level(logging.WARNING, logger="mhar_titan.data.loader"):
        per_rank = _all_windows(cfg, tok, world, batch, seq_len)
    used = [t for ws in per_rank.values() for w in ws for t in w if t != EOS]
    assert len(used) == len(set(used)), "a token was used twice in one epoch"
    for ws in per_rank.values():
        _check_windows_in_bounds(ws, n_docs)
    stream_tokens = n_docs * (DOC_LEN + 1)
    steps = {len(ws) // batch for ws in per_rank.values()}
    assert len(steps) == 1 and all(len(ws) % batch == 0 for ws in per_rank.values()), "ranks out of step"
    in_step = steps.pop()
    unused = stream_tokens - in_step * world * batch * window  # the steps every rank reaches
    if sharding == "window":
        global_order = _all_windows(cfg, tok, 1, world * batch, seq_len)[0]
        interleaved = [w for step in range(in_step) for r in range(world)
                       for w in per_rank[r][step * batch:(step + 1) * batch]]
        assert interleaved == global_order  # the ranks' windows partition the global order exactly
        # dropped: the last incomplete round and partial window
        assert 0 <= unused < world * batch * window
        return
    docs_per_rank = [{(t - 1) // DOC_LEN for w in ws for t in w if t != EOS} for ws in per_rank.values()]
    assert all(a.isdisjoint(b) for a, b in itertools.combinations(docs_per_rank, 2))
    # 7 shards of 10 documents on 4 ranks: one whole shard each, and 3 leftover shards split by row
    # striding (rows r, r+4, ...): ranks 0-3 own 19, 19, 16, 16 documents of DOC_LEN + 1 tokens
    n_shards, rows = 7, 10
    owned = [rows * (n_shards // world) + (n_shards % world) * len(range(r, rows, world)) for r in range(world)]
    assert owned == [19, 19, 16, 16]
    tokens = [d * (DOC_LEN + 1) for d in owned]
    if workers == 0:
        expected = [t // window // batch for t in tokens]
        assert expected == [106, 106, 89, 89]
        loader = _loader(cfg, tok, rank=0, world=world, batch=batch, seq_len=seq_len)
        assert loader.epoch_batches == expected and loader.steps_every_rank_reaches == 89
        assert in_step == 89
    # the documented bound: sum_r (T_r - T_min) + world * W * (B * L - 1), where for equal shards
    # T_r - T_min <= (n_shards mod world) * (DOC_LEN + 1)
    per_stream_loss = batch * window - 1
    imbalance = sum(t - min(tokens) for t in tokens)
    assert imbalance <= world * (n_shards % world) * (DOC_LEN + 1)
    assert 0 <= unused <= imbalance + world * max(1, workers) * per_stream_loss
    assert unused > imbalance // 2  # the in-step cost is real, not hidden by the bound's slack
    assert "rank 0 stops after batch" in caplog.text and "data.infinite = true" in caplog.text


def test_finite_document_mode_on_text_keeps_ranks_in_step_across_resume(gpt2, text_files):
    """Text shards (counted by tokenizing): 6 shards on 4 ranks, so ranks 0-1 own more documents."""
    files, world, batch, seq_len = text_files[0], 4, 2, 32
    cfg = _cfg(files, sharding="document", infinite=False)
    loader = _loader(cfg, gpt2, rank=0, world=world, batch=batch, seq_len=seq_len)
    # independent count: each rank's rows of the epoch-0 shard order, tokenized, + one EOS per document
    texts = [pq.read_table(f).column("text").to_pylist() for f in files]
    expected = []
    for rank in range(world):
        parts = epoch_parts(len(files), 7, 0, True, [(world, rank), (1, 0)])
        tokens = sum(len(gpt2.encode(texts[s][j])) + 1 for s, stride, off in parts
                     for j in range(len(texts[s])) if j % stride == off)
        expected.append(tokens // (seq_len + 1) // batch)
    assert loader.epoch_batches == expected and len(set(expected)) > 1
    limit = min(expected)
    for rank in range(world):
        first = _loader(cfg, gpt2, rank=rank, world=world, batch=batch, seq_len=seq_len)
        head = list(itertools.islice(first, 5))
        resumed = _loader(cfg, gpt2, rank=rank, world=world, batch=batch, seq_len=seq_len)
        resumed.load_state_dict(first.state_dict())
        assert len(head) + len(list(resumed)) == limit and resumed.batches_done == limit


def test_split_parts_partitions_rows_for_indivisible_counts():
    parts = [(s, 1, 0) for s in range(7)]
    rows = {s: range(23) for s in range(7)}
    for n in (2, 3, 4, 5, 8):
        owned = [(shard, j) for i in range(n) for shard, stride, off in split_parts(parts, n, i)
                 for j in rows[shard] if j % stride == off]
        assert sorted(owned) == [(s, j) for s in range(7) for j in range(23)]
        nested = [(shard, j) for i in range(n) for k in range(3)
                  for shard, stride, off in split_parts(split_parts(parts, n, i), 3, k)
                  for j in rows[shard] if j % stride == off]
        assert sorted(nested) == sorted(owned)


# 3. window mode: same global batches at world sizes 1, 2, 4 ---------------------------------------------
def test_window_mode_global_batches_identical_across_world_sizes(gpt2, text_files):
    cfg = _cfg(text_files[0], sharding="window")
    digests = []
    for world in (1, 2, 4):
        loaders = [iter(_loader(cfg, gpt2, rank=r, world=world, batch=8 // world)) for r in range(world)]
        steps = []
        for _ in range(6):
            slices = [next(it) for it in loaders]
            steps.append((torch.cat([s[0] for s in slices]), torch.cat([s[1] for s in slices])))
        digests.append([_digest([s]) for s in steps])
    assert digests[0] == digests[1] == digests[2]
    assert len(set(digests[0])) == 6


# 4. packing -----------------------------------------------------------------------------------------------
def test_packing_three_documents_one_eos_between_and_shifted_labels(gpt2, tmp_path):
    docs = ["Hello world, this is the first document.", "A second one <|endoftext|> with the literal marker.",
            "And the third document ends here."]
    path = tmp_path / "three.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    cfg = _cfg([str(path)], shuffle=False, infinite=True)
    batches = list(itertools.islice(_loader(cfg, gpt2, batch=1, seq_len=16), 6))
    expected = []
    for d in docs:
        expected += gpt2.encode(d) + [gpt2.eos_id]
    assert sum(t == gpt2.eos_id for t in expected) == 3  # the literal marker is plain text
    stream = expected * 10
    for k, (inputs, labels) in enumerate(batches):
        window = stream[17 * k:17 * (k + 1)]
        assert inputs[0].tolist() == window[:-1] and labels[0].tolist() == window[1:]
    flat = [t for inputs, labels in batches for t in inputs[0].tolist() + labels[0, -1:].tolist()]
    runs = [len(list(g)) for is_eos, g in itertools.groupby(flat, key=lambda t: t == gpt2.eos_id) if is_eos]
    assert runs and set(runs) == {1}


# 5. validation is independent of the training files -------------------------------------------------------
def test_validation_unchanged_when_training_files_change(gpt2, text_files):
    train, val = text_files

    def val_digest(files):
        cfg = _cfg(files, validation_files=[val])
        loader = build_validation_loader(cfg, gpt2, dp_rank=0, dp_world=1, local_batch_size=2, seq_len=32, sequences=10)
        first, second = _digest(loader), _digest(loader)
        assert first == second  # the same batches at every evaluation
        return first

    reference = val_digest(train[:4])
    assert val_digest(train[:3]) == reference
    assert val_digest(train) == reference
    # a designated validation file matched by the training globs is excluded from training
    loader = _loader(_cfg(train + [val], validation_files=[val]), gpt2)
    assert val not in loader.layout["sources"] and len(loader.layout["sources"]) == 6


def test_hub_validation_files_held_out_and_unchanged_when_training_files_change(gpt2, text_files):
    """Item 5 on the hub code path (local parquet through datasets' streaming builder)."""
    train, val = text_files

    def val_digest(files):
        cfg = _hub_cfg(files, validation_files=[val])
        return _digest(build_validation_loader(cfg, gpt2, dp_rank=0, dp_world=1, local_batch_size=2, seq_len=32,
                                               sequences=10))

    reference = val_digest(train[:4])
    assert val_digest(train[:3]) == reference and val_digest(train) == reference
    local = build_validation_loader(_cfg(train, validation_files=[val]), gpt2, dp_rank=0, dp_world=1,
                                    local_batch_size=2, seq_len=32, sequences=10)
    assert _digest(local) == reference
    # a validation file inside the training data files (here through a glob) is excluded from training
    glob_all = str(Path(val).parent / "*.parquet")
    loader = _loader(_hub_cfg([glob_all], validation_files=[val]), gpt2)
    assert sorted(loader.layout["sources"]) == sorted(train)
    # disjoint by construction: nothing to exclude, verified against datasets' own file list
    assert sorted(_loader(_hub_cfg(train, validation_files=[val]), gpt2).layout["sources"]) == sorted(train)


def test_hub_validation_that_cannot_be_verified_is_an_error(gpt2, text_files, monkeypatch):
    train, val = text_files
    with pytest.raises(DataError, match="validation data") as err:
        _loader(_hub_cfg(train, validation_files=[str(Path(val).parent / "held-out-*.parquet")]), gpt2)
    assert "held-out-*.parquet" in str(err.value)
    # a datasets version that no longer exposes the file of each shard: refuse rather than leak held-out data
    import datasets

    real = datasets.load_dataset

    def without_file_list(*args, **kwargs):
        ds = real(*args, **kwargs)
        ds._ex_iterable.kwargs = {k: v for k, v in ds._ex_iterable.kwargs.items() if k != "files"}
        return ds

    monkeypatch.setattr(datasets, "load_dataset", without_file_list)
    with pytest.raises(DataError, match="could leak into training") as err:
        _loader(_hub_cfg(train + [val], validation_files=[val]), gpt2)
    assert "data.source = 'local'" in str(err.value)
    _loader(_hub_cfg(train), gpt2)  # without validation files nothing needs the file list


# 6. changing the number of data-parallel ranks at resume -----------------------------------------------------
def _global_steps(cfg, tok, world, n, state=None):
    loaders = [_loader(cfg, tok, rank=r, world=world, batch=4 // world) for r in range(world)]
    if state is not None:
        for loader in loaders:
            loader.load_state_dict(state)
    its = [iter(loader) for loader in loaders]
    steps = [torch.cat([next(it)[0] for it in its]) for _ in range(n)]
    return steps, loaders


@pytest.mark.parametrize("old_world,new_world", [(2, 1), (1, 2)])
def test_window_mode_resumes_exactly_at_new_world_size(gpt2, text_files, old_world, new_world):
    cfg = _cfg(text_files[0], sharding="window")
    straight, _ = _global_steps(cfg, gpt2, 1, 10)
    before, loaders = _global_steps(cfg, gpt2, old_world, 4)
    state = loaders[-1].state_dict()  # any rank's state works in window mode
    after, _ = _global_steps(cfg, gpt2, new_world, 6, state)
    assert [s.tolist() for s in before + after] == [s.tolist() for s in straight]


@pytest.mark.parametrize("old_world,new_world", [(2, 1), (1, 2)])
def test_document_mode_refuses_new_world_size_unless_overridden(gpt2, text_files, old_world, new_world, caplog):
    cfg = _cfg(text_files[0], sharding="document")
    _, loaders = _global_steps(cfg, gpt2, old_world, 3)
    state = loaders[0].state_dict()
    with pytest.raises(DataStateError) as err:
        _loader(cfg, gpt2, rank=0, world=new_world, batch=4 // new_world).load_state_dict(state)
    msg = str(err.value)
    assert f"dp world size {old_world}" in msg and f"dp world size {new_world}" in msg
    assert "data.allow_document_reshard=true" in msg
    override = _cfg(text_files[0], sharding="document", allow_document_reshard=True)
    with caplog.at_level(logging.WARNING, logger="mhar_titan.data.loader"):
        steps, loaders = _global_steps(override, gpt2, new_world, 2, state)
    assert "epoch 0 is skipped" in caplog.text
    assert loaders[0].state_dict()["epoch"] == 1 and steps[0].shape == (4, 32)


def test_resume_with_other_seq_len_or_files_is_refused(gpt2, text_files):
    cfg = _cfg(text_files[0])
    loader = _loader(cfg, gpt2)
    next(iter(loader))
    state = loader.state_dict()
    with pytest.raises(DataStateError, match="seq_len"):
        _loader(cfg, gpt2, seq_len=64).load_state_dict(state)
    with pytest.raises(DataStateError, match="sources"):
        _loader(_cfg(text_files[0][:5]), gpt2).load_state_dict(state)


def test_config_list_fields_given_as_a_string_are_a_clear_error():
    for name in ("files", "validation_files", "hub_data_files"):
        with pytest.raises(ValueError) as err:
            DataConfig(**{name: "data/train-0.parquet"})
        assert f"data.{name} must be a list" in str(err.value) and '["data/train-0.parquet"]' in str(err.value)
    with pytest.raises(ValueError, match="data.files must be a list"):
        DataConfig(files=["a.parquet", 3])


# 8. bad input -----------------------------------------------------------------------------------------------
def test_corrupt_parquet_is_a_clear_error_naming_the_file(gpt2, text_files, tmp_path):
    bad = tmp_path / "broken.parquet"
    bad.write_bytes(b"PAR1 this is not a parquet file")
    for workers in (0, 2):
        with pytest.raises(DataError) as err:
            _loader(_cfg(text_files[0][:2] + [str(bad)], num_workers=workers), gpt2)
        assert str(bad) in str(err.value) and "corrupt" in str(err.value)
        assert ".." not in str(err.value)  # pyarrow's own sentence ends in a period: one full stop only
    with pytest.raises(DataError, match="matches no file"):
        _loader(_cfg([str(tmp_path / "missing-*.parquet")]), gpt2)


def test_empty_invalid_utf8_and_long_documents(gpt2, tmp_path, caplog):
    long_doc = " ".join(f"word{i}" for i in range(3000))
    good = ["A short first document.", long_doc, "The last document."]
    jsonl = tmp_path / "mixed.jsonl"
    with open(jsonl, "wb") as f:
        f.write(json.dumps({"text": good[0]}).encode() + b"\n")
        f.write(json.dumps({"text": ""}).encode() + b"\n")
        f.write(b'{"text": "bad \xff\xfe bytes"}\n')
        f.write(json.dumps({"text": good[1]}).encode() + b"\n")
    parquet = tmp_path / "mixed.parquet"
    pq.write_table(pa.table({"text": pa.array([b"\xc3\x28 invalid", None, good[2].encode()], pa.binary())}), parquet)
    cfg = _cfg([str(jsonl), str(parquet)], shuffle=False, infinite=False)
    with caplog.at_level(logging.WARNING, logger="mhar_titan.data.stream"):
        loader = _loader(cfg, gpt2, batch=1, seq_len=16)
        windows = [torch.cat([x[0], y[0, -1:]]).tolist() for x, y in loader]
    expected = [t for d in good for t in gpt2.encode(d) + [gpt2.eos_id]]
    assert len(gpt2.encode(long_doc)) > 100 * 16
    assert [t for w in windows for t in w] == expected[:len(windows) * 17]
    assert len(expected) - len(windows) * 17 < 17
    skipped = loader.state_dict()["global_stream"]["skipped"]
    assert skipped == {"empty": 2, "invalid_utf8": 2}
    assert "skipped empty document" in caplog.text and "skipped invalid utf8 document" in caplog.text
    assert str(parquet) in caplog.text


def test_hub_retries_transient_errors_then_fails_clearly():
    calls, waits = [], []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionError("connection reset by peer")
        return "stream"

    assert with_retries(flaky, "open hub", attempts=5, backoff_s=1.0, sleep=waits.append) == "stream"
    assert waits == [1.0, 2.0]

    def down():
        raise TimeoutError("read timed out")

    with pytest.raises(DataError, match=r"open hub failed after 3 attempt\(s\)"):
        with_retries(down, "open hub", attempts=3, backoff_s=1.0, sleep=waits.append)

    def missing():
        raise FileNotFoundError("no such dataset")

    with pytest.raises(DataError, match="no such dataset"):
        with_retries(missing, "open hub", attempts=3, backoff_s=1.0, sleep=lambda s: pytest.fail("retried"))


def test_each_hub_retry_is_one_counted_line_naming_what_is_retried(caplog):
    """A hub error whose message runs to several lines (huggingface_hub's do) is logged as one
    line per retry: what is retried, the error's first line, the count."""
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionError("Couldn't reach 'org/corpus' on the Hub\n  request id: 123\n  " + "x" * 500)
        return "stream"

    with caplog.at_level("WARNING", logger="mhar_titan.data.sources"):
        assert with_retries(flaky, "opening org/corpus", attempts=4, backoff_s=1.0, sleep=lambda s: None) == "stream"
    lines = [r.getMessage() for r in caplog.records if r.name == "mhar_titan.data.sources"]
    assert lines == [f"opening org/corpus: transient error ConnectionError: Couldn't reach 'org/corpus' on the Hub; "
                     f"retry {k}/3 in {w:.1f} s" for k, w in ((1, 1.0), (2, 2.0))]


def test_hub_retries_stop_after_the_time_budget_with_the_hint():
    """A hub that never answers: each attempt takes 20 s (a fake clock), waits double from 2 s;
    with a 60 s budget no retry starts past it, so 3 attempts instead of 10, and the error ends
    with the hint naming what to do."""
    now, calls, waits = [0.0], [], []

    def never():
        calls.append(now[0])
        now[0] += 20.0
        raise ConnectionError("Couldn't reach 'org/corpus' on the Hub (LocalEntryNotFoundError)")

    def sleep(s):
        waits.append(s)
        now[0] += s

    with pytest.raises(DataError) as e:
        with_retries(never, "opening org/corpus", attempts=10, backoff_s=2.0, sleep=sleep, max_s=60.0,
                     clock=lambda: now[0], hint="Use local files.")
    assert waits == [2.0, 4.0] and len(calls) == 3
    assert str(e.value).startswith("opening org/corpus failed after 3 attempt(s) in 66 s (last error ConnectionError")
    assert str(e.value).endswith("Use local files.")


# 9. pretokenized shards ------------------------------------------------------------------------------------
def test_pretokenized_equals_on_the_fly_and_refuses_other_tokenizer(gpt2, text_files, tmp_path):
    out = tmp_path / "pretok"
    pretokenize_main(["--files", *text_files[0], "--out", str(out), "--tokenizer", "gpt2"])
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["tokenizer"] == "gpt2" and manifest["dtype"] == "uint16"
    assert all(len(s["source_sha256"]) == 64 for s in manifest["shards"])
    for sharding in ("window", "document"):
        fly = list(itertools.islice(_loader(_cfg(text_files[0], sharding=sharding), gpt2, rank=1, world=2), 12))
        pre = list(itertools.islice(_loader(_cfg([str(out)], source="pretokenized", sharding=sharding), gpt2,
                                            rank=1, world=2), 12))
        assert _digest(pre) == _digest(fly)
    prepare_encoding("cl100k_base", default_cache_dir())
    cl100k = build_tokenizer(DataConfig(tokenizer="cl100k_base"))
    with pytest.raises(ManifestError) as err:
        _loader(_cfg([str(out)], source="pretokenized"), cl100k)
    assert "'gpt2'" in str(err.value) and "'cl100k_base'" in str(err.value)


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_leaves_the_global_torch_rng_untouched(gpt2, text_files, workers):
    """A resumed run restores the torch RNG before the loader starts: the loader must not draw from it."""
    cfg = _cfg(text_files[0], num_workers=workers)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    loader = _loader(cfg, gpt2)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    resumed = _loader(cfg, gpt2)
    resumed.load_state_dict(state)
    next(iter(resumed))
    assert torch.equal(torch.get_rng_state(), before)
