"""The training console's line format (imports nothing of ours; `metrics.ConsoleSink` prints).

Every line is ``TAG | field | field ...``: the tag is ``step    S/TOTAL`` for the run's lines
(start, each logged step, validation, events, the end-of-run summary: steps and wall time, the
smoothed final training loss, mean throughput and MFU, validation, run folder, checkpoint) and
the level for log records (``INFO | checkpoint step-200 saved ...``, `LOG_FORMAT`). A logged
step reads

    step   20/200 | batch loss 5.1234 | ema20 loss 5.3012 | lr 3.0e-03 | gnorm 0.52 | 12.3k tok/s
                  | mfu 1.2% | mem 1.21 GiB | eta 1m23s

(one line on the console, wrapped here). "batch loss" is the loss of that one step's batch (the
mean over its target tokens, all ranks and micro-batches: it jumps from batch to batch); "ema20
loss" smooths it, an exponential moving average of every step's batch loss with a span of
`LOSS_EMA_STEPS` = 20 steps (`LossEMA`: weight 2 / 21 on the newest step, bias-corrected at the
start; a run resumed from a checkpoint starts it afresh), logged as ``loss_ema`` in the metrics
files. MFU only where the device's peak is known (`metrics.peak_flops`). Full metrics go to the
JSONL / TensorBoard / wandb sinks; the console shows these few. Colour (the tag) only when the
output is a terminal.
"""
from __future__ import annotations

import math
from typing import Iterable, Optional

LOG_FORMAT = "%(levelname)s | %(message)s"
"""`logging` format of the trainer's log records, in the console's ``TAG | message`` shape."""

COLORS = {"step": "\033[36m", "val": "\033[32m", "event": "\033[35m", "warn": "\033[33m"}
RESET = "\033[0m"


def duration(seconds: float) -> str:
    """``'45s'``, ``'3m07s'``, ``'2h05m'`` (seconds rounded; '?' for a non-finite value)."""
    if not math.isfinite(seconds):
        return "?"
    s = int(round(max(seconds, 0.0)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def count(n: float) -> str:
    """``'950'``, ``'12.3k'``, ``'4.56M'``, ``'1.20B'`` (three significant digits above 1000)."""
    for size, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= size:
            value = n / size
            return f"{value:.3g}{suffix}" if value < 100 else f"{value:.0f}{suffix}"
    return f"{n:.0f}"


def step_tag(step: int, total: Optional[int]) -> str:
    """``'step   20/200'``: the step right-aligned to the width of the total."""
    if not total:
        return f"step {step}"
    return f"step {step:>{len(str(total))}}/{total}"


def loss_text(value: float) -> str:
    return f"{value:.4f}" if math.isfinite(value) else str(value)


LOSS_EMA_STEPS = 20
"""Span of the console's smoothed training loss (``LossEMA``), in steps."""


class LossEMA:
    """Exponential moving average of the step losses with a span of ``steps`` (the newest loss
    weighs ``a = 2 / (steps + 1)``), bias-corrected like Adam's moments: after losses
    ``l_1 .. l_t`` it is ``sum_k a (1 - a)^(t - k) l_k / (1 - (1 - a)^t)``, so the first value is
    ``l_1``. Non-finite losses are left out (``update`` returns the value unchanged)."""

    def __init__(self, steps: int = LOSS_EMA_STEPS):
        self.steps, self.decay = steps, 1.0 - 2.0 / (steps + 1)
        self.biased, self.weight = 0.0, 0.0

    def update(self, loss: float) -> Optional[float]:
        """Add one step's loss (nats); returns the smoothed value (None before any finite loss)."""
        if math.isfinite(loss):
            self.biased = self.decay * self.biased + (1.0 - self.decay) * loss
            self.weight = self.decay * self.weight + (1.0 - self.decay)
        return self.value

    @property
    def value(self) -> Optional[float]:
        return self.biased / self.weight if self.weight > 0 else None


def step_fields(metrics: dict, eta_s: Optional[float]) -> list[str]:
    """The fields of a logged step's line from its metrics row (keys as the trainer logs them:
    loss (this step's batch), loss_ema (``LossEMA``), lr, grad_norm, tokens_per_s, mfu,
    peak_mem_gib, a learned routing temperature's mean and min-max over sites and heads
    (``temp 0.93 (0.81-1.05)``), nonfinite_skipped)."""
    fields = [f"batch loss {loss_text(metrics['loss'])}"]
    if metrics.get("loss_ema") is not None:
        fields.append(f"ema{LOSS_EMA_STEPS} loss {loss_text(metrics['loss_ema'])}")
    if metrics.get("lr") is not None:
        fields.append(f"lr {metrics['lr']:.1e}")
    if metrics.get("grad_norm") is not None:
        fields.append(f"gnorm {metrics['grad_norm']:.3g}")
    if metrics.get("tokens_per_s") is not None:
        fields.append(f"{count(metrics['tokens_per_s'])} tok/s")
    if metrics.get("mfu") is not None:
        fields.append(f"mfu {metrics['mfu']:.1f}%")
    if metrics.get("peak_mem_gib") is not None:
        fields.append(f"mem {metrics['peak_mem_gib']:.2f} GiB")
    if metrics.get("routing_temperature_mean") is not None:  # a learned routing temperature (metrics.TEMPERATURE_KEYS)
        fields.append(f"temp {metrics['routing_temperature_mean']:.3g} ({metrics['routing_temperature_min']:.3g}-"
                      f"{metrics['routing_temperature_max']:.3g})")
    if metrics.get("nonfinite_skipped"):
        fields.append(f"skipped {metrics['nonfinite_skipped']}")
    if eta_s is not None:
        fields.append(f"eta {duration(eta_s)}")
    return fields


def line(tag: str, fields: Iterable[str], kind: str = "step", color: bool = False) -> str:
    """``TAG | field | ...``; the tag coloured by ``kind`` (step, val, event, warn) when ``color``."""
    head = f"{COLORS[kind]}{tag}{RESET}" if color else tag
    return " | ".join([head, *fields])


def summary_fields(steps: int, start_step: int, tokens: int, wall_s: float, skipped: int,
                   val_losses: list[tuple[int, float]], run_dir: str, checkpoint: Optional[str],
                   metrics: list[str], train_loss: Optional[tuple[float, int]] = None,
                   throughput: Optional[list[str]] = None,
                   validation_freq: Optional[int] = None, outcome: str = "done") -> list[list[str]]:
    """The end-of-run summary as lines of fields: what ran, the training loss, throughput,
    validation, the run folder, the checkpoint and the metrics files in it.

    val_losses: (step, loss) of every validation of the run in step order (may be empty);
    checkpoint: the newest checkpoint folder, relative to the run folder, or why there is none
      (None: "none written");
    metrics: where the full metrics are in the run folder (JSONL file, TensorBoard, wandb);
    train_loss: (smoothed final training loss, the number of last steps averaged), or None
      (no finite step loss in this run);
    throughput: the throughput fields (`components.performance.summary_throughput_fields`), or None;
    validation_freq: ``validation.freq`` when validation is on, None when it is off (what the
      validation line says when no validation ran: off, or not due yet when the run stopped);
    outcome: the first line's tag: "done" (training.steps reached, or nothing failed), "preempted"
      (a stop signal, after its checkpoint), "stopped (<error>, below)" (a failed save, bad data,
      training health: the error follows the summary)."""
    ran = steps - start_step
    lines = [[outcome, f"{ran} steps" + (f" (resumed at {start_step})" if start_step else ""),
              f"{count(tokens)} tokens", f"wall {duration(wall_s)}"] + ([f"skipped {skipped}"] if skipped else [])]
    if train_loss is not None:
        lines.append(["train loss", f"final {loss_text(train_loss[0])} (mean of the last {train_loss[1]} "
                                    f"step{'s' if train_loss[1] != 1 else ''})"])
    else:
        lines.append(["train loss", "none (no finite step loss)"])
    if throughput is not None:
        lines.append(["throughput", *throughput])
    if val_losses:
        best_step, best = min(val_losses, key=lambda sv: (sv[1] if math.isfinite(sv[1]) else math.inf, sv[0]))
        lines.append(["val loss", f"final {loss_text(val_losses[-1][1])}",
                      f"best {loss_text(best)} (step {best_step})"])
    elif validation_freq is None:
        lines.append(["val loss", "none (validation.enable = false)"])
    else:
        lines.append(["val loss", f"none in this run (validation.freq = {validation_freq}: the run stopped at step "
                                  f"{steps}, before a validation finished)"])
    lines.append(["run folder", run_dir])
    lines.append(["checkpoint", checkpoint or "none written"])
    lines.append(["metrics", *metrics])
    return lines
