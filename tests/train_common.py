"""Shared by test_train*.py and dist_train_checks.py: small trainer configs and gradient probes."""
import torch
from helpers import ROOT, read_metrics

from mhar_titan.components.batches import next_micro_batches
from mhar_titan.config import load_config

DEBUG_MHAR = ROOT / "train_configs" / "debug_mhar.toml"
SAMPLE = ROOT / "data" / "shakespeare"


def debug_argv(run_root, name, *overrides, config=DEBUG_MHAR):
    """Command line of debug_mhar shrunk for tests (seq 32, no validation, log every step, no checkpoints)."""
    return [
        "--config", str(config), f"--job.dump_folder={run_root}", f"--job.name={name}",
        f"--data.files=[\"{SAMPLE}/train-*.parquet\"]",
        f"--data.validation_files=[\"{SAMPLE}/validation-*.parquet\"]",
        "--training.seq_len=32", "--metrics.log_freq=1", "--validation.enable=false",
        "--metrics.disable_color_printing=true", "--lr_scheduler.warmup_steps=2",
        "--checkpoint.enable=false", *overrides,
    ]


MIXTURE_ARGV = (
    "--data.files=[]", "--data.validation_files=[]", "--data.sharding=document",
    f'--data.sources=[{{name = "plays01", weight = 0.7, files = ["{SAMPLE}/train-0000[01]-of-00004.parquet"], '
    f'validation_files = ["{SAMPLE}/validation-00000-of-00001.parquet"]}}, '
    f'{{name = "plays23", weight = 0.3, files = ["{SAMPLE}/train-0000[23]-of-00004.parquet"]}}]',
)
"""``debug_argv`` overrides for a two-source mixture of the sample (weights 0.7 / 0.3, document
sharding, validation files for the first source only)."""


def source_positions(loader) -> dict:
    """Every source's stream position in a mixture train loader's state, by worker: {source: [(epoch,
    part, row, window), ...]}."""
    out = {}
    for ws in loader._worker_states(loader.state_dict()["loader"]):
        for name, st in ws["stream"]["streams"].items():
            out.setdefault(name, []).append([st["epoch"], st["part"], st["row"], st["window"]])
    return out


def debug_cfg(run_root, name, *overrides, config=DEBUG_MHAR):
    """``debug_argv`` as a loaded ``JobConfig``."""
    return load_config(None, debug_argv(run_root, name, *overrides, config=config))


def masked_micro_batches(trainer, rank, world):
    """The next step's micro-batches with some labels set to -100.

    Row r of the global batch (window order, independent of the world size) ignores its
    first ``(3 * r) % 11`` labels, so micro-batches hold different numbers of targets.
    """
    micro = next_micro_batches(iter_of(trainer), trainer.grad_accum, trainer.device, trainer.state.step + 1)
    B = micro[0][0].shape[0]
    out = []
    for k, (x, y) in enumerate(micro):
        y = y.clone()
        for i in range(B):
            global_row = (k * world + rank) * B + i
            y[i, : (3 * global_row) % 11] = -100
        out.append((x, y))
    return out


_iters = {}


def iter_of(trainer):
    if id(trainer) not in _iters:
        _iters[id(trainer)] = iter(trainer.train_loader)
    return _iters[id(trainer)]


def full_grads(model):
    """{name: full gradient} (gathered from FSDP shards), fp64 on CPU."""
    out = {}
    for name, p in model.named_parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        out[name] = g.detach().double().cpu()
    return out


def rel_diff(g, ref):
    """||g - ref|| / ||ref|| over all parameters together."""
    num = sum((g[k] - ref[k]).pow(2).sum() for k in ref)
    den = sum(ref[k].pow(2).sum() for k in ref)
    return (num / den).sqrt().item()


def full(t: torch.Tensor) -> torch.Tensor:
    """A plain copy of a (possibly FSDP-sharded) tensor, taken while the process group exists."""
    t = t.detach()
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).clone()


def train(cfg):
    """Train ``cfg``; returns ({step: loss} from metrics.jsonl, the final weights, the EMA averages or None)."""
    from mhar_titan.train import Trainer

    trainer = Trainer(cfg)
    try:
        trainer.train()
        averages = {k: full(v) for k, v in trainer.ema.averages.items()} if trainer.ema is not None else None
        weights = {k: full(v) for k, v in trainer.model.state_dict().items()}
    finally:
        trainer.close()
    losses = {row["step"]: row["loss"] for row in read_metrics(trainer.run_dir) if "loss" in row}
    return losses, weights, averages
