"""The validation set is a fixed set of sequences: the same tokens, and the same mean loss, whatever
the micro-batch size, gradient accumulation or world size; too small a set is refused at build time
with a value the config accepts."""
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F

from mhar_titan.data import DataConfig, DataError, build_tokenizer, build_validation_loader
from mhar_titan.data.loader import IGNORE_INDEX
from mhar_titan.data.prepare_tokenizer import prepare_encoding
from mhar_titan.data.tokenizer import default_cache_dir

SEQ = 16
LAYOUTS = [(1, 4), (1, 1), (2, 1), (2, 2), (3, 2), (4, 3)]  # (world size, micro-batch rows)


@pytest.fixture(scope="module")
def val_cfg(tmp_path_factory):
    prepare_encoding("gpt2", default_cache_dir())
    rng, words = random.Random(0), "to be or not that is the question whether tis nobler in mind".split()
    path = tmp_path_factory.mktemp("val") / "validation.parquet"
    pq.write_table(pa.table({"text": [" ".join(rng.choice(words) for _ in range(rng.randint(3, 40)))
                                      for _ in range(30)]}), path)
    cfg = DataConfig(files=[str(path)], validation_files=[str(path)])
    return cfg, build_tokenizer(cfg)


def _rank_loaders(cfg, tok, world, rows, sequences):
    return [build_validation_loader(cfg, tok, dp_rank=r, dp_world=world, local_batch_size=rows, seq_len=SEQ,
                                    sequences=sequences) for r in range(world)]


def _real_rows(loaders):
    out = []
    for loader in loaders:
        for x, y in loader:
            assert x.shape == y.shape == (x.shape[0], SEQ) and x.dtype == y.dtype == torch.int64
            keep = (y != IGNORE_INDEX).any(dim=1)
            assert bool(((y == IGNORE_INDEX).all(dim=1) | ~(y == IGNORE_INDEX).any(dim=1)).all())  # whole rows
            out += [tuple(row.tolist()) + (int(last),) for row, last in zip(x[keep], y[keep, -1])]
    return sorted(out)


def test_same_sequences_in_every_layout_and_the_same_number_of_micro_batches_per_rank(val_cfg):
    cfg, tok = val_cfg
    reference = _real_rows(_rank_loaders(cfg, tok, 1, 1, 11))
    assert len(reference) == 11 and len(set(reference)) == 11
    for world, rows in LAYOUTS:
        loaders = _rank_loaders(cfg, tok, world, rows, 11)
        assert len({len(loader) for loader in loaders}) == 1  # FSDP: every rank runs as many forwards
        assert _real_rows(loaders) == reference, (world, rows)
        assert loaders[0].target_tokens == 11 * SEQ


def test_mean_loss_is_equal_across_micro_batch_size_accumulation_and_world_size(val_cfg):
    """The trainer's rule: sum of token losses over all micro-batches and ranks / sum of target counts."""
    cfg, tok = val_cfg
    torch.manual_seed(0)
    emb, head = torch.nn.Embedding(tok.n_vocab, 8), torch.nn.Linear(8, tok.n_vocab)
    losses = {}
    for world, rows in LAYOUTS:
        total = torch.zeros(2, dtype=torch.float64)
        for loader in _rank_loaders(cfg, tok, world, rows, 11):
            for x, y in loader:
                with torch.no_grad():
                    logits = head(emb(x)).double()
                total[0] += F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX,
                                            reduction="sum")
                total[1] += (y != IGNORE_INDEX).sum()
        assert total[1] == 11 * SEQ
        losses[world, rows] = (total[0] / total[1]).item()
    ref = losses[1, 4]
    assert all(abs(v - ref) < 1e-9 for v in losses.values()), losses


def test_too_small_a_validation_set_is_refused_with_a_value_that_works(val_cfg):
    cfg, tok = val_cfg
    with pytest.raises(DataError) as err:
        build_validation_loader(cfg, tok, dp_rank=0, dp_world=2, local_batch_size=4, seq_len=SEQ, sequences=10_000)
    msg = str(err.value)
    assert "validation.sequences = 10000" in msg and "set validation.sequences to at most" in msg
    most = int(msg.split("at most ")[1].split(" ")[0])
    assert most >= 1
    loader = build_validation_loader(cfg, tok, dp_rank=1, dp_world=2, local_batch_size=4, seq_len=SEQ,
                                     sequences=most)
    assert loader.target_tokens == most * SEQ
    with pytest.raises(DataError, match="fewer than 100001 tokens.*add validation files"):
        build_validation_loader(cfg, tok, dp_rank=0, dp_world=1, local_batch_size=1, seq_len=100_000, sequences=1)
