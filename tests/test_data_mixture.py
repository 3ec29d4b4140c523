"""Data mixtures (``data.sources``): draws by weight, one source equals the single-source stream,
exact resume, weight changes, bad mixtures (one line, before anything is built).

Each source of the test mixture writes its documents in its own letters (source 0 "a".."h",
source 1 "i".."p", source 2 "q".."x") and the byte tokenizer keeps one token per letter, so the
source of every training window can be read off its tokens, whatever the loader claims.
"""
import hashlib
import itertools
import random
import types

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.distributed as dist

from helpers import assert_config_refused_in_one_line, read_metrics
from train_common import DEBUG_MHAR, SAMPLE, debug_cfg

from mhar_titan.components.loss import target_count
from mhar_titan.config import load_config
from mhar_titan.data import (DataConfig, DataError, DataStateError, build_tokenizer, build_train_loader,
                             build_validation_loader)
from mhar_titan.data.checks import check_data_files
from mhar_titan.data.mixture import planned_source_windows, source_counts, window_sources
from mhar_titan.data.pretokenize import write_pretokenized
from mhar_titan.dryrun import main as dryrun
from mhar_titan.train import Trainer, main

ALPHABETS = ("abcdefgh", "ijklmnop", "qrstuvwx")
WEIGHTS = (0.5, 0.3, 0.2)
SEQ = 16


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(DataConfig(tokenizer="bytes"))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Per source: 2 training parquet files of 30 documents and one validation file of 10."""
    root, out = tmp_path_factory.mktemp("mixture"), []
    for s, letters in enumerate(ALPHABETS):
        rng = random.Random(s)

        def docs(n):
            return [" ".join("".join(rng.choice(letters) for _ in range(rng.randint(1, 6)))
                             for _ in range(rng.randint(3, 25))) for _ in range(n)]
        train = []
        for k in range(2):
            path = root / f"s{s}-train-{k}.parquet"
            pq.write_table(pa.table({"text": docs(30)}), path, row_group_size=16)
            train.append(str(path))
        val = root / f"s{s}-val.parquet"
        pq.write_table(pa.table({"text": docs(10)}), val)
        out.append((train, str(val)))
    return out


def _mixture(corpus, weights=WEIGHTS, **kw) -> DataConfig:
    sources = [dict(name=f"s{i}", weight=w, files=train, validation_files=[val])
               for i, (w, (train, val)) in enumerate(zip(weights, corpus))]
    return DataConfig(tokenizer="bytes", sources=sources, shuffle_buffer=8, seed=5, **kw)


def _loader(cfg, tok, rank=0, world=1, batch=4):
    return build_train_loader(cfg, tok, dp_rank=rank, dp_world=world, local_batch_size=batch, seq_len=SEQ, seed=0)


def _source_of_row(row: torch.Tensor) -> int:
    """The source whose letters a window holds (every window comes from one source's stream)."""
    letters = {chr(t) for t in row.tolist() if 97 <= t <= 122}
    owners = {i for i, a in enumerate(ALPHABETS) if letters & set(a)}
    assert len(owners) == 1, f"a window mixes sources {owners}"
    return owners.pop()


def _digest(batches) -> str:
    h = hashlib.sha256()
    for x, y in batches:
        h.update(x.numpy().tobytes())
        h.update(y.numpy().tobytes())
    return h.hexdigest()


# --------------------------------------------------------------------------- draws by weight

@pytest.mark.parametrize("sharding", ["window", "document"])
def test_three_sources_drawn_within_two_points_of_their_weights(corpus, tok, sharding):
    """Statistic: over 2,000 windows (sequences), max over sources of |windows from the source /
    2,000 - its weight|, the source read off each window's letters. The loader's own count agrees."""
    loader = _loader(_mixture(corpus, sharding=sharding), tok, batch=8)
    counts = np.zeros(3, dtype=np.int64)
    for x, _ in itertools.islice(loader, 250):
        for row in x:
            counts[_source_of_row(row)] += 1
    assert counts.sum() == 2000
    shares = counts / 2000
    assert np.max(np.abs(shares - np.asarray(WEIGHTS))) <= 0.02, shares
    assert loader.take_source_windows() == counts.tolist()
    assert loader.take_source_windows() == [0, 0, 0]  # counted since the last call
    # the draws are those of the pure function of (seed, label, weights, step) the dry run uses
    label = "global" if sharding == "window" else "0of1/0of1"
    assert source_counts(5, label, list(WEIGHTS), 0, 2000).tolist() == counts.tolist()
    assert planned_source_windows(list(WEIGHTS), seed=5, sharding=sharding, dp_world=1, num_workers=0,
                                  local_batch_size=8, batches=250).tolist() == counts.tolist()


def test_planned_windows_match_two_ranks_with_loader_workers(corpus, tok):
    """Document sharding, 2 ranks x 2 workers: the windows per source the ranks yield (read off their
    letters) are the dry run's plan."""
    cfg = _mixture(corpus, sharding="document", num_workers=2)
    counts = np.zeros(3, dtype=np.int64)
    for rank in range(2):
        loader = _loader(cfg, tok, rank, 2, batch=2)
        for x, _ in itertools.islice(loader, 7):
            for row in x:
                counts[_source_of_row(row)] += 1
    planned = planned_source_windows(list(WEIGHTS), seed=5, sharding="document", dp_world=2, num_workers=2,
                                     local_batch_size=2, batches=7)
    assert counts.sum() == 28 and planned.tolist() == counts.tolist()


def test_draws_are_a_pure_function_and_zero_weight_is_never_drawn():
    a = window_sources(3, "global", [0.5, 0.0, 0.5], 0, 5000)
    assert not (a == 1).any() and set(a.tolist()) == {0, 2}
    assert window_sources(3, "global", [0.5, 0.0, 0.5], 1000, 1100).tolist() == a[1000:1100].tolist()
    assert window_sources(4, "global", [0.5, 0.0, 0.5], 0, 5000).tolist() != a.tolist()  # the seed matters
    # every prefix keeps to the weights within a few windows (low discrepancy), also at large offsets
    for start in (0, 10 ** 9):
        s = window_sources(7, "0of2/1of2", [0.5, 0.3, 0.2], start, start + 20_000)
        for n in (100, 1000, 20_000):
            dev = np.abs(np.bincount(s[:n], minlength=3) - n * np.asarray([0.5, 0.3, 0.2]))
            assert dev.max() <= 8, (start, n, dev)


# --------------------------------------------------------------------------- one source

@pytest.mark.parametrize("sharding, workers, rank, world", [
    ("window", 0, 0, 1), ("document", 0, 0, 1), ("window", 2, 1, 2), ("document", 2, 1, 2)])
def test_mixture_of_one_source_equals_the_single_source_stream(corpus, tok, sharding, workers, rank, world):
    files = corpus[0][0] + corpus[1][0]
    kw = dict(tokenizer="bytes", shuffle_buffer=8, seed=5, sharding=sharding, num_workers=workers)
    single = DataConfig(files=files, **kw)
    mixed = DataConfig(sources=[dict(name="only", weight=0.25, files=files)], **kw)
    a = list(itertools.islice(_loader(single, tok, rank, world), 24))
    b = list(itertools.islice(_loader(mixed, tok, rank, world), 24))
    assert _digest(a) == _digest(b)


# --------------------------------------------------------------------------- resume

@pytest.mark.parametrize("sharding", ["window", "document"])
@pytest.mark.parametrize("workers", [0, 2])
def test_resume_continues_every_source_exactly(corpus, tok, sharding, workers):
    cfg = _mixture(corpus, sharding=sharding, num_workers=workers)
    straight = list(itertools.islice(_loader(cfg, tok), 20))
    first = _loader(cfg, tok)
    head = list(itertools.islice(first, 10))
    state = first.state_dict()
    again = _loader(cfg, tok)
    again.load_state_dict(state)
    assert _digest(head + list(itertools.islice(again, 10))) == _digest(straight)


def test_window_mode_mixture_resumes_exactly_at_another_world_size(corpus, tok):
    cfg = _mixture(corpus)
    ref = [x for x, _ in itertools.islice(_loader(cfg, tok, batch=4), 12)]  # 1 rank: the global batches
    ranks = [_loader(cfg, tok, r, 2, batch=2) for r in range(2)]
    parts = [list(itertools.islice(L, 6)) for L in ranks]
    head = [torch.cat([parts[0][k][0], parts[1][k][0]]) for k in range(6)]
    state = ranks[1].state_dict()  # any rank's state: the global stream is the same on every rank
    resumed = _loader(cfg, tok, batch=4)
    resumed.load_state_dict(state)
    tail = [x for x, _ in itertools.islice(resumed, 6)]
    assert len(head + tail) == len(ref) and all(torch.equal(a, b) for a, b in zip(head + tail, ref))


def test_document_mode_mixture_at_another_world_size_starts_every_sources_next_epoch(corpus, tok, caplog):
    old = _loader(_mixture(corpus, sharding="document"), tok, 0, 2, batch=8)
    with caplog.at_level("INFO", logger="mhar_titan.data.stream"):
        list(itertools.islice(old, 60))
    assert "data: stream 0of2/0of1 of source 's0' starts epoch 1" in caplog.text  # log lines name the source
    state = old.state_dict()
    saved = state["epochs"]
    assert sorted(saved) == ["s0", "s1", "s2"] and saved["s0"] > saved["s2"]  # s0 (weight 0.5) ran through more
    with pytest.raises(DataStateError, match="allow_document_reshard"):
        _loader(_mixture(corpus, sharding="document"), tok, batch=8).load_state_dict(state)
    resumed = _loader(_mixture(corpus, sharding="document", allow_document_reshard=True), tok, batch=8)
    resumed.load_state_dict(state)
    batches = list(itertools.islice(resumed, 3))
    assert resumed.state_dict()["epochs"] == {name: e + 1 for name, e in saved.items()}
    # the same as a fresh world-1 loader that starts each source at that epoch
    fresh = _loader(_mixture(corpus, sharding="document"), tok, batch=8)
    fresh._build(start_epoch=[saved[f"s{i}"] + 1 for i in range(3)])
    assert _digest(batches) == _digest(itertools.islice(fresh, 3))


def _windows_by_source(batches) -> list[list[list[int]]]:
    out = [[], [], []]
    for x, y in batches:
        for xr, yr in zip(x, y):
            out[_source_of_row(xr)].append(xr.tolist() + yr[-1:].tolist())
    return out


@pytest.mark.parametrize("sharding", ["window", "document"])
def test_changed_weights_are_refused_unless_allowed_then_every_source_continues(corpus, tok, sharding):
    old = _loader(_mixture(corpus, sharding=sharding), tok)
    head = list(itertools.islice(old, 10))
    state = old.state_dict()
    new_weights = (0.2, 0.3, 0.5)
    refused = _loader(_mixture(corpus, new_weights, sharding=sharding), tok)
    with pytest.raises(DataStateError) as err:
        refused.load_state_dict(state)
    msg = str(err.value)
    assert "data.allow_weight_change" in msg and "s0 0.5 -> 0.2" in msg and "\n" not in msg
    allowed = _loader(_mixture(corpus, new_weights, sharding=sharding, allow_weight_change=True), tok)
    allowed.load_state_dict(state)
    tail = list(itertools.islice(allowed, 20))
    # every source continues exactly where it stopped: its windows before and after the resume are
    # its own stream's first windows (a one-source loader of the same files, same consumer label)
    for s, windows in enumerate(_windows_by_source(head + tail)):
        train, _ = corpus[s]
        alone = _loader(DataConfig(files=train, tokenizer="bytes", shuffle_buffer=8, seed=5, sharding=sharding),
                        tok, batch=1)
        own = [x[0].tolist() + y[0, -1:].tolist() for x, y in itertools.islice(alone, len(windows))]
        assert own == windows, s
    # the new weights decide from the resumed window on (the draws of the continued sequence)
    label = "global" if sharding == "window" else "0of1/0of1"
    tail_counts = np.bincount([_source_of_row(r) for x, _ in tail for r in x], minlength=3)
    assert tail_counts.tolist() == source_counts(5, label, list(new_weights), 40, 120).tolist()


def test_resume_with_other_sources_is_refused(corpus, tok):
    loader = _loader(_mixture(corpus), tok)
    list(itertools.islice(loader, 2))
    state = loader.state_dict()
    two = DataConfig(tokenizer="bytes", shuffle_buffer=8, seed=5,
                     sources=[dict(name="s0", weight=1.0, files=corpus[0][0]),
                              dict(name="s1", weight=1.0, files=corpus[1][0])])
    with pytest.raises(DataStateError, match=r"sources \['s0', 's1', 's2'\], this run has \['s0', 's1'\]"):
        _loader(two, tok).load_state_dict(state)
    single = DataConfig(files=corpus[0][0], tokenizer="bytes", shuffle_buffer=8, seed=5)
    with pytest.raises(DataStateError, match="is of a data mixture"):
        _loader(single, tok).load_state_dict(state)
    fewer = _mixture(corpus)
    fewer.sources[2].files = fewer.sources[2].files[:1]
    with pytest.raises(DataStateError, match="source 's2' read other files"):
        _loader(fewer, tok).load_state_dict(state)


# --------------------------------------------------------------------------- bad mixtures

def _sources_toml(*entries: str) -> str:
    return "[data]\ntokenizer = \"bytes\"\n" + "".join(f"[[data.sources]]\n{e}\n" for e in entries)


BAD_CONFIG = {
    "negative": (('name = "a"\nweight = -0.5\nfiles = ["x"]', 'name = "b"\nweight = 1\nfiles = ["y"]'),
                 "data.sources[0] ('a').weight = -0.5: weights must be finite numbers >= 0"),
    "zero_sum": (('name = "a"\nweight = 0\nfiles = ["x"]', 'name = "b"\nweight = 0.0\nfiles = ["y"]'),
                 "the weights of data.sources sum to 0"),
    "nan": (('name = "a"\nweight = nan\nfiles = ["x"]',), "'data.sources[0].weight' must be a finite number"),
    "inf": (('name = "a"\nweight = 1\nfiles = ["x"]', 'name = "b"\nweight = inf\nfiles = ["y"]'),
            "'data.sources[1].weight' must be a finite number"),
    "no_weight": (('name = "a"\nfiles = ["x"]',), "data.sources[0] ('a') has no weight"),
    "no_files": (('name = "a"\nweight = 1\nfiles = ["x"]', 'name = "b"\nweight = 1'),
                 "data.sources[1] ('b') has no files"),
    "tokenizers": (('name = "a"\nweight = 1\nfiles = ["x"]', 'name = "b"\nweight = 1\nfiles = ["y"]\ntokenizer = "gpt2"'),
                   "data.sources[1] ('b').tokenizer = 'gpt2' differs from data.tokenizer = 'bytes'"),
    "same_name": (('name = "a"\nweight = 1\nfiles = ["x"]', 'name = "a"\nweight = 1\nfiles = ["y"]'),
                  "the name is also data.sources[0]'s"),
    "bad_name": (('name = "web data"\nweight = 1\nfiles = ["x"]',), "data.sources[0].name = 'web data'"),
    "unknown_key": (('name = "a"\nweigth = 1\nfiles = ["x"]',), "unknown key 'data.sources[0].weigth'"),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIG))
def test_bad_mixture_config_exits_2_in_one_line_before_anything_is_built(tmp_path, capsys, case):
    entries, needle = BAD_CONFIG[case]
    path = tmp_path / "job.toml"
    path.write_text(_sources_toml(*entries))
    assert_config_refused_in_one_line(path, needle, tmp_path, capsys)


def test_mixture_config_reads_tables_and_writes_back_to_an_equal_config(tmp_path):
    from mhar_titan.config import to_toml

    path = tmp_path / "job.toml"
    path.write_text(_sources_toml('name = "web"\nweight = 3\nsource = "hub"\nhub_name = "sample-100BT"\n'
                                  'validation_files = ["sample/100BT/000_00000.parquet"]',
                                  'name = "code"\nweight = 1\nfiles = ["c/*.jsonl"]\ntext_field = "content"'))
    cfg = load_config(str(path), ["--data.allow_weight_change=true"])
    web, code = cfg.data.mixture()
    assert (web.name, web.weight, web.data.source, web.data.hub_name) == ("web", 0.75, "hub", "sample-100BT")
    assert (code.weight, code.data.files, code.data.text_field, code.data.tokenizer) == (0.25, ["c/*.jsonl"],
                                                                                        "content", "bytes")
    assert not code.data.is_mixture and web.data.validation_files == ["sample/100BT/000_00000.parquet"]
    text = to_toml(cfg)
    assert "\nfiles =" not in text and "\nsource =" not in text  # the top-level source keys are the sources'
    again = tmp_path / "again.toml"
    again.write_text(text)
    assert load_config(str(again)) == cfg


def test_top_level_source_keys_beside_sources_are_refused():
    with pytest.raises(ValueError, match=r"data.files is set at the top of \[data\] beside data.sources"):
        DataConfig(files=["x"], sources=[dict(name="a", weight=1.0, files=["y"])])
    with pytest.raises(ValueError, match="data.allow_weight_change is for a mixture"):
        DataConfig(files=["x"], allow_weight_change=True)


def _two(corpus, a: dict, b: dict) -> DataConfig:
    return DataConfig(tokenizer="bytes", sources=[dict(name="a", weight=1.0, **a), dict(name="b", weight=1.0, **b)])


def test_bad_mixture_files_are_one_line_naming_the_sources(corpus, tmp_path):
    (t0, v0), (t1, v1), _ = corpus
    cases = [
        (_two(corpus, dict(files=t0, validation_files=[t1[0]]), dict(files=t1)),
         f"data.sources 'a' holds out {t1[0]} (validation_files), which is a training file of source 'b'"),
        (_two(corpus, dict(files=t0), dict(files=[t0[1], *t1])),
         f"data.sources 'a' and 'b' both train on {t0[1]}"),
        (_two(corpus, dict(files=t0), dict(files=[str(tmp_path / "none-*.parquet")])),
         "data.sources 'b': data.files entry"),
        (_two(corpus, dict(files=t0, validation_files=t0), dict(files=t1)),
         "data.sources 'a': no training file left"),
    ]
    for cfg, needle in cases:
        with pytest.raises(DataError) as err:
            check_data_files(cfg, dp_world=1, seed=0, validation=True)
        assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)
    # pretokenized sources made with different tokenizers
    dirs = []
    for name, n_vocab, eos in (("bytes", 257, 256), ("gpt2", 50257, 50256)):
        d = tmp_path / f"pre-{name}"
        write_pretokenized(d, [("src", "0" * 64, [np.arange(5), np.arange(7)])],
                           types.SimpleNamespace(name=name, n_vocab=n_vocab, eos_id=eos))
        dirs.append(str(d))
    cfg = _two(corpus, dict(source="pretokenized", files=[dirs[0]]), dict(source="pretokenized", files=[dirs[1]]))
    with pytest.raises(DataError) as err:
        check_data_files(cfg, dp_world=1, seed=0, validation=False)
    msg = str(err.value)
    assert "made with different tokenizers" in msg and "'a'" in msg and "'gpt2'" in msg and "\n" not in msg
    # validation asked for, but no source has validation files
    with pytest.raises(DataError, match="no source of data.sources has validation_files"):
        check_data_files(_two(corpus, dict(files=t0), dict(files=t1)), dp_world=1, seed=0, validation=True)
    # a finite mixture in document sharding on several ranks
    cfg = _two(corpus, dict(files=t0), dict(files=t1))
    cfg.sharding, cfg.infinite = "document", False
    with pytest.raises(DataError, match="finite data mixture"):
        check_data_files(cfg, dp_world=2, seed=0, validation=False)


def test_a_bad_mixture_file_exits_2_before_the_model_is_built(corpus, tmp_path, capsys):
    (t0, _), (t1, _), _ = corpus
    path = tmp_path / "job.toml"
    path.write_text(_sources_toml(f'name = "a"\nweight = 1\nfiles = {t0!r}\nvalidation_files = [{t1[0]!r}]'.replace("'", '"'),
                                  f'name = "b"\nweight = 1\nfiles = {t1!r}'.replace("'", '"')))
    code = main(["--config", str(path), f"--job.dump_folder={tmp_path / 'runs'}", "--model.vocab_size=384",
                 "--checkpoint.enable=false", "--training.seq_len=16"])
    assert code == 2
    err = capsys.readouterr().err
    assert "which is a training file of source 'b'" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and not dist.is_initialized()


# --------------------------------------------------------------------------- trainer and dry run

def _shakespeare_mixture(tmp_path) -> list[str]:
    """Overrides of the debug config for a two-source mixture of the sample, both with validation
    files (the second's: the validation shard's last 5 documents)."""
    val = pq.read_table(SAMPLE / "validation-00000-of-00001.parquet")
    cut = tmp_path / "val-cut.parquet"
    pq.write_table(val.slice(val.num_rows - 5, 5), cut)
    return ["--data.files=[]", "--data.validation_files=[]",
            f'--data.sources=[{{name = "a", weight = 0.6, files = ["{SAMPLE}/train-0000[01]-of-00004.parquet"], '
            f'validation_files = ["{SAMPLE}/validation-00000-of-00001.parquet"]}}, '
            f'{{name = "b", weight = 0.4, files = ["{SAMPLE}/train-0000[23]-of-00004.parquet"], '
            f'validation_files = ["{cut}"]}}]']


needs_sample = pytest.mark.skipif(not (SAMPLE / "validation-00000-of-00001.parquet").exists(),
                                  reason="run `python -m mhar_titan.data.prepare_shakespeare --out data/shakespeare`")


@needs_sample
def test_trainer_logs_tokens_and_validation_loss_per_source(tmp_path):
    cfg = debug_cfg(tmp_path, "mix", "--training.steps=3", "--validation.enable=true", "--validation.freq=3",
                    "--validation.sequences=6", *_shakespeare_mixture(tmp_path))
    trainer = Trainer(cfg)
    try:
        trainer.train()
        rows = read_metrics(trainer.run_dir)
        val = [r for r in rows if "val_loss" in r][-1]
        # each source's loss is the trained model's on that source's own validation set, read alone
        sums = {}
        with torch.no_grad():
            for m in cfg.data.mixture():
                loader = build_validation_loader(m.data, trainer.tokenizer, dp_rank=0, dp_world=1,
                                                 local_batch_size=8, seq_len=32, sequences=6)
                loss = sum(trainer.model(x, y, loss_fn=trainer.eval_loss_fn) for x, y in loader)
                sums[m.name] = (loss, sum(target_count(y) for _, y in loader))
    finally:
        trainer.close()
    for name, (loss, n) in sums.items():
        assert val[f"val_loss/{name}"] == pytest.approx((loss / n).item(), rel=1e-6)
    total = (sums["a"][0] + sums["b"][0]) / (sums["a"][1] + sums["b"][1])
    assert val["val_loss"] == pytest.approx(total.item(), rel=1e-6) and val["val_loss/a"] != val["val_loss/b"]
    last = [r for r in rows if "loss" in r][-1]
    assert last["tokens_seen/a"] + last["tokens_seen/b"] == last["tokens_seen"] == 3 * 8 * 32
    planned = planned_source_windows([0.6, 0.4], seed=42, sharding="window", dp_world=1, num_workers=0,
                                     local_batch_size=8, batches=3)
    assert [last["tokens_seen/a"], last["tokens_seen/b"]] == (planned * 32).tolist()


@needs_sample
def test_dry_run_prints_the_mixture_with_planned_tokens(tmp_path, capsys):
    assert dryrun(["--config", str(DEBUG_MHAR), "--device", "cpu", "--world-size", "2", "--training.steps=100",
                   "--training.seq_len=32", "--data.sharding=document", "--data.num_workers=2",
                   *_shakespeare_mixture(tmp_path)]) == 0
    out = capsys.readouterr().out
    planned = planned_source_windows([0.6, 0.4], seed=42, sharding="document", dp_world=2, num_workers=2,
                                     local_batch_size=8, batches=100) * 32
    assert planned.sum() == 100 * 16 * 32
    assert "data mixture: 2 source(s), document sharding, seed 42; tokens over the planned 100 steps (51,200 in all)" in out
    assert f"a            weight 0.6000  tokens {planned[0]:>18,}" in out
    assert f"b            weight 0.4000  tokens {planned[1]:>18,}" in out
    assert "train-0000[01]-of-00004.parquet (2 paths here)" in out and "val-cut.parquet (1 path here)" in out
