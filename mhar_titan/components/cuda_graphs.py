"""``training.cuda_graphs``: each micro-batch's forward and backward replayed as one CUDA graph.

Why: at the paper's 1b recipe (micro-batch 4 x 1024) the host needs about as long to queue a step's
kernels as the GPU needs to run them (BENCHMARKS.md, "Host time per step"); a replayed graph
queues the whole forward and backward with one call. How (the pattern of PyTorch's CUDA-graph
notes, as TorchTitan's trainer applies it): the first ``WARMUP_CALLS`` micro-batches run eagerly
on a side stream (lazy initialisation: cuBLAS workspaces, NCCL communicators, FSDP2's buffers,
the routing kernels' per-shape tables); the next call captures forward and backward into a graph
over static input buffers, with one memory pool for the run; every later call copies its batch
and loss scale into those buffers and replays. The step around it (clipping, the optimizer, the
EMA) stays eager; the training step reads nothing back from the device inside forward and
backward (``tests/test_capture_safe.py``), which capture needs. Gradients must keep their storage,
so the trainer zeroes them in place (``zero_grad(set_to_none=False)``) when graphs are on.

Status: **this path has not run on a GPU yet.** The GPU suite's row ``trainer_cuda_graphs``
(bench/gpu_suite.sh) compares 20 steps of the 1b model with and without it, losses bitwise; until
that row has run, the option stays off by default and should be treated as experimental.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from mhar_titan.config import ConfigError

WARMUP_CALLS = 1
"""Micro-batches run eagerly on a side stream before the capture (PyTorch's notes use a few; one
suffices once the optimizer state exists, since capture comes only after the first step)."""


def capture_blockers(cfg, args) -> list[str]:
    """Settings of ``cfg`` (a ``JobConfig``; ``args``: its resolved ``ModelArgs``) under which a
    captured forward and backward would be wrong or cannot be captured, each as a sentence naming
    the key; empty when there are none."""
    blockers = []
    if cfg.compile.enable:
        blockers.append("compile.enable = true (compiled graphs guard and recompile on the host at every call; "
                        "capture only eager blocks: set compile.enable = false)")
    if args.routing_kernel == "compile":
        blockers.append("model.routing_kernel = \"compile\" (use \"eager\")")
    if args.residual == "attn_res" and args.routing_kernel in ("triton", "auto"):
        blockers.append(f"model.routing_kernel = {args.routing_kernel!r} (the fused kernels' pointer tables are "
                        "written from host buffers during forward and backward, which a replayed graph would read "
                        "stale; capture the eager routing path: model.routing_kernel = \"eager\")")
    if args.attn_mask_type != "causal":
        blockers.append(f"model.attn_mask_type = {args.attn_mask_type!r} (its block mask is built from each "
                        "batch's document ends outside the graph's buffers; use \"causal\")")
    if cfg.debug.force_nonfinite_loss_steps:
        blockers.append("debug.force_nonfinite_loss_steps (a poisoned step runs another forward than the graph "
                        "holds; leave it empty)")
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


class GraphedMicroStep:
    """Forward and backward of one micro-batch, captured once and replayed (module docstring).

    ``step(x, y, scale)`` does what the eager trainer does per micro-batch: ``loss_sum =
    model(x, y, loss_fn=loss_fn)`` then ``(loss_sum * scale).backward()``, and returns
    ``loss_sum`` detached (a 0-dim tensor, the graph's static output: read or copy it before the
    next call). x, y: (B, T) int64 on the device, the same shape at every call (the loader's
    windows are fixed); scale: 0-dim fp32 on the device.

    Raises:
        ValueError: a batch of another shape than the captured one.
    """

    def __init__(self, model: torch.nn.Module, loss_fn: Callable):
        self.model, self.loss_fn = model, loss_fn
        self.calls = 0
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.pool = None
        self.static: dict[str, torch.Tensor] = {}

    def _eager(self, x, y, scale) -> torch.Tensor:
        loss_sum = self.model(x, y, loss_fn=self.loss_fn)
        (loss_sum * scale).backward()
        return loss_sum.detach()

    def step(self, x: torch.Tensor, y: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls <= WARMUP_CALLS:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                loss = self._eager(x, y, scale)
            torch.cuda.current_stream().wait_stream(side)
            return loss
        if self.graph is None:
            self.static = {"x": x.clone(), "y": y.clone(), "scale": scale.clone()}
            self.pool = torch.cuda.graph_pool_handle()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=self.pool):
                self.static["loss"] = self._eager(self.static["x"], self.static["y"], self.static["scale"])
        elif x.shape != self.static["x"].shape or y.shape != self.static["y"].shape:
            raise ValueError(f"a captured micro-batch step takes batches of {tuple(self.static['x'].shape)}, got "
                             f"{tuple(x.shape)}: CUDA graphs need the same shapes at every step")
        else:
            self.static["x"].copy_(x, non_blocking=True)
            self.static["y"].copy_(y, non_blocking=True)
            self.static["scale"].copy_(scale, non_blocking=True)
        self.graph.replay()
        return self.static["loss"]
