"""A CPU rehearsal of every committed training config that routes on the fused kernels on a GPU.

`routing_kernel = "auto"` (or "triton") is the fused Triton path on CUDA and the eager path on a CPU,
so a fault of the fused kernels under a config's own routing settings (the paper layout's embedding
gradient was one) cannot show in that config's CPU runs. Each such config is rehearsed here at a small
shape with its own routing settings, layer structure (blocks of its size, one more than two blocks)
and activation checkpointing: the fused kernels (TRITON_INTERPRET=1) against the eager path, loss and
every parameter's gradient, in fp64 within 1e-9 relative and in fp32 within 2e-4 (tests/model_equivalence.py).
"""
import dataclasses
from pathlib import Path

import pytest
import torch

import model_equivalence as me
from helpers import ROOT
from mhar_titan.config.parser import load_config
from mhar_titan.models.args import resolve_model_args

pytestmark = pytest.mark.usefixtures("one_thread")

FUSED_ON_CUDA = ("auto", "triton")
CONFIGS = sorted(p for p in (ROOT / "train_configs").glob("*.toml"))


def fused_on_cuda(path: Path) -> bool:
    """Whether the config routes on the fused kernels on CUDA (a routed family on "auto" or "triton")."""
    args = resolve_model_args(load_config(str(path)).model, 16)
    return args.residual != "standard" and args.routing_kernel in FUSED_ON_CUDA


REHEARSED = [p for p in CONFIGS if fused_on_cuda(p)]


def rehearsal(path: Path) -> tuple[dict, str]:
    """The config's routing settings at the matrix's small shape (`model_equivalence.SHAPE`), with
    enough layers for two whole blocks and an open one at block granularity, as a matrix
    combination; and its activation checkpointing mode."""
    cfg = load_config(str(path))
    args = resolve_model_args(cfg.model, cfg.training.seq_len)
    fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(args)
              if (f.name == "residual" or f.name.startswith("routing_") or f.name in me.EXTRA_FIELDS)
              and f.name != "routing_kernel"}
    if fields["routing_layout"] == "paper":  # the paper layout's routing eps is the model's norm eps
        fields["routing_eps"] = me.DEFAULTS.norm_eps
    layers = 2 * args.routing_block_layers + 1 if args.routing_granularity == "block" else 3
    return {**fields, "n_layers": min(args.n_layers, layers)}, cfg.activation_checkpoint.mode


def test_every_config_fused_on_a_gpu_is_rehearsed():
    """The configs that the fused kernels train on a GPU are found (the 8B mid-training config, which
    trains in the paper layout, among them), and none of the others routes on them."""
    names = {p.name for p in REHEARSED}
    assert "midtrain_llama3_8b_delta_mhar.toml" in names and "mhar_1b.toml" in names
    assert "debug_mhar.toml" not in names and "baseline_1b.toml" not in names


@pytest.mark.parametrize("path", REHEARSED, ids=[p.stem for p in REHEARSED])
def test_fused_kernels_equal_eager_under_the_configs_routing(path):
    combination, ac = rehearsal(path)
    n_layers = combination.pop("n_layers")
    combination["ac"] = "full" if ac == "selective" else ac  # a selective mode recomputes some blocks as full does
    failures = me.check_combination(combination, runs=(("triton", torch.float64), ("triton", torch.float32)),
                                    decode=(), shape={**me.SHAPE, "n_layers": n_layers})
    assert not failures, "\n".join(failures)
