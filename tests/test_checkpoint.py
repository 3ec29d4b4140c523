"""CheckpointManager in one process: exact resume, retention, incomplete folders,
mismatch errors, model-only export, async save. Distributed checks with the real
trainer (2 ranks, resharding, SIGTERM) are in test_checkpoint_e2e.py, SIGKILL in the
middle of a save in test_checkpoint_kill.py."""
from __future__ import annotations

import io
import logging
import random
import threading

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from ckpt_writers import gated_writer
from mhar_titan.checkpoint import (
    CheckpointConfig,
    CheckpointError,
    CheckpointManager,
    CheckpointMismatchError,
    is_complete,
    read_marker,
    step_folders,
)

DIM = 16


class Toy(nn.Module):
    """Embedding, a ModuleList of blocks and a head: the shape of the real decoder, tiny."""

    def __init__(self, dim: int = DIM, n_layers: int = 2):
        super().__init__()
        self.tok_embeddings = nn.Embedding(32, dim)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(dim, dim), nn.GELU()) for _ in range(n_layers))
        self.output = nn.Linear(dim, 32, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = h + layer(h)
        return self.output(h)


class Counter:
    """Stands in for the train state and for a data loader: one integer of state."""

    def __init__(self):
        self.n = 0

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, state):
        self.n = state["n"]


class Run:
    """A tiny training run whose every step consumes python, numpy and torch randomness."""

    def __init__(self, tmp_path, seed=0, dim=DIM, fingerprint=None, writer=None, **cfg):
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed)
        self.model = Toy(dim)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2, weight_decay=0.1)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: min(1.0, (s + 1) / 4))
        self.state, self.loader = Counter(), Counter()
        cfg.setdefault("enable", True)
        self.ckpt = CheckpointManager(
            CheckpointConfig(**cfg), tmp_path, model=self.model, optimizer=self.opt, lr_scheduler=self.sched,
            dataloader=self.loader, train_state=self.state,
            fingerprint=fingerprint if fingerprint is not None else {"model": {"dim": dim}, "tokenizer": "gpt2"},
            storage_writer_factory=writer,
        )

    def step(self) -> tuple[float, float]:
        n = 3 + random.randrange(3)
        tokens = torch.randint(0, 32, (n, 5))
        noise = float(np.random.rand())
        loss = self.model(tokens).logsumexp(-1).mean() * (1 + noise)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        lr = self.sched.get_last_lr()[0]
        self.sched.step()
        self.state.n += 1
        self.loader.n += n
        return loss.item(), lr

    def train(self, steps: int, total: int) -> list[tuple[float, float]]:
        out = []
        for _ in range(steps):
            out.append(self.step())
            self.ckpt.save(self.state.n, last=self.state.n == total)
        return out


def params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def folder_snapshot(root):
    return sorted((p.relative_to(root).as_posix(), p.stat().st_size, p.stat().st_mtime_ns)
                  for p in root.rglob("*") if p.is_file())


@pytest.mark.parametrize("key,value,message", [
    ("async_mode", "sync", "checkpoint.async_mode"),
    ("exclude_from_loading", ["optim"], "checkpoint.exclude_from_loading"),
    ("export_dtype", "fp8", "checkpoint.export_dtype"),
    ("keep_latest_k", -1, "checkpoint.keep_latest_k"),
])
def test_config_rejects_bad_values(key, value, message):
    with pytest.raises(CheckpointError, match=message):
        CheckpointConfig(**{key: value}).validate()


def test_resume_continues_exactly(tmp_path):
    straight = Run(tmp_path / "a", interval=3).train(6, total=6)
    first = Run(tmp_path / "b", interval=3)
    first.train(3, total=6)
    resumed = Run(tmp_path / "b", seed=123, interval=3)  # a different init is overwritten by the load
    assert resumed.ckpt.load() == 3
    assert (resumed.state.n, resumed.loader.n) == (first.state.n, first.loader.n)
    assert resumed.train(3, total=6) == straight[3:]  # losses and LRs, bitwise


def test_fresh_start_and_disabled(tmp_path):
    assert Run(tmp_path).ckpt.load() == 0
    off = Run(tmp_path / "off", enable=False, interval=1)
    off.train(2, total=2)
    assert not (tmp_path / "off").exists() and off.ckpt.load() == 0


def test_keep_latest_k_keeps_the_two_newest_complete(tmp_path):
    run = Run(tmp_path, interval=1, keep_latest_k=2)
    root = run.ckpt.folder
    run.train(2, total=10)
    (root / "step-9").mkdir()  # an incomplete folder newer than everything: not touched
    run.train(3, total=10)
    folders = step_folders(root)
    assert sorted(s for s, p in folders.items() if is_complete(p)) == [4, 5]
    assert sorted(folders) == [4, 5, 9]


def test_incomplete_folder_is_skipped_and_named(tmp_path, caplog):
    run = Run(tmp_path, interval=2)
    run.train(4, total=10)
    (run.ckpt.folder / "step-4" / "complete.json").unlink()  # as if killed before the marker
    resumed = Run(tmp_path, interval=2)
    with caplog.at_level(logging.WARNING, logger="mhar_titan.checkpoint"):
        assert resumed.ckpt.load() == 2
    assert any("step-4" in r.getMessage() and "incomplete" in r.getMessage() for r in caplog.records)
    assert resumed.state.n == 2


def test_damaged_marker_is_skipped_with_the_reason_named(tmp_path, caplog):
    run = Run(tmp_path, interval=2)
    run.train(4, total=10)
    (run.ckpt.folder / "step-4" / "complete.json").write_text('{"step": 4, "fil')  # a marker cut short
    resumed = Run(tmp_path, interval=2)
    with caplog.at_level(logging.WARNING, logger="mhar_titan.checkpoint"):
        assert resumed.ckpt.load() == 2
    messages = [r.getMessage() for r in caplog.records if r.getMessage().startswith("skipping incomplete")]
    assert messages and "complete.json cannot be read (JSONDecodeError)" in messages[0]
    assert "no complete.json" not in messages[0]  # it is there: the reason is its content
    assert resumed.state.n == 2


def test_load_step_must_name_a_complete_checkpoint(tmp_path):
    Run(tmp_path, interval=2).train(4, total=10)
    assert Run(tmp_path, load_step=4).ckpt.load() == 4
    with pytest.raises(CheckpointError, match=r"load_step=3.*missing.*\[2, 4\]"):
        Run(tmp_path, load_step=3).ckpt.load()


def test_load_step_behind_newer_checkpoints_is_refused_until_they_are_moved(tmp_path):
    Run(tmp_path, interval=2).train(6, total=10)
    folder = tmp_path / "checkpoints"
    older = Run(tmp_path, load_step=2)
    with pytest.raises(CheckpointError, match=r"load_step=2 is older") as err:
        older.ckpt.load()
    assert str(folder / "step-4") in str(err.value) and str(folder / "step-6") in str(err.value)
    assert "move those folders" in str(err.value)
    assert sorted(step_folders(folder)) == [2, 4, 6] and older.state.n == 0  # nothing deleted or loaded
    (folder / "step-4").rename(tmp_path / "step-4")
    (folder / "step-6").rename(tmp_path / "step-6")
    assert Run(tmp_path, load_step=2).ckpt.load() == 2


class OpenOnUnpickle:
    """A pickle payload: unpickling it calls ``open(path, "w")``, i.e. runs code of the file's choosing."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


@pytest.mark.parametrize("via", ["run_folder", "initial_load_path"])
def test_checkpoint_with_a_code_running_pickle_is_refused(tmp_path, via):
    flag = tmp_path / "code_ran"
    bad = Run(tmp_path / "bad", interval=2)
    bad.state.state_dict = lambda: {"n": OpenOnUnpickle(flag)}
    bad.train(2, total=10)
    assert is_complete(tmp_path / "bad" / "checkpoints" / "step-2") and not flag.exists()
    if via == "run_folder":
        victim = Run(tmp_path / "bad")
    else:
        victim = Run(tmp_path / "victim", initial_load_path=str(tmp_path / "bad" / "checkpoints" / "step-2"),
                     initial_load_model_only=False)
    with pytest.raises(CheckpointError, match=r"item 'train_state' is not plain data and was refused"):
        victim.ckpt.load()
    assert not flag.exists()  # the payload never ran
    assert victim.state.n == 0


def test_fingerprint_mismatch_names_the_setting_and_changes_nothing(tmp_path):
    Run(tmp_path, interval=2, fingerprint={"model": {"routing_heads": 4}, "tokenizer": "gpt2"}).train(2, total=9)
    before = folder_snapshot(tmp_path)
    other = Run(tmp_path, seed=7, fingerprint={"model": {"routing_heads": 8}, "tokenizer": "gpt2"})
    weights = params(other.model)
    with pytest.raises(CheckpointMismatchError, match=r"model\.routing_heads: checkpoint 4, this run 8"):
        other.ckpt.load()
    assert all(torch.equal(v, weights[k]) for k, v in params(other.model).items())
    assert folder_snapshot(tmp_path) == before


def test_shape_mismatch_names_keys_and_shapes(tmp_path):
    Run(tmp_path, interval=2, fingerprint={}).train(2, total=9)
    wider = Run(tmp_path, dim=24, fingerprint={})
    weights = params(wider.model)
    with pytest.raises(CheckpointMismatchError) as err:
        wider.ckpt.load()
    assert "model.tok_embeddings.weight: checkpoint (32, 16), this run (32, 24)" in str(err.value)
    assert all(torch.equal(v, weights[k]) for k, v in params(wider.model).items())


def test_exclude_from_loading(tmp_path):
    Run(tmp_path, interval=2).train(2, total=9)
    run = Run(tmp_path, exclude_from_loading=["dataloader", "lr_scheduler"])
    assert run.ckpt.load() == 2
    assert run.state.n == 2 and run.loader.n == 0 and run.sched.last_epoch == 0


def test_model_only_last_save_exports_dtype(tmp_path):
    run = Run(tmp_path / "a", interval=100, last_save_model_only=True, export_dtype="bfloat16")
    run.train(3, total=3)
    path = run.ckpt.folder / "step-3"
    assert read_marker(path)["model_only"]
    meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    assert sorted(meta) == sorted(f"model.{k}" for k in run.model.state_dict())
    assert all(m.properties.dtype == torch.bfloat16 for m in meta.values())
    with pytest.raises(CheckpointError, match="initial_load_path"):
        Run(tmp_path / "a").ckpt.load()
    fresh = Run(tmp_path / "b", seed=5, initial_load_path=str(path))
    assert fresh.ckpt.load() == 0
    want = {k: v.to(torch.bfloat16).float() for k, v in params(run.model).items()}
    assert all(torch.equal(v, want[k]) for k, v in params(fresh.model).items())


def test_initial_load_path_that_is_missing_or_not_a_checkpoint_is_named(tmp_path):
    missing = tmp_path / "nowhere" / "step-3"
    with pytest.raises(CheckpointError, match=r"initial_load_path=.*nowhere.*does not exist"):
        Run(tmp_path / "a", initial_load_path=str(missing)).ckpt.load()
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"initial_load_path=.*empty is not a DCP checkpoint folder"):
        Run(tmp_path / "b", initial_load_path=str(tmp_path / "empty")).ckpt.load()


def test_wrapped_and_compiled_blocks_save_plain_keys(tmp_path):
    run = Run(tmp_path, interval=1)
    for i, layer in enumerate(run.model.layers):
        run.model.layers[i] = torch.compile(checkpoint_wrapper(layer))
    assert any("_orig_mod" in k for k in run.model.state_dict())
    run.ckpt.save(1)
    meta = dcp.FileSystemReader(str(run.ckpt.folder / "step-1")).read_metadata().state_dict_metadata
    saved = sorted(k for k in meta if k.startswith("model."))
    assert saved == sorted(f"model.{k}" for k in Toy().state_dict())
    plain = Run(tmp_path, seed=3)
    assert plain.ckpt.load() == 1
    want = get_model_state_dict(run.model)
    assert all(torch.equal(v, want[k]) for k, v in params(plain.model).items())


def test_async_save_overlaps_training_and_equals_sync_save(tmp_path):
    sync = Run(tmp_path / "sync", interval=2)
    sync.train(2, total=10)
    written = threading.Event()
    run = Run(tmp_path / "async", interval=2, async_mode="async", writer=gated_writer(written))
    run.train(2, total=10)
    in_flight = run.ckpt._in_flight[3]
    run.train(1, total=10)  # step 3 runs while step 2 is written (its writer waits for the gate)
    assert not in_flight.done()
    assert not is_complete(run.ckpt.folder / "step-2")
    written.set()
    run.ckpt.close()
    assert is_complete(run.ckpt.folder / "step-2")
    assert_same_checkpoint(run.ckpt.folder / "step-2", sync.ckpt.folder / "step-2", tmp_path)


def assert_same_checkpoint(a, b, tmp_path):
    """Every item of two DCP checkpoints is equal: tensors bitwise, objects after decoding."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    loaded = []
    for i, src in enumerate((a, b)):
        dcp_to_torch_save(str(src), str(tmp_path / f"{i}.pt"))
        loaded.append(torch.load(tmp_path / f"{i}.pt", weights_only=False))
    assert len(loaded[0]) > 3
    _assert_same(loaded[0], loaded[1], "")


def _assert_same(x, y, where, saved_items=True):
    """``saved_items``: bytes here are the checkpoint's torch.save'd items (decoded, then compared);
    bytes inside a decoded item are plain data (a loader's token blocks) and compare as they are."""
    if saved_items and isinstance(x, bytes):
        x, y = (torch.load(io.BytesIO(v), weights_only=False) for v in (x, y))
        saved_items = False
    assert type(x) is type(y), where
    if isinstance(x, dict):
        assert x.keys() == y.keys(), where
        for k in x:
            _assert_same(x[k], y[k], f"{where}.{k}", saved_items)
    elif isinstance(x, (list, tuple)):
        assert len(x) == len(y), where
        for i, (u, v) in enumerate(zip(x, y)):
            _assert_same(u, v, f"{where}.{i}", saved_items)
    elif isinstance(x, torch.Tensor):
        assert torch.equal(x, y), where
    elif isinstance(x, np.ndarray):
        assert np.array_equal(x, y), where
    else:
        assert x == y, where


def test_job_config_rejects_bad_checkpoint_section_before_building():
    from mhar_titan.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="checkpoint.async_mode"):
        load_config(None, ["--checkpoint.async_mode", "threads"])
    cfg = load_config(None, ["--checkpoint.enable", "true", "--checkpoint.exclude_from_loading", '["dataloader"]'])
    assert cfg.checkpoint.enable and cfg.checkpoint.exclude_from_loading == ["dataloader"]


def test_truncated_shard_names_the_folder_and_the_previous_step(tmp_path):
    Run(tmp_path, interval=2).train(4, total=10)
    folder = tmp_path / "checkpoints"
    shard = folder / "step-4" / "__0_0.distcp"
    with open(shard, "r+b") as f:  # as `truncate -s` does: a real shard cut short
        f.truncate(shard.stat().st_size // 2)
    before = folder_snapshot(folder)
    resumed = Run(tmp_path, interval=2)
    with pytest.raises(CheckpointError) as err:
        resumed.ckpt.load()
    message = str(err.value)
    assert str(folder / "step-4") in message and "cannot be read" in message
    assert "then resume with the same command: the previous complete checkpoint, step-2, is loaded" in message
    assert "--checkpoint.load_step" not in message  # refused while step-4 stays complete (test_error_suggestions.py)
    assert "\n" not in message and err.value.__cause__ is None and err.value.__suppress_context__
    assert folder_snapshot(folder) == before and resumed.state.n == 0  # nothing deleted or loaded
    (folder / "step-4").rename(folder / "step-4.corrupt")  # the way out the message gives
    assert Run(tmp_path, interval=2).ckpt.load() == 2


@pytest.mark.parametrize("saved, resumed, named", [
    (dict(residual="dense"), dict(residual="dense", dense_dilation=2),
     "model_args.dense_dilation: checkpoint '<unset>', this run 2"),
    (dict(residual="dense", dense_period=2), dict(residual="dense"),
     "model_args.dense_period: checkpoint 2, this run '<unset>'"),
    (dict(residual="mudd"), dict(residual="mudd", mudd_prepost_norm=False), "model_args.mudd_prepost_norm"),
    (dict(residual="dense"), dict(residual="mudd"), "model_args.residual: checkpoint 'dense', this run 'mudd'"),
    (dict(residual="standard"), dict(residual="dense"), "model_args.residual: checkpoint 'standard', this run 'dense'"),
])
def test_a_resume_with_another_connection_or_option_is_refused(saved, resumed, named, tmp_path):
    """The run's fingerprint holds the depth connection and its keys (at their defaults they are
    left out, as for the models before them): a checkpoint of one is refused by a run of another,
    naming the setting, before any tensor is read; the same connection and keys resume."""
    from mhar_titan.checkpoint.fingerprint import check_fingerprint, checkpoint_fingerprint
    from mhar_titan.models.args import ModelArgs

    before, after = (checkpoint_fingerprint(ModelArgs(**fields), "gpt2") for fields in (saved, resumed))
    with pytest.raises(CheckpointMismatchError, match="was made with different settings") as err:
        check_fingerprint(tmp_path, before, after)
    assert named in str(err.value)
    check_fingerprint(tmp_path, before, checkpoint_fingerprint(ModelArgs(**saved), "gpt2"))
