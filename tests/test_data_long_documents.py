"""Long documents (issue: one long document starved the loader): exact resume inside a long
document, and a per-batch state snapshot whose size does not grow with the document.
Throughput with long documents is measured by bench/data.py (long-document rows), not here."""
import hashlib
import itertools
import pickle
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from torchdata.stateful_dataloader.incremental_state import _IncrementalState

from mhar_titan.data import DataConfig, build_tokenizer, build_train_loader
from mhar_titan.data.prepare_tokenizer import prepare_encoding
from mhar_titan.data.stream import TokenStream, chunk_end
from mhar_titan.data.tokenizer import default_cache_dir
from helpers import ROOT

WORDS = "the of and to in that it is was he for on are as with his they at be this from have or by one had".split()


@pytest.fixture(scope="module")
def gpt2():
    prepare_encoding("gpt2", default_cache_dir())
    return build_tokenizer(DataConfig(tokenizer="gpt2"))


def _text(rng, n_words):
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


@pytest.fixture(scope="module")
def long_files(tmp_path_factory):
    """Two shards; each mixes short documents with long ones (~60k words, ~60k gpt2 tokens)."""
    root, rng = tmp_path_factory.mktemp("long"), random.Random(0)
    files = []
    for s in range(2):
        docs = [_text(rng, 60_000) if i % 3 == 1 else _text(rng, rng.randint(5, 80)) for i in range(6)]
        path = root / f"train-{s}.parquet"
        pq.write_table(pa.table({"text": docs}), path)
        files.append(str(path))
    return files


def _digest(batches):
    h = hashlib.sha256()
    for x, y in batches:
        h.update(x.numpy().tobytes())
        h.update(y.numpy().tobytes())
    return h.hexdigest()


@pytest.mark.parametrize("sharding,workers", [("window", 0), ("window", 2), ("document", 2)])
def test_resume_inside_a_long_document_is_exact(gpt2, long_files, sharding, workers):
    cfg = DataConfig(files=long_files, sharding=sharding, num_workers=workers, shuffle_buffer=4, seed=3)

    def loader():
        return build_train_loader(cfg, gpt2, dp_rank=0, dp_world=1, local_batch_size=4, seq_len=64, seed=0)

    straight = list(itertools.islice(loader(), 60))
    first = loader()
    it = iter(first)
    for _ in range(40):  # 40 x 4 x 65 tokens: well inside the first long document
        next(it)
    state = first.state_dict()
    resumed = loader()
    resumed.load_state_dict(state)
    assert _digest(itertools.islice(resumed, 20)) == _digest(straight[40:])


def _delta_bytes(stream, windows):
    """Pickled size of each per-window state delta, as a loader worker sends it after a batch."""
    incr, sizes = _IncrementalState(stream.state_dict()), []
    for _ in range(windows):
        stream.next_window()
        sizes.append(len(pickle.dumps(incr.generate_delta(stream.state_dict()))))
    return sizes


def test_state_snapshot_does_not_grow_with_document_length(gpt2):
    rng = random.Random(1)
    sizes = {}
    for n_words in (2_000, 200_000):
        docs = [_text(rng, 20) for _ in range(3)] + [_text(rng, n_words)] + [_text(rng, 20) for _ in range(3)]

        class Shard:
            name = f"mem-{n_words}"

            def rows(self, start=0):
                return iter(docs[start:])

        stream = TokenStream([Shard()], gpt2.encode, gpt2.eos_id, 65, seed=0, shuffle=True, shuffle_buffer=8,
                             infinite=True, consumer=[])
        stream.next_window()  # the long document is now read: pending tokens, or text tokenized in chunks
        state = stream.state_dict()
        assert stream.pending_tokens + sum(len(t) for t in state["text"].values()) > n_words // 2
        sizes[n_words] = _delta_bytes(stream, 20)
    # while a document is being packed, a snapshot sends only the changed counters: a few hundred bytes,
    # the same for a document 100 times longer (the old state resent every pending token, ~1 MB here)
    assert max(sizes[200_000]) < 1_000
    assert max(sizes[200_000]) <= max(sizes[2_000]) + 64


def test_chunked_tokenization_equals_whole_document(tmp_path):
    """Long documents are tokenized in chunks cut where every encoding's pre-tokenizer splits anyway:
    the tokens equal those of the whole text, for each encoding in the cache (gpt2 at least)."""
    from mhar_titan.data.tokenizer import ENCODING_FILES
    prepare_encoding("gpt2", default_cache_dir())
    text = "\n".join(pq.read_table(ROOT / "data/shakespeare/validation-00000-of-00001.parquet").column("text")
                     .to_pylist())[:300_000]
    text += " tail:  two  spaces, 'quotes' don't 12 34 ünïcödé 日本語 end"
    checked = []
    for name in ENCODING_FILES:
        try:
            tok = build_tokenizer(DataConfig(tokenizer=name))
        except Exception:  # not in the offline cache
            continue
        cuts, start = [], 0
        while start < len(text):
            end = chunk_end(text, start, size=997)
            cuts.append(text[start:end])
            start = end
        assert len(cuts) > 200 and "".join(cuts) == text
        assert [t for c in cuts for t in tok.encode(c)] == tok.encode(text), name
        checked.append(name)
    assert "gpt2" in checked
