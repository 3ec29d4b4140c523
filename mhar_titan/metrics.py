"""FLOPs, MFU, memory and the metric sinks (console, JSONL, TensorBoard with grouped tags and the
run's hyperparameters, wandb).

FLOPs per token (PaLM convention, as TorchTitan; no causal discount), for
``ModelArgs`` with d = dim, L = n_layers, H = n_heads, KV = n_kv_heads,
hd = head_dim, F = ffn_dim, V = vocab_size, T = seq_len:

* dense matmuls: ``6 * (L * (2 d H hd + 2 d KV hd + 3 d F) + V d)``. The LM-head
  matmul (``V d``) is counted whether or not the embedding is tied; the
  embedding lookup is not a matmul and is not counted.
* attention scores and values: ``12 L H hd T``.
* depth routing (counted separately): every routing site reads its ``N_s``
  sources; each source row costs ``2 d`` for the logit against the
  pseudo-query and ``2 d`` for the weighted sum, times 3 for forward+backward:
  ``12 d * sum_s N_s``. RMSNorm and softmax are elementwise and not counted
  (as for the model's own norms).

MFU (percent) = ``100 * flops_per_token * tokens_per_second_per_device / peak_flops``.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import resource
import sys
import threading
import time
from typing import Optional

import torch

from mhar_titan import console
from mhar_titan.files import os_error_of, write_text, writing
from mhar_titan.models.plan import RoutingPlan

# --------------------------------------------------------------------------- FLOPs


@dataclasses.dataclass(frozen=True)
class FlopsPerToken:
    """Training (forward + backward) FLOPs per token, split by where they go."""

    dense: float
    """Block matmuls (attention projections and MLP)."""
    lm_head: float
    attention: float
    """Score and value matmuls: 12 L H hd T."""
    routing: float
    """Depth routing (0 for the baseline)."""

    @property
    def model(self) -> float:
        """Everything except routing."""
        return self.dense + self.lm_head + self.attention

    @property
    def total(self) -> float:
        return self.model + self.routing


def _head_dim(args) -> int:
    return getattr(args, "head_dim", None) or args.dim // args.n_heads


def routing_source_counts(args) -> list[int]:
    """Number of sources read by each routing site (attention, MLP, ..., final), the null
    source included: ``RoutingPlan.from_args(args).source_counts`` (mhar_titan/models/plan.py).

    Sublayer granularity: site s of 2L+1 reads s sources (embedding + earlier sublayer
    outputs). Block granularity (k layers per block, MHAR_SPEC 1.2 convention): completed
    blocks plus, in replace mode, the open block's partial sum. Empty for the standard residual.
    """
    return list(RoutingPlan.from_args(args).source_counts)


def flops_per_token(args, seq_len: int) -> FlopsPerToken:
    """Closed-form training FLOPs per token of ``Transformer(args)`` at ``seq_len`` (see module doc)."""
    d, L, H, KV, F, V = args.dim, args.n_layers, args.n_heads, args.n_kv_heads, args.ffn_dim, args.vocab_size
    hd = _head_dim(args)
    per_layer = 2 * d * H * hd + 2 * d * KV * hd + 3 * d * F
    return FlopsPerToken(
        dense=6.0 * L * per_layer,
        lm_head=6.0 * V * d,
        attention=12.0 * L * H * hd * seq_len,
        routing=12.0 * d * sum(routing_source_counts(args)),
    )


TEMPERATURE_KEYS = ("routing_temperature_mean", "routing_temperature_min", "routing_temperature_max")
"""The learned routing temperature's metrics (``routing_temperature_metrics``)."""


@torch.no_grad()
def routing_temperature_metrics(model: torch.nn.Module) -> dict:
    """Mean, min and max over routing sites and heads of the learned routing temperatures
    t = exp(log_temperature) (``model.routing_temperature = "learned"``; the factor every depth
    logit is multiplied by, ``DepthRouting.temperatures``) as ``TEMPERATURE_KEYS``; {} for a fixed
    temperature, the baseline or another connection than depth routing (the fixed scale is in the
    config). Under FSDP2 the sharded parameter is gathered (a collective: every rank calls this, as
    the trainer's logged steps do)."""
    routing = getattr(model, "routing", None)
    if routing is None or model.args.residual != "attn_res" or not routing.learned:  # depth routing's only
        return {}
    t = routing.temperatures()  # (S, H)
    t = (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().double()
    return dict(zip(TEMPERATURE_KEYS, (float(t.mean()), float(t.min()), float(t.max()))))


# Dense bf16 peak FLOP/s per device, matched by substring of the device name (first match wins).
PEAK_FLOPS = (
    ("H200", 989e12),
    ("H100", 989e12),
    ("GH200", 989e12),
    ("B200", 2.25e15),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("A10G", 125e12),
    ("MI300X", 1307e12),
)


def peak_flops(device: torch.device) -> Optional[float]:
    """bf16 dense peak of a CUDA device from ``PEAK_FLOPS``; None on CPU or an unknown GPU."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, value in PEAK_FLOPS:
        if key in name:
            return value
    return None


def mfu(flops_per_token: float, tokens_per_second_per_device: float, peak: Optional[float]) -> Optional[float]:
    """Model FLOPs utilisation in percent; None when the peak is unknown."""
    if not peak:
        return None
    return 100.0 * flops_per_token * tokens_per_second_per_device / peak


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory in GiB: CUDA max allocated on GPU, the process's own peak RSS on CPU.

    On Linux the peak is ``VmHWM`` of ``/proc/self/status``: getrusage's ``ru_maxrss`` carries the
    parent's high-water mark across exec, so a trainer started by a large process (a launcher,
    a notebook, pytest) would report the parent's memory. Elsewhere ``ru_maxrss``."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 2**20  # kB
    except (OSError, StopIteration, ValueError):
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


class Throughput:
    """Tokens/s over the steps since the last ``rate()`` call."""

    def __init__(self):
        self.t0 = time.perf_counter()
        self.tokens = 0

    def add(self, tokens: int) -> None:
        self.tokens += tokens

    def rate(self) -> float:
        now = time.perf_counter()
        r = self.tokens / max(now - self.t0, 1e-9)
        self.t0, self.tokens = now, 0
        return r


# --------------------------------------------------------------------------- sinks


class ConsoleSink:
    """The console (`mhar_titan.console` formats): one line per logged step with the ETA (the
    mean time per step since the sink started, times the steps left), a line per validation
    with the best loss so far, and event lines (`event`). Colour only on a terminal."""

    def __init__(self, color: bool = True, total_steps: Optional[int] = None, start_step: int = 0):
        self.color = color and sys.stdout.isatty()
        self.total, self.start_step = total_steps, start_step
        self.t0 = time.perf_counter()
        self.best: Optional[float] = None

    def eta(self, step: int) -> Optional[float]:
        """Seconds left at `step` (None without a total or before a step ran)."""
        if not self.total or step <= self.start_step:
            return None
        return (time.perf_counter() - self.t0) / (step - self.start_step) * (self.total - step)

    def log(self, step: int, metrics: dict) -> None:
        tag = console.step_tag(step, self.total)
        if "loss" in metrics:
            self._print(console.line(tag, console.step_fields(metrics, self.eta(step)), "step", self.color))
        if "val_loss" in metrics:
            value = metrics["val_loss"]
            if math.isfinite(value) and (self.best is None or value < self.best):
                self.best = value
            best = [] if self.best is None else [f"best {console.loss_text(self.best)}"]
            sources = [f"{k[len('val_loss/'):]} {console.loss_text(v)}" for k, v in metrics.items()
                       if k.startswith("val_loss/")]  # a data mixture's sources
            self._print(console.line(tag, [f"val loss {console.loss_text(value)}", *best, *sources], "val",
                                     self.color))
        downstream = [f"{k[5:]} {v:.4g}" for k, v in metrics.items() if k.startswith("eval/") and v is not None]
        if downstream:
            self._print(console.line(tag, ["eval", *downstream], "val", self.color))

    def event(self, step: int, fields: list[str], kind: str = "event") -> None:
        """A line of the run that is not a metrics row (start, preemption, summary)."""
        self._print(console.line(console.step_tag(step, self.total), fields, kind, self.color))

    @staticmethod
    def _print(text: str) -> None:
        print(text, flush=True)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def read_jsonl_rows(path: pathlib.Path) -> list[dict]:
    """The rows of a metrics JSONL file, in file order. A last line that is not whole JSON (the
    write of a full disk or a killed process stopped inside it) is left out; a broken line before
    the last is an error.

    Raises:
        ValueError: a line other than the last is not JSON (the message names the file and line).
    """
    lines = [(i, line) for i, line in enumerate(pathlib.Path(path).read_text().splitlines(), 1) if line.strip()]
    rows = []
    for k, (number, line) in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if k == len(lines) - 1:
                break  # torn by the failed write
            raise ValueError(f"{path} line {number} is not JSON; the metrics file is damaged (repair or move "
                             f"it away)") from None
    return rows


class JSONLSink:
    """One JSON object per log call, appended (a resumed run continues the same file; a torn last
    row, left by a full disk or a kill, is dropped first).

    ``resume_step``: a run resumed from the checkpoint of that step first drops the rows the
    interrupted run wrote after it, so every step appears once, with the resumed run's values.
    """

    def __init__(self, path: pathlib.Path, resume_step: Optional[int] = None):
        if path.exists():  # a torn last row (a full disk, a kill) is dropped before rows are appended
            lines = [line for line in path.read_text().splitlines() if line.strip()]
            rows = read_jsonl_rows(path)
            kept = [line for line, r in zip(lines, rows) if resume_step is None or r.get("step", 0) <= resume_step]
            if len(kept) != len(lines):
                write_text(path, "".join(line + "\n" for line in kept))
        self.path = path
        with writing(path):
            self.f = open(path, "a", buffering=1)

    def log(self, step: int, metrics: dict) -> None:
        row = {"step": step}
        for k, v in metrics.items():
            if v is None:
                continue
            # JSON has no NaN/inf: a skipped step's loss is written as the string "nan"/"inf".
            row[k] = str(v) if isinstance(v, float) and not math.isfinite(v) else v
        with writing(self.path):  # a full disk: WriteError (one line), not a traceback
            self.f.write(json.dumps(row) + "\n")

    def flush(self) -> None:
        """Rows written so far reach the disk (fsync): they survive a crash of the machine too."""
        with writing(self.path):
            self.f.flush()
            os.fsync(self.f.fileno())

    def close(self) -> None:
        try:
            self.f.close()
        except OSError:  # the write that failed already raised WriteError; nothing more to say
            pass


PERF_KEYS = ("tokens_per_s", "tokens_per_s_per_device", "tflops_per_device", "mfu", "routing_flops_share",
             "peak_mem_gib")


def tensorboard_tag(key: str) -> str:
    """The grouped TensorBoard tag of a metrics key: ``val_loss`` -> ``val/loss``, ``eval/...`` as it is, throughput and
    memory under ``perf/``, ``routing_entropy`` -> ``routing/entropy``, the rest under ``train/``
    (``loss`` -> ``train/loss``, ``grad_norm/routing`` -> ``train/grad_norm/routing``)."""
    if key.startswith("val_"):
        return "val/" + key[4:]
    if key.startswith("eval/"):  # downstream tasks (components.downstream): eval/<task>/<metric>
        return key
    if key in PERF_KEYS:
        return "perf/" + key
    if key.startswith("routing_"):
        return "routing/" + key[8:]
    return "train/" + key


def flat_hparams(config: dict, prefix: str = "") -> dict:
    """A nested config dict as TensorBoard hyperparameters ``{"section.key": value}``: numbers,
    strings and booleans as they are, anything else (lists, None) as its text."""
    flat = {}
    for k, v in config.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            flat.update(flat_hparams(v, name + "."))
        else:
            flat[name] = v if isinstance(v, (bool, int, float, str)) else str(v)
    return flat


class TensorBoardSink:
    """Scalars in a TensorBoard event file under ``folder``, flushed after every log call.

    ``resume_step``: the writer is opened with ``purge_step = resume_step + 1``, so TensorBoard
    discards the events an interrupted run wrote after the checkpoint it resumed from.
    """

    def __init__(self, folder: pathlib.Path, resume_step: Optional[int] = None, hparams: Optional[dict] = None):
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams as hparams_summary

        purge = resume_step + 1 if resume_step is not None else None
        self.folder = folder
        _quiet_event_writer_threads()
        with writing(folder):  # a full disk (raised by tensorboard's writer thread): WriteError, one line
            self.writer = SummaryWriter(log_dir=str(folder), purge_step=purge)
            if hparams and resume_step is None:  # the run's hyperparameters, once, in this run's own event file
                for summary in hparams_summary(flat_hparams(hparams), {"val/loss": 0.0, "train/loss": 0.0}):
                    self.writer.file_writer.add_summary(summary)
                self.writer.flush()

    def log(self, step: int, metrics: dict) -> None:
        with writing(self.folder):
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and v is not None:
                    self.writer.add_scalar(tensorboard_tag(k), v, step)
            self.writer.flush()

    def flush(self) -> None:
        with writing(self.folder):
            self.writer.flush()

    def close(self) -> None:
        try:
            self.writer.close()
        except Exception as e:  # the failed write already raised WriteError; a bug still shows
            if os_error_of(e) is None:
                raise


def _quiet_event_writer_threads() -> None:
    """tensorboard's event-writer thread hands a failed write (a full disk) to the writing thread,
    which reports it once as ``WriteError``, and then re-raises it, so ``threading`` would print a
    second, raw traceback: such OS failures of that thread are kept off stderr (anything else is
    printed as before)."""
    previous = threading.excepthook
    if getattr(previous, "quiet_event_writers", False):
        return

    def hook(args):
        if type(args.thread).__name__ == "_AsyncWriterThread" and os_error_of(args.exc_value) is not None:
            return
        previous(args)

    hook.quiet_event_writers = True
    threading.excepthook = hook


WANDB_FLUSH_INTERVAL_S = 1.0
"""wandb writes run data to its ``.wandb`` file at this interval (its setting
``x_transaction_log_flush_interval``; wandb's default is 15 s)."""


class WandbSink:
    """wandb run in ``run_dir``; ``WANDB_MODE=offline`` writes locally without network.

    The run id is kept by the trainer (train state) so that a resumed job continues the same
    run. Resuming from the checkpoint of step k uses ``resume_from="<id>?_step=<k>"``: wandb
    rewinds the run's history to step k (its rows after k, written by the interrupted run, are
    replaced by the resumed run's), so every step appears once. In an offline record the
    resumed part is a new ``offline-run-*`` folder whose run config holds
    ``_wandb.branch_point = {run_id, step: k}``; ``wandb sync`` applies the rewind.

    ``flush()`` (called at every checkpoint) commits the current step's row; wandb writes it to
    its file within ``WANDB_FLUSH_INTERVAL_S``. A kill within that time may lose the last rows
    from the wandb record only (the JSONL file, fsynced at each checkpoint, keeps them).
    """

    def __init__(self, project: str, name: str, run_dir: pathlib.Path, config: dict, run_id: Optional[str],
                 resume_step: Optional[int] = None):
        import wandb

        settings = wandb.Settings(x_transaction_log_flush_interval=WANDB_FLUSH_INTERVAL_S)
        if run_id is not None and resume_step is not None:
            self.run = wandb.init(project=project, name=name, dir=str(run_dir), config=config, settings=settings,
                                  resume_from=f"{run_id}?_step={resume_step}")
        else:
            self.run = wandb.init(project=project, name=name, dir=str(run_dir), config=config, settings=settings,
                                  id=run_id, resume="allow")
        self.id = self.run.id

    def log(self, step: int, metrics: dict) -> None:
        self.run.log({k: v for k, v in metrics.items() if v is not None}, step=step)

    def flush(self) -> None:
        self.run.log({}, commit=True)

    def close(self) -> None:
        self.run.finish()


class MetricsLogger:
    """Fans metrics out to the sinks. Only the logging rank (0) owns sinks.

    Args:
        cfg: the ``[metrics]`` section.
        run_dir: run folder; JSONL at ``run_dir / cfg.jsonl_file``, TensorBoard under
            ``run_dir / cfg.save_tb_folder``, wandb under ``run_dir / "wandb"``.
        rank: global rank; ranks other than 0 log nothing.
        run_name, config: wandb run name and config dict.
        wandb_id: id of a previous wandb run to continue (from the train state).
        resume_step: the step of the checkpoint this run resumed from (None for a fresh
            start): every sink drops what an interrupted run logged after it (JSONL rows
            removed, TensorBoard ``purge_step``, wandb ``resume_from``), so each step appears
            once, with the resumed run's values.

    ``flush()`` at every checkpoint makes everything logged so far survive a crash.
    """

    def __init__(self, cfg, run_dir: pathlib.Path, rank: int, run_name: str = "run",
                 config: Optional[dict] = None, wandb_id: Optional[str] = None,
                 resume_step: Optional[int] = None, total_steps: Optional[int] = None):
        self.sinks = []
        self.wandb_id = None
        self.console: Optional[ConsoleSink] = None
        self.locations: list[str] = []
        if rank != 0:
            return
        run_dir = pathlib.Path(run_dir)
        self.jsonl_path = run_dir / cfg.jsonl_file
        self.console = ConsoleSink(not cfg.disable_color_printing, total_steps, resume_step or 0)
        self.sinks += [self.console, JSONLSink(self.jsonl_path, resume_step)]
        self.locations.append(cfg.jsonl_file)  # inside the run folder
        if cfg.enable_tensorboard:
            self.sinks.append(TensorBoardSink(run_dir / cfg.save_tb_folder, resume_step, config))
            self.locations.append(f"tensorboard {cfg.save_tb_folder}/")
        if cfg.enable_wandb:
            sink = WandbSink(cfg.wandb_project, run_name, run_dir, config or {}, wandb_id, resume_step)
            self.wandb_id = sink.id
            self.sinks.append(sink)
            self.locations.append("wandb wandb/")

    def log(self, step: int, metrics: dict) -> None:
        for sink in self.sinks:
            sink.log(step, metrics)

    def event(self, step: int, *fields: str, kind: str = "event") -> None:
        """A console-only line (`ConsoleSink.event`); nothing on ranks other than 0."""
        if self.console is not None:
            self.console.event(step, list(fields), kind)

    def validation_losses(self) -> list[tuple[int, float]]:
        """(step, val_loss) of every validation in the JSONL file (a resumed run's earlier ones
        included), in step order; [] on ranks other than 0."""
        if self.console is None or not self.jsonl_path.exists():
            return []
        rows = read_jsonl_rows(self.jsonl_path)
        return sorted((r["step"], float(r["val_loss"])) for r in rows if "val_loss" in r)

    def flush(self) -> None:
        """Every sink hands what it holds to its file (see each sink); call it when a checkpoint is saved."""
        for sink in self.sinks:
            sink.flush()

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []
