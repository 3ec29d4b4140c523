"""Muon for FSDP2-sharded matrices (``ShardedMuon``), the hybrid ``MuonWithAdamW`` the trainer steps,
the Newton-Schulz iteration, and the modelled bytes of Muon's all-gathers.
"""
from __future__ import annotations

import math

import torch
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz


def newton_schulz(update: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float,
                  dtype: torch.dtype) -> torch.Tensor:
    """Approximate orthogonalisation ``U V^T`` of a matrix ``update = U S V^T`` (its zeroth power).

    The quintic Newton-Schulz iteration of Muon (Keller Jordan, "Muon: an optimizer for hidden
    layers in neural networks", 2024; torch.optim.Muon): with ``X_0 = G / max(||G||_F, eps)``
    (``G`` transposed to be wide: rows <= cols), ``steps`` times

        A = X X^T,   X <- a X + (b A + c A A) X,

    which maps every singular value of ``X_0`` into about [0.5, 1.5] (the default coefficients
    trade exact convergence for a steep slope at zero); transposed back at the end.

    Args:
        update: (rows, cols) matrix, any float dtype.
        coefficients: (a, b, c).
        steps: iterations, 1 to 99.
        eps: floor of the Frobenius norm.
        dtype: the arithmetic: ``torch.bfloat16`` runs torch's own iteration
            (``torch.optim._muon._zeropower_via_newtonschulz``, bitwise torch.optim.Muon's); any other
            dtype runs the same iteration in that dtype.

    Returns:
        (rows, cols) matrix in ``dtype``.
    """
    if dtype == torch.bfloat16:
        return _zeropower_via_newtonschulz(update, coefficients, steps, eps)
    a, b, c = coefficients
    x = update.to(dtype)
    wide = x.size(0) <= x.size(1)
    x = x if wide else x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x if wide else x.T


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole matrix of a sharded DTensor (an all-gather over its mesh); a plain tensor as is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _like(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``full`` laid out like ``param``: this rank's slice of it when ``param`` is a DTensor (no
    communication: every rank holds ``full``), else ``full``."""
    if not hasattr(param, "device_mesh"):
        return full
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)


class ShardedMuon(torch.optim.Muon):
    """``torch.optim.Muon`` for FSDP2-sharded (DTensor ``Shard(0)``) as well as plain matrices.

    Per matrix ``W`` (rows, cols) with gradient ``g``, step size ``lr`` and weight decay ``wd``
    (torch.optim.Muon's algorithm; Jordan 2024; Liu et al., "Muon is scalable for LLM training",
    arXiv:2502.16982, section 2):

        B <- mu B + (1 - mu) g                        momentum (B = ``momentum_buffer``)
        U = (1 - mu) g + mu B   (Nesterov)  or  B
        O = NS(U)                                      ``newton_schulz``, in ``ns_dtype``
        W <- (1 - lr wd) W - lr s(rows, cols) O        decoupled weight decay, then the step

    with ``s = 0.2 sqrt(max(rows, cols))`` (``adjust_lr_fn = "match_rms_adamw"``: the update's
    RMS matches AdamW's, so AdamW's LR and weight decay carry over; Liu et al. section 2.2) or
    ``sqrt(max(1, rows / cols))`` (``"original"``, Jordan's).

    Under FSDP2 each rank holds a row slice of ``W``, ``g`` and ``B``; Newton-Schulz needs the
    whole ``U``. Every rank gathers the whole ``U`` of every matrix (one all-gather per matrix,
    in ``ns_dtype``: torch's bfloat16 iteration starts by rounding to bfloat16, so gathering
    bfloat16 loses nothing), runs the iteration on it and keeps its own slice of ``O``: the
    orthogonalisation is computed redundantly on every rank of a shard group rather than
    assigned round-robin to one rank and scattered back. Chosen because it needs no second
    collective, no owner bookkeeping and no padding for rows that do not divide evenly (DTensor
    gathers and slices any ``Shard(0)`` layout, also the ``(Replicate, Shard)`` of HSDP), and
    every rank holds the same ``O``, so the shards cannot drift apart. The price: each rank runs
    the Newton-Schulz work of the whole model (about ``6 steps (rows cols min(rows, cols) +
    min(rows, cols)^3)`` FLOPs per matrix: small beside a training step at these shapes) and
    receives ``(W - 1) / W`` of every matrix per step (``muon_comm_bytes``), where round-robin
    would receive about ``2 / W`` of it. Momentum, weight decay and the step stay on the shards.

    Args:
        params, lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps,
        adjust_lr_fn: as ``torch.optim.Muon``.
        ns_dtype: "bfloat16" (torch.optim.Muon's arithmetic) or "float32".

    Raises:
        ValueError: a parameter that is not 2-D (torch.optim.Muon's check), or a bad setting.
    """

    def __init__(self, params, *, ns_dtype: str = "bfloat16", **kwargs):
        if ns_dtype not in ("bfloat16", "float32"):
            raise ValueError(f"ns_dtype must be 'bfloat16' or 'float32', got {ns_dtype!r}")
        super().__init__(params, **kwargs)
        self.defaults["ns_dtype"] = ns_dtype
        for group in self.param_groups:
            group.setdefault("ns_dtype", ns_dtype)

    @torch.no_grad()
    def step(self, closure=None):
        """One Muon step on every matrix with a gradient (see the class docstring); call it on
        every rank of the mesh (it all-gathers)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, buffers = [], [], []
            self._init_group(group, params, grads, buffers)
            lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
            dtype = getattr(torch, group["ns_dtype"])
            for p, g, buf in zip(params, grads, buffers):
                buf.lerp_(g, 1 - mu)
                update = g.lerp(buf, mu) if group["nesterov"] else buf
                ortho = newton_schulz(_full(update.to(dtype)), group["ns_coefficients"], group["ns_steps"],
                                      group["eps"], dtype)
                p.mul_(1 - lr * wd)
                p.add_(_like(ortho, p), alpha=-_adjust_lr(lr, group["adjust_lr_fn"], p.shape))
        return loss


class MuonWithAdamW(torch.optim.Optimizer):
    """One optimizer over two: ``ShardedMuon`` for the hidden matrices, ``torch.optim.AdamW`` for
    the rest (the hybrid Muon is run as: Jordan 2024; Liu et al. 2025, section 2.3).

    Its ``param_groups`` are Muon's groups then AdamW's (the same dicts: an LR schedule sets
    both), and one ``state`` dict holds both optimizers' per-parameter state (Muon's
    ``momentum_buffer``; AdamW's ``step``, ``exp_avg``, ``exp_avg_sq``), so ``state_dict`` /
    ``load_state_dict`` and DCP's ``get_state_dict`` see one ordinary optimizer, keyed by
    parameter name and sharded like the model. ``step`` runs Muon, then AdamW.
    """

    def __init__(self, muon: ShardedMuon, adamw: torch.optim.AdamW):
        self.muon, self.adamw = muon, adamw
        super().__init__(muon.param_groups + adamw.param_groups, defaults={})
        self._share()

    def _share(self) -> None:
        k = len(self.muon.param_groups)
        self.muon.param_groups, self.adamw.param_groups = self.param_groups[:k], self.param_groups[k:]
        self.muon.state = self.adamw.state = self.state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.muon.step()
        self.adamw.step()
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._share()  # loading replaced the group dicts and the state dict


def _element_bytes(dtype: str) -> int:
    return {"bfloat16": 2, "float32": 4}[dtype]


def resolved_ns_dtype(cfg, device_type: str) -> str:
    """``optimizer.muon_ns_dtype`` with "auto" resolved for ``device_type`` (bfloat16 on CUDA)."""
    if cfg.muon_ns_dtype != "auto":
        return cfg.muon_ns_dtype
    return "bfloat16" if device_type == "cuda" else "float32"


def muon_comm_bytes(shapes: list[tuple[int, ...]], shard_world: int, ns_dtype: str) -> int:
    """Bytes each rank receives per optimizer step for Muon's all-gathers (modelled): every
    matrix's update in ``ns_dtype``, less the rank's own slice, ``numel (W - 1) / W`` elements
    for ``W = shard_world`` FSDP ranks (a ring all-gather sends as many). 0 on one rank."""
    numel = sum(math.prod(s) for s in shapes)
    return numel * (shard_world - 1) * _element_bytes(ns_dtype) // shard_world
