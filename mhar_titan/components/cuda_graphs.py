"""``training.cuda_graphs``: each micro-batch's forward and backward replayed as one CUDA graph.

Why: at the paper's 1b recipe (micro-batch 4 x 1024) even the baseline's eager step is host-bound
(docs/benchmarks-log.md, "Whole-step host time and the host-bound verdict"); a replayed graph queues the
whole forward and backward with one call. How (the pattern of PyTorch's CUDA-graph notes, as
TorchTitan's trainer applies it): the first ``WARMUP_CALLS`` micro-batches run eagerly on a side
stream, which makes everything that is made once (cuBLAS workspaces, NCCL communicators, FSDP2's
buffers, Triton's compiled and autotuned kernels, and with ``compile.enable`` or
``model.routing_kernel = "compile"`` every compiled graph the step runs); the next call captures
forward and backward into a graph over static input buffers, with one memory pool for the run;
every later call copies its batch and global target count into those buffers and replays. The step around it
(clipping, the optimizer, the EMA) stays eager; the forward and backward read nothing back from the
device (``tests/test_capture_safe.py``), which capture needs. Gradients must keep their storage, so
the trainer zeroes them in place (``zero_grad(set_to_none=False)``) when graphs are on.

What composes with it, and why:
- **the fused routing kernels** (``model.routing_kernel = "triton"`` / ``"auto"``): their
  launches take device tensors and shapes fixed per model, nothing written from the host during
  the step (the capture-safety tests, ``tests/test_capture_safe*.py``, compare every launch's
  arguments across steps).
- **torch.compile** (``compile.enable``, any component; ``model.routing_kernel = "compile"``):
  compiled code is compiled in the warm-up call, which runs the same forward and backward at the
  same shapes. What runs on the host at a later call is the guard check: Python reading tensor
  metadata (shape, dtype, device, strides) and Python values, no device read and no launch, so it
  records nothing into the graph and passes for the static buffers as it passed for the warm-up
  batch (``tests/test_cuda_graphs.py`` runs the trainer's compiled model from its cache after one
  warm-up micro-batch). Should a guard still fail inside the capture (a recompile would run the compiler, and its
  benchmarks, inside the graph), the capture runs under ``torch.compiler.set_stance
  ("fail_on_recompile")`` and stops at once with ``RecompiledDuringCapture``, naming the guard; the
  same guard fails on every rank, so every rank stops with it instead of some waiting in a
  collective.
- **every depth connection**: DenseFormer's averages, MUDDFormer's weights and streams, and
  Hyper-Connections' and mHC's mappings (mHC's Sinkhorn a fixed number of iterations) and n-stream
  state are tensor ops on device tensors with shapes fixed per model, nothing read back from the
  device (``tests/test_capture_safe.py`` trains each, AC none and full).
- **document masking** (``model.attn_mask_type = "block_causal"``, ``model.rope_per_document``):
  the model builds the batch's attention context inside its forward, from the token tensor it is
  given (``Transformer.attention_context``), so under capture it is built from the static token
  buffer by device ops only: document ids (a cumulative sum), the dense mask or FlexAttention's
  ``create_block_mask`` (arange, the mask function vmapped over indices, block sums, a stable
  argsort: every shape a function of (B, T), no host read; checked against torch's source and
  ``tests/test_cuda_graphs.py``), and the per-document RoPE positions (a cumulative max and a
  gather). The block mask's tensors and the document ids its mask function closes over are
  allocated from the graph's pool and rewritten by every replay, so nothing is copied in by hand.

Refused (``capture_blockers``): ``debug.force_nonfinite_loss_steps`` (a poisoned step runs
another forward than the graph holds) and ``activation_checkpoint.preserve_rng_state`` with
checkpointing on (the recomputation saves and restores the CUDA RNG state through the host, which
torch refuses during capture).

Status: **this path has not run on a GPU yet.** The GPU suite (bench/gpu_suite.sh) runs
``tests/test_cuda_graphs_gpu.py`` and its ``graphs`` and ``trainer`` rows compare 20 steps with and
without it, losses bitwise; until they have run, the option stays off by default and should be
treated as experimental.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional

import torch

from mhar_titan.config import ConfigError

WARMUP_CALLS = 1
"""Micro-batches run eagerly on a side stream before the capture (PyTorch's notes use a few; one
suffices here: it runs the same forward and backward at the same shapes as every later call, so
whatever is made once, compiled graphs included, exists before the capture; the optimizer step is
never captured)."""


class RecompiledDuringCapture(RuntimeError):
    """Compiled code met a guard it had not met in the warm-up while a micro-batch step was being
    captured (the message names the function and the failed guard)."""


def capture_blockers(cfg, args) -> list[str]:
    """Settings of ``cfg`` (a ``JobConfig``; ``args``: its resolved ``ModelArgs``) under which a
    captured forward and backward would be wrong or cannot be captured, each as one sentence naming
    the key and why; empty when there are none (everything else composes: module docstring)."""
    blockers = []
    if cfg.debug.force_nonfinite_loss_steps:
        blockers.append("debug.force_nonfinite_loss_steps (a poisoned step runs another forward than the graph "
                        "holds; leave it empty)")
    if cfg.activation_checkpoint.mode != "none" and cfg.activation_checkpoint.preserve_rng_state:
        blockers.append("activation_checkpoint.preserve_rng_state = true (a checkpointed block saves and restores "
                        "the CUDA RNG state through the host, which torch refuses during capture; the model draws "
                        "no random numbers: set it false)")
    return blockers


def check_cuda_graphs(cfg, args, cuda_available: Optional[bool] = None) -> None:
    """Refuse ``training.cuda_graphs = true`` where it cannot work, before anything is built
    (``args``: the job's resolved ``ModelArgs``; ``cuda_available`` defaults to torch's answer).

    Raises:
        ConfigError: no CUDA device (CPU training has nothing to capture), or settings listed by
        ``capture_blockers``.
    """
    if not cfg.training.cuda_graphs:
        return
    cuda = torch.cuda.is_available() if cuda_available is None else cuda_available
    if not cuda:
        raise ConfigError("'training.cuda_graphs' = true needs a CUDA device (this run trains on the CPU, where "
                          "there are no graphs to capture); set training.cuda_graphs = false")
    blockers = capture_blockers(cfg, args)
    if blockers:
        raise ConfigError("'training.cuda_graphs' = true cannot capture this job: " + "; ".join(blockers))


@contextlib.contextmanager
def no_recompile() -> Iterator[None]:
    """Run compiled code only from its cache: a recompile (a guard the warm-up did not meet)
    raises ``RecompiledDuringCapture`` naming the function and the guard, instead of compiling
    inside a capture. Code not under torch.compile is unaffected."""
    try:
        with torch.compiler.set_stance("fail_on_recompile"):
            yield
    except RuntimeError as e:
        if "fail_on_recompile" not in str(e):
            raise
        raise RecompiledDuringCapture(
            "training.cuda_graphs: compiled code recompiled while the micro-batch step was being captured, after "
            f"{WARMUP_CALLS} eager warm-up micro-batch(es) at the same shapes ({e}); run with "
            "training.cuda_graphs = false, or TORCH_LOGS=recompiles to see every guard that failed") from e


class GraphedMicroStep:
    """Forward and backward of one micro-batch, captured once and replayed (module docstring).

    ``step(x, y, n_global)`` does what the eager trainer does per micro-batch, in the same
    arithmetic (so eager and graphed losses can agree bit for bit): ``loss_sum = model(x, y,
    loss_fn=loss_fn)`` then ``(loss_sum / n_global * world_size).backward()``, and returns
    ``loss_sum`` detached (a 0-dim tensor, the graph's static output: read or copy it before the
    next call). x, y: (B, T) int64 on the device, the same shape at every call (the loader's
    windows are fixed); n_global: 0-dim fp32 on the device, the step's target count over every
    rank; world_size: the data-parallel ranks (a constructor argument, fixed for the run).

    Raises:
        ValueError: a batch of another shape than the captured one.
        RecompiledDuringCapture: compiled code recompiled during the capture (``no_recompile``).
    """

    def __init__(self, model: torch.nn.Module, loss_fn: Callable, world_size: int = 1):
        self.model, self.loss_fn, self.world_size = model, loss_fn, world_size
        self.calls = 0
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.pool = None
        self.static: dict[str, torch.Tensor] = {}

    def _eager(self, x, y, n_global) -> torch.Tensor:
        loss_sum = self.model(x, y, loss_fn=self.loss_fn)
        (loss_sum / n_global * self.world_size).backward()
        return loss_sum.detach()

    def step(self, x: torch.Tensor, y: torch.Tensor, n_global: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls <= WARMUP_CALLS:  # compiles, autotunes and allocates what is made once
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                loss = self._eager(x, y, n_global)
            torch.cuda.current_stream().wait_stream(side)
            return loss
        if self.graph is None:
            # the static buffers: the attention context (document mask, RoPE positions) is built
            # from static["x"] inside the captured forward, so every replay rebuilds it on the device
            self.static = {"x": x.clone(), "y": y.clone(), "n_global": n_global.clone()}
            self.pool = torch.cuda.graph_pool_handle()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=self.pool), no_recompile():
                self.static["loss"] = self._eager(self.static["x"], self.static["y"], self.static["n_global"])
        elif x.shape != self.static["x"].shape or y.shape != self.static["y"].shape:
            raise ValueError(f"a captured micro-batch step takes batches of {tuple(self.static['x'].shape)}, got "
                             f"{tuple(x.shape)}: CUDA graphs need the same shapes at every step")
        else:
            self.static["x"].copy_(x, non_blocking=True)
            self.static["y"].copy_(y, non_blocking=True)
            self.static["n_global"].copy_(n_global, non_blocking=True)
        self.graph.replay()
        return self.static["loss"]
