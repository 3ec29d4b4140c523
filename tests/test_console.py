"""The training console on a short debug run: one `TAG | field | ...` format for every line,
a compact line per logged step (step/total, loss, LR, tokens/s, memory, ETA; MFU only where the
peak is known), validation lines, an end-of-run summary; every line under 160 characters, no
colour codes off a terminal; the start line names the routing implementation that runs (and says
when it is not the kernel asked for); the summary gives the smoothed final training loss and the
mean throughput / MFU. TensorBoard: grouped tags and the run's hyperparameters."""
import math
import os
import re

import pytest
import torch

from helpers import ROOT, read_metrics
from train_common import SAMPLE, debug_argv

from mhar_titan import console
from mhar_titan.components.performance import (RunTotals, routing_kernel_runs, routing_kernel_warning,
                                               summary_throughput_fields)
from mhar_titan.metrics import ConsoleSink, FlopsPerToken, tensorboard_tag
from mhar_titan.train import main as train_main

pytestmark = pytest.mark.skipif(not (SAMPLE / "validation-00000-of-00001.parquet").exists(),
                                reason="run `python -m mhar_titan.data.prepare_shakespeare --out data/shakespeare`")

STEP = re.compile(r"^step (\s*\d+)/4 \| batch loss (\d+\.\d{4}) \| ema20 loss (\d+\.\d{4}) \| lr (\S+) \| "
                  r"gnorm \S+ \| (\S+) tok/s \| mem (\d+\.\d\d) GiB \| eta (\S+)$")


def test_a_short_run_prints_one_compact_line_per_step_and_a_summary(tmp_path, capsys):
    argv = debug_argv(tmp_path, "console", "--training.steps=4", "--training.local_batch_size=2",
                      "--validation.enable=true", "--validation.freq=2", "--validation.sequences=2",
                      "--checkpoint.enable=true", "--checkpoint.interval=4", "--metrics.enable_tensorboard=true")
    assert train_main(argv) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    rows = read_metrics(tmp_path / "console")
    assert all(len(line) < 160 for line in lines), max(lines, key=len)
    assert not any("\033[" in line for line in lines)  # not a terminal: no colour
    steps = [STEP.match(line) for line in lines if " | batch loss " in line]
    assert all(steps) and [int(m.group(1)) for m in steps] == [1, 2, 3, 4]
    logged = [r for r in rows if "loss" in r]
    decay = 1 - 2 / 21  # the smoothed loss: bias-corrected EMA of every step's batch loss, span 20 steps
    for i, (m, row) in enumerate(zip(steps, logged)):
        assert float(m.group(2)) == pytest.approx(row["loss"], abs=5e-5)
        assert float(m.group(3)) == pytest.approx(row["loss_ema"], abs=5e-5)
        assert float(m.group(4)) == pytest.approx(row["lr"], rel=0.05)
        expected = sum((1 - decay) * decay ** (i - k) * r["loss"] for k, r in enumerate(logged[:i + 1]))
        assert row["loss_ema"] == pytest.approx(expected / (1 - decay ** (i + 1)), rel=1e-12)
    assert logged[0]["loss_ema"] == pytest.approx(logged[0]["loss"], rel=1e-15)  # the first value: the first loss
    assert steps[-1].group(7) == "0s"  # nothing left at the last step
    vals = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    assert [line for line in lines if "val loss" in line and "best" in line and "final" not in line] == [
        f"step {s}/4 | val loss {v:.4f} | best {min(x for _, x in vals[:i + 1]):.4f}" for i, (s, v) in enumerate(vals)]
    start = next(line for line in lines if " | start | " in line)
    assert start.startswith("step 0/4 | start | debug attn_res H=8 sublayer replace") and "batch 2 x 32" in start
    assert start.endswith(" | routing eager")  # routing_kernel = "eager" (the default), and eager runs
    best_step, best = min(vals, key=lambda sv: sv[1])
    run = tmp_path / "console"
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 4  # every step logged: the summary's mean of the last (up to 20) steps is theirs
    assert lines[-7:-1] == [
        f"step 4/4 | done | 4 steps | {console.count(4 * 2 * 32)} tokens | " + lines[-7].split(" | ")[-1],
        f"step 4/4 | train loss | final {sum(losses) / 4:.4f} (mean of the last 4 steps)",
        lines[-5],
        f"step 4/4 | val loss | final {vals[-1][1]:.4f} | best {best:.4f} (step {best_step})",
        f"step 4/4 | run folder | {run}",
        "step 4/4 | checkpoint | checkpoints/step-4",
    ]
    assert lines[-1] == "step 4/4 | metrics | metrics.jsonl | tensorboard tb/"
    assert lines[-7].split(" | ")[-1].startswith("wall ") and f"step 0/4 | run folder | {run}" in lines
    # mean throughput of the run (tokens / loop wall time); no MFU on CPU (no peak FLOP/s known)
    assert re.fullmatch(r"step 4/4 \| throughput \| mean \S+ tok/s \| mfu n/a \(no peak FLOP/s known for cpu\)",
                        lines[-5]), lines[-5]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/grad_norm", "val/loss", "perf/tokens_per_s", "perf/peak_mem_gib",
            "routing/entropy"} <= tags
    assert [e.step for e in acc.Scalars("val/loss")] == [2, 4]
    plugin = acc.PluginTagToContent("hparams")
    assert "_hparams_/experiment" in plugin and "_hparams_/session_start_info" in plugin
    from tensorboard.plugins.hparams import plugin_data_pb2

    start_info = plugin_data_pb2.HParamsPluginData.FromString(plugin["_hparams_/session_start_info"])
    hp = start_info.session_start_info.hparams
    assert hp["optimizer.lr"].number_value == pytest.approx(3e-3) and hp["model.flavor"].string_value == "debug"


def test_run_totals_smooth_the_loss_over_the_last_steps_and_average_the_throughput():
    clock = iter([10.0, 11.0, 12.5, 14.0, 18.0])
    totals = RunTotals(window=2, clock=lambda: next(clock))
    assert totals.smoothed_loss() is None and totals.tokens_per_s() is None
    totals.start()  # t = 10
    for loss in (6.0, 5.0, math.nan, 3.0):  # steps end at t = 11, 12.5, 14, 18
        totals.step(loss, 512)
    assert totals.smoothed_loss() == (4.0, 2)  # mean of 5.0 and 3.0: the NaN step is left out
    assert totals.tokens_per_s() == 4 * 512 / 8.0
    fields = summary_throughput_fields(totals, 2, FlopsPerToken(6e8, 0, 0, 0), 1e12, torch.device("cuda"))
    assert fields == ["mean 256 tok/s", "128 tok/s per device", f"mfu {100 * 6e8 * 128 / 1e12:.1f}%"]
    assert summary_throughput_fields(RunTotals(), 1, FlopsPerToken(6e8, 0, 0, 0), None, torch.device("cpu")) == [
        "none (no step ended)"]
    summary = console.summary_fields(4, 0, 2048, 8.0, 1, [], "out/x", None, ["metrics.jsonl"],
                                     train_loss=totals.smoothed_loss(), throughput=fields)
    assert summary[1] == ["train loss", "final 4.0000 (mean of the last 2 steps)"]
    assert summary[2] == ["throughput", *fields]


def test_routing_kernel_asked_but_not_run_is_said_at_the_start(tmp_path, train_process):
    """routing_kernel = "triton" on CPU without TRITON_INTERPRET trains on the eager path: the
    start line says "routing triton -> eager" and a warning says why."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    argv = debug_argv(tmp_path, "fallback", "--training.steps=1", "--training.local_batch_size=2",
                      "--model.routing_kernel=triton")
    done = train_process(*argv, env={**env, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout + done.stderr
    start = next(line for line in out.splitlines() if " | start | " in line)
    assert start.endswith(" | routing triton -> eager"), start
    assert ("WARNING | model.routing_kernel = 'triton' but routing runs on the eager path: "
            "mhar_kernels.can_run(cpu, dim=128, heads=8) is False (on CPU they run only with TRITON_INTERPRET=1 "
            "set before the start)") in out, out[-3000:]


def test_routing_kernel_warning_names_the_case():
    from mhar_titan.models.args import ModelArgs

    mhar = ModelArgs.from_flavor("debug", residual="attn_res", routing_heads=8, routing_kernel="triton")
    assert routing_kernel_runs(mhar, torch.device("cpu"))[0] == "triton"
    expected = None if routing_kernel_runs(mhar, torch.device("cpu"))[1] == "triton" else "eager path"
    warning = routing_kernel_warning(mhar, torch.device("cpu"))
    assert (warning is None) if expected is None else (expected in warning)
    auto = ModelArgs.from_flavor("debug", residual="attn_res", routing_kernel="auto")
    assert routing_kernel_runs(auto, torch.device("cpu")) == ("auto", "eager") and \
        routing_kernel_warning(auto, torch.device("cpu")) is None  # "auto" asks for whatever runs
    baseline = ModelArgs.from_flavor("debug", residual="standard", routing_kernel="triton")
    assert routing_kernel_runs(baseline, torch.device("cpu")) is None and \
        routing_kernel_warning(baseline, torch.device("cpu")) is None


def test_routing_kernel_warning_gives_the_reason_that_holds():
    """The fallback warning and the dry run's routing line give the reason the fused kernels do not
    run (`mhar_kernels.op.why_not`, the reason `route` raises with): under the interpreter a tile
    over the register budget is named, not TRITON_INTERPRET."""
    from mhar_kernels import op
    from mhar_titan.components.performance import planned_routing
    from mhar_titan.models.args import ModelArgs

    if not op.can_run(torch.device("cpu"), 64, 4):
        pytest.skip("the fused kernels do not run on this CPU (TRITON_INTERPRET=1 not set before import)")
    big = ModelArgs(dim=16384, n_layers=1, n_heads=8, n_kv_heads=8, ffn_dim=64, vocab_size=256, residual="attn_res",
                    routing_heads=1, routing_kernel="triton")
    warning = routing_kernel_warning(big, torch.device("cpu"))
    assert warning.endswith("is False (one token's tile at d=16384, H=1 exceeds the kernels' register budget)"), warning
    assert planned_routing(big, "cpu")[2].endswith("d=16384, H=1 exceeds the kernels' register budget")
    with pytest.raises(RuntimeError, match="cannot run here: one token's tile at d=16384, H=1 exceeds"):
        op.route([torch.zeros(1, 1, 16384)], torch.zeros(16384), torch.ones(16384), 1)


def test_console_fields_eta_and_units():
    assert [console.duration(s) for s in (0.4, 59.6, 187, 7500, math.inf)] == ["0s", "1m00s", "3m07s", "2h05m", "?"]
    assert [console.count(n) for n in (950, 12_345, 4_560_000, 1.2e9, 250_000)] == ["950", "12.3k", "4.56M", "1.2B",
                                                                                     "250k"]
    row = {"loss": 5.12345, "lr": 3e-3, "grad_norm": 0.5, "tokens_per_s": 12_300.0, "mfu": 41.23,
           "peak_mem_gib": 1.5, "nonfinite_skipped": 0}
    assert console.line(console.step_tag(20, 200), console.step_fields(row, 83.0)) == (
        "step  20/200 | batch loss 5.1235 | lr 3.0e-03 | gnorm 0.5 | 12.3k tok/s | mfu 41.2% | mem 1.50 GiB | "
        "eta 1m23s")
    assert console.step_fields({"loss": math.nan, "nonfinite_skipped": 2}, None) == ["batch loss nan", "skipped 2"]
    assert console.step_fields({"loss": 5.0, "loss_ema": 5.25}, None) == ["batch loss 5.0000", "ema20 loss 5.2500"]
    ema = console.LossEMA(3)  # a = 1/2: values 4, (2*4 + 8)/3 ... bias-corrected
    assert [ema.update(x) for x in (4.0, math.nan, 8.0, 2.0)] == [4.0, 4.0, (0.25 * 4 + 0.5 * 8) / 0.75,
                                                                 (0.125 * 4 + 0.25 * 8 + 0.5 * 2) / 0.875]
    assert console.line("step 1/2", ["x"], "val", color=True) == "\033[32mstep 1/2\033[0m | x"
    sink = ConsoleSink(color=True, total_steps=10, start_step=4)
    assert sink.color is False  # pytest's stdout is not a terminal
    assert sink.eta(4) is None and sink.eta(6) >= 0
    assert sink.eta(10) == 0.0


def test_tensorboard_tags_are_grouped():
    assert [tensorboard_tag(k) for k in ("loss", "grad_norm/routing", "val_loss", "mfu", "routing_entropy",
                                         "tokens_seen")] == [
        "train/loss", "train/grad_norm/routing", "val/loss", "perf/mfu", "routing/entropy", "train/tokens_seen"]


def test_the_start_line_step_lines_and_dry_run_say_the_routing_temperature_is_on(capsys):
    """Every routing setting off its default is named on the start line and in the dry run
    (models.args.routing_settings); a learned temperature is on every step line too."""
    from mhar_titan.components.performance import startup_fields
    from mhar_titan.config import load_config
    from mhar_titan.dryrun import main as dryrun_main
    from mhar_titan.metrics import flops_per_token
    from mhar_titan.models import ModelArgs, Transformer
    from mhar_titan.models.args import resolve_model_args, routing_settings

    attnres = ModelArgs.from_flavor("debug", residual="attn_res", routing_heads=1)
    assert routing_settings(attnres) == [] and routing_settings(ModelArgs.from_flavor("debug")) == []
    tau = ModelArgs.from_flavor("debug", residual="attn_res", routing_heads=1, routing_logit_scale="match_heads:8",
                                routing_null_source=True)
    assert routing_settings(tau) == ["routing_null_source=True", "routing_logit_scale=match_heads:8 (x0.354)"]
    config = str(ROOT / "train_configs" / "debug_attnres.toml")
    cfg = load_config(config, ["--model.routing_temperature=learned", "--model.routing_logit_scale=0.5"])
    args = resolve_model_args(cfg.model, cfg.training.seq_len)
    with torch.device("meta"):
        model = Transformer(args)
    fields = startup_fields(cfg, args, model, 1, torch.device("cpu"), 8, 1, flops_per_token(args, 64))
    assert fields[-2:] == ["routing_logit_scale=0.5", "routing_temperature=learned"], fields
    step = console.step_fields({"loss": 5.0, "lr": 1e-3, "routing_temperature_mean": 0.93,
                                "routing_temperature_min": 0.812, "routing_temperature_max": 1.05}, None)
    assert "temp 0.93 (0.812-1.05)" in step
    assert dryrun_main(["--config", config, "--model.routing_temperature=learned", "--device", "cpu"]) == 0
    assert "routing settings: routing_temperature=learned" in capsys.readouterr().out.splitlines()
