"""Closed-form FLOPs vs torch's FLOP counter, MFU, and reading back every metric sink."""
import glob
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from helpers import PATIENCE_S, ROOT, read_metrics, read_wandb_file, site_sources, wandb_file_records, wandb_history
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


@pytest.mark.parametrize("residual", ["standard", "attn_res", "dense", "mudd"])
def test_closed_form_flops_match_flop_counter(residual):
    # A small vocabulary so that the block matmuls and attention dominate the count
    # (with the gpt2 vocabulary the LM head is 80% of the debug model's FLOPs).
    routing = dict(routing_heads=2) if residual == "attn_res" else {}
    args = ModelArgs.from_flavor("debug", residual=residual, vocab_size=1024, max_seq_len=128, **routing)
    closed = flops_per_token(args, seq_len=128)
    counted = counted_flops_per_token(args, batch=2, seq_len=128)
    assert closed.lm_head == 6 * 1024 * args.dim
    assert closed.attention == 12 * args.n_layers * args.n_heads * args.head_dim * 128
    # The counter sees matmuls only: the routing's dot products and weighted sums (and DenseFormer's
    # and MUDDFormer's) are elementwise ops to it, so the model part must match and the total stays
    # within 2%. MUDDFormer's weight generator is two matmuls per block and its eager depth mix one
    # batched matrix product per block (mhar_kernels.depth_mix), which the counter does see: its
    # count lies above the model part, at most the total (measured: equal to it).
    if residual == "mudd":
        assert closed.model < counted <= closed.total, (closed, counted)
    else:
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


def test_cpu_peak_memory_is_the_process_own_not_its_parents():
    """A trainer started by a process holding 768 MiB more (a launcher, pytest) reports its own
    peak: a child that imports torch only reads far less than the parent holds."""
    held = torch.ones(768 * 2**20, dtype=torch.uint8)  # resident: every page written
    code = "import torch; from mhar_titan.metrics import peak_memory_gib; print(peak_memory_gib(torch.device('cpu')))"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=PATIENCE_S)
    del held
    assert done.returncode == 0, done.stderr[-3000:]
    assert float(done.stdout) < 0.7, done.stdout  # torch alone: about 0.25 GiB


def test_mfu_hand_computed():
    # 6e9 FLOPs/token at 1e5 tokens/s per device on a 989 TFLOP/s device: 6e14 / 9.89e14
    assert mfu(6e9, 1e5, 989e12) == pytest.approx(100 * 6e14 / 989e12)
    assert mfu(6e9, 1e5, 989e12) == pytest.approx(60.667, abs=1e-3)
    assert mfu(6e9, 1e5, None) is None


def read_wandb_history(run_dir):
    """History rows from the one wandb offline ``.wandb`` file under ``run_dir``, once it is complete."""
    (path,) = glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb"))
    return read_wandb_file(path)[0]


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


def test_the_wandb_reader_waits_for_a_record_written_late(tmp_path):
    """``run.finish()`` returns before wandb's service has written the run's file (on an idle
    machine too: 1.1 kB of 2.5 kB right after close, no history row); under load the rows came
    later than the sinks test read them. A real record is written here in two parts, the second
    by another thread after the first read has begun: the reader returns every row."""
    cfg = Metrics(enable_wandb=True, wandb_project="test")
    logger = MetricsLogger(cfg, tmp_path, rank=0, run_name="late")
    for step in (1, 2, 3):
        logger.log(step, {"loss": float(step)})
    logger.close()
    (path,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    rows, _ = read_wandb_file(path)
    assert [(r["_step"], r["loss"]) for r in rows] == [(1, 1.0), (2, 2.0), (3, 3.0)]

    data = open(path, "rb").read()
    late = tmp_path / "late.wandb"
    late.write_bytes(data[:len(data) // 3])  # the header and the run's first records, no history yet
    assert not wandb_file_records(late)[1] and wandb_history(wandb_file_records(late)[0]) == []
    reading = threading.Event()

    def write_the_rest():
        reading.wait()
        time.sleep(1.0)  # the service is late
        with open(late, "ab") as f:
            f.write(data[len(data) // 3:])

    writer = threading.Thread(target=write_the_rest)
    writer.start()
    try:
        reading.set()
        assert read_wandb_file(late)[0] == rows
    finally:
        writer.join()


def test_non_zero_rank_has_no_sinks(tmp_path):
    logger = MetricsLogger(Metrics(), tmp_path, rank=1)
    logger.log(1, {"loss": 1.0})
    logger.close()
    assert not (tmp_path / "metrics.jsonl").exists()


# A run that logs steps 1-13, saves checkpoints at steps 5 and 10 (sinks flushed), and is killed
# (SIGKILL) after logging step 13, as in a crash.
# The crash comes only once wandb's service has written step 10's row to the file (it writes within
# WANDB_FLUSH_INTERVAL_S of the flush on an idle machine, later under load): the test is about the
# rewind on resume, not about how fast the service writes.
CRASHED_RUN = textwrap.dedent("""
    import glob, os, signal, sys
    sys.path.insert(0, sys.argv[2])
    from helpers import wait_for, wandb_file_records, wandb_history
    from mhar_titan.config import Metrics
    from mhar_titan.metrics import MetricsLogger
    cfg = Metrics(enable_tensorboard=True, enable_wandb=True, wandb_project="test")
    logger = MetricsLogger(cfg, sys.argv[1], rank=0, run_name="crash")
    print(logger.wandb_id, flush=True)
    for step in range(1, 14):
        logger.log(step, {"loss": float(step)})
        if step % 5 == 0:
            logger.flush()  # the trainer flushes every sink when it saves a checkpoint
            if step == 10:
                (record,) = glob.glob(os.path.join(sys.argv[1], "wandb", "offline-run-*", "run-*.wandb"))
                wait_for(lambda: any(r["_step"] == 10 for r in wandb_history(wandb_file_records(record)[0])),
                         "wandb's service to write step 10")
    os.kill(os.getpid(), signal.SIGKILL)
""")


@pytest.mark.processes
def test_after_a_crash_and_resume_every_sink_shows_each_step_once(tmp_path):
    # its own wandb service, as a separate training process has (not this process's, if one runs)
    env = {k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"}
    crashed = subprocess.run([sys.executable, "-c", CRASHED_RUN, str(tmp_path), str(ROOT / "tests")],
                             capture_output=True, text=True, timeout=PATIENCE_S, env={**env, "WANDB_MODE": "offline"})
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
    before = wandb_history(wandb_file_records(first)[0])  # killed: no exit record, as much as was written
    after, config = read_wandb_file(second)  # waits for the resumed run's complete record
    assert config["_wandb"]["branch_point"] == {"run_id": wandb_id, "step": 10}
    assert [(r["_step"], r["loss"]) for r in before][:10] == expected[:10]
    rewound = [(r["_step"], r["loss"]) for r in before if r["_step"] <= 10] + [(r["_step"], r["loss"]) for r in after]
    assert rewound == expected
