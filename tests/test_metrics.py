"""Closed-form FLOPs vs torch's FLOP counter, MFU, and reading back every metric sink."""
import glob
import json
import os
import signal
import struct
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from helpers import read_metrics, site_sources
from mhar_titan.config import Metrics
from mhar_titan.metrics import MetricsLogger, flops_per_token, mfu, routing_source_counts
from mhar_titan.models.args import ModelArgs
from mhar_titan.models.model import Transformer


def counted_flops_per_token(args, batch, seq_len):
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    tokens = torch.randint(0, args.vocab_size, (batch, seq_len))
    # The default CPU SDPA kernel reports no FLOPs; the MATH backend is plain matmuls.
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(tokens).float().pow(2).mean().backward()
    return counter.get_total_flops() / (batch * seq_len)


@pytest.mark.parametrize("residual", ["standard", "attn_res"])
def test_closed_form_flops_match_flop_counter(residual):
    # A small vocabulary so that the block matmuls and attention dominate the count
    # (with the gpt2 vocabulary the LM head is 80% of the debug model's FLOPs).
    args = ModelArgs.from_flavor("debug", residual=residual, routing_heads=2, vocab_size=1024, max_seq_len=128)
    closed = flops_per_token(args, seq_len=128)
    counted = counted_flops_per_token(args, batch=2, seq_len=128)
    assert closed.lm_head == 6 * 1024 * args.dim
    assert closed.attention == 12 * args.n_layers * args.n_heads * args.head_dim * 128
    # The counter sees matmuls only: the routing's dot products and weighted sums are
    # elementwise ops to it, so the model part must match and the total stays within 2%.
    assert abs(closed.model - counted) / counted < 0.02, (closed, counted)
    assert abs(closed.total - counted) / counted < 0.02, (closed, counted)
    if residual == "standard":
        assert closed.routing == 0


def test_routing_source_counts():
    args = ModelArgs.from_flavor("debug", residual="attn_res", n_layers=3)
    assert routing_source_counts(args) == [1, 2, 3, 4, 5, 6, 7]  # 2L+1 sites, site s reads s sources
    block = ModelArgs.from_flavor("debug", residual="attn_res", n_layers=4, routing_granularity="block",
                                  routing_block_layers=2)
    # layer 0 starts a block holding the embedding; blocks close at layers 0 and 2
    assert routing_source_counts(block) == [1, 2, 2, 2, 2, 3, 3, 3, 3]
    null = ModelArgs.from_flavor("debug", residual="attn_res", n_layers=1, routing_null_source=True,
                                 routing_mode="delta")
    assert routing_source_counts(null) == [2, 3, 4]
    d = args.dim
    assert flops_per_token(args, 64).routing == 12 * d * 28


def test_block_source_counts_match_the_model_trace():
    args = ModelArgs.from_flavor("debug", residual="attn_res", n_layers=5, routing_granularity="block",
                                 routing_block_layers=2, vocab_size=64, max_seq_len=8)
    model = Transformer(args)
    model.init_weights()
    trace = []
    trace.extend(site_sources(model, torch.zeros(1, 4, dtype=torch.long)))
    assert [len(s) for s in trace] == routing_source_counts(args)


def test_mfu_hand_computed():
    # 6e9 FLOPs/token at 1e5 tokens/s per device on a 989 TFLOP/s device: 6e14 / 9.89e14
    assert mfu(6e9, 1e5, 989e12) == pytest.approx(100 * 6e14 / 989e12)
    assert mfu(6e9, 1e5, 989e12) == pytest.approx(60.667, abs=1e-3)
    assert mfu(6e9, 1e5, None) is None


def read_wandb_history(run_dir):
    """History rows from the one wandb offline ``.wandb`` file under ``run_dir``."""
    (path,) = glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb"))
    return read_wandb_file(path)[0]


def read_wandb_file(path):
    """(history rows, run config) of a wandb offline ``.wandb`` file (LevelDB-style log of protobuf Records)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    pos, block, rows, chunks, config = 7, 32768, [], b"", {}
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block trailer too small for a header: padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            break
        chunks += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST
            rec = pb.Record()
            rec.ParseFromString(chunks)
            chunks = b""
            if rec.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item})
            elif rec.WhichOneof("record_type") in ("run", "config"):
                update = rec.run.config.update if rec.WhichOneof("record_type") == "run" else rec.config.update
                for c in update:
                    value = json.loads(c.value_json)
                    if isinstance(value, dict) and isinstance(config.get(c.key), dict):
                        value = {**config[c.key], **value}  # wandb updates its internal "_wandb" key in parts
                    config[c.key] = value
    return rows, config


def test_sinks_write_what_was_logged(tmp_path):
    assert os.environ.get("WANDB_MODE") == "offline"
    cfg = Metrics(enable_tensorboard=True, enable_wandb=True, wandb_project="test")
    logger = MetricsLogger(cfg, tmp_path, rank=0, run_name="sinks", config={"lr": 1e-3})
    assert logger.wandb_id
    for step, loss in [(1, 5.5), (2, 4.25), (3, float("nan"))]:
        logger.log(step, {"loss": loss, "lr": 1e-3 * step, "mfu": None})
    logger.close()

    rows = read_metrics(tmp_path)
    assert rows == [
        {"step": 1, "loss": 5.5, "lr": 1e-3},
        {"step": 2, "loss": 4.25, "lr": 2e-3},
        {"step": 3, "loss": "nan", "lr": 3e-3},
    ]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")][:2] == [(1, 5.5), (2, 4.25)]
    assert [e.step for e in acc.Scalars("train/lr")] == [1, 2, 3]

    history = read_wandb_history(str(tmp_path))
    by_step = {r["_step"]: r for r in history}
    assert by_step[1]["loss"] == 5.5 and by_step[2]["loss"] == 4.25
    assert by_step[3]["lr"] == pytest.approx(3e-3)


def test_non_zero_rank_has_no_sinks(tmp_path):
    logger = MetricsLogger(Metrics(), tmp_path, rank=1)
    logger.log(1, {"loss": 1.0})
    logger.close()
    assert not (tmp_path / "metrics.jsonl").exists()


# A run that logs steps 1-13, saves checkpoints at steps 5 and 10 (sinks flushed), and is killed
# (SIGKILL) after logging step 13, as in a crash.
CRASHED_RUN = textwrap.dedent("""
    import os, signal, sys, time
    from mhar_titan.config import Metrics
    from mhar_titan.metrics import WANDB_FLUSH_INTERVAL_S, MetricsLogger
    cfg = Metrics(enable_tensorboard=True, enable_wandb=True, wandb_project="test")
    logger = MetricsLogger(cfg, sys.argv[1], rank=0, run_name="crash")
    print(logger.wandb_id, flush=True)
    for step in range(1, 14):
        logger.log(step, {"loss": float(step)})
        if step % 5 == 0:
            logger.flush()  # the trainer flushes every sink when it saves a checkpoint
            if step == 10:
                time.sleep(WANDB_FLUSH_INTERVAL_S + 1.0)  # the checkpoint save takes a moment
    os.kill(os.getpid(), signal.SIGKILL)
""")


@pytest.mark.processes
def test_after_a_crash_and_resume_every_sink_shows_each_step_once(tmp_path):
    # its own wandb service, as a separate training process has (not this process's, if one runs)
    env = {k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"}
    crashed = subprocess.run([sys.executable, "-c", CRASHED_RUN, str(tmp_path)], capture_output=True, text=True,
                             timeout=300, env={**env, "WANDB_MODE": "offline"})
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-3000:]
    wandb_id = crashed.stdout.split()[0]
    # the resumed run restores the step-10 checkpoint and logs steps 11-15 with its own values
    cfg = Metrics(enable_tensorboard=True, enable_wandb=True, wandb_project="test")
    logger = MetricsLogger(cfg, tmp_path, rank=0, run_name="crash", wandb_id=wandb_id, resume_step=10)
    assert logger.wandb_id == wandb_id
    for step in range(11, 16):
        logger.log(step, {"loss": step + 0.5})
    logger.close()
    expected = [(s, float(s)) for s in range(1, 11)] + [(s, s + 0.5) for s in range(11, 16)]

    rows = read_metrics(tmp_path)
    assert [(r["step"], r["loss"]) for r in rows] == expected

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == expected

    # wandb: the crashed run's record holds at least every step up to the checkpoint; the resumed
    # run's record rewinds to step 10 (branch_point) and holds 11-15. wandb sync applies the rewind.
    first, second = sorted(glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb")))
    before, _ = read_wandb_file(first)
    deadline = time.monotonic() + 60
    while len(read_wandb_file(second)[0]) < 5 and time.monotonic() < deadline:
        time.sleep(0.5)  # finish() can return before wandb's service has written the file
    after, config = read_wandb_file(second)
    assert config["_wandb"]["branch_point"] == {"run_id": wandb_id, "step": 10}
    assert [(r["_step"], r["loss"]) for r in before][:10] == expected[:10]
    rewound = [(r["_step"], r["loss"]) for r in before if r["_step"] <= 10] + [(r["_step"], r["loss"]) for r in after]
    assert rewound == expected
