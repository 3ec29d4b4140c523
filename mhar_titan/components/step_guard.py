"""The optimizer step of a training step, skipped when the step is not finite, and the step's one host read.

A step whose loss or gradient norm is not finite is skipped: no optimizer update and no weight-EMA
update (the trainer counts it, ``TrainState.count_step``). Where the optimizer can skip on the
device, the decision never reaches the host: fused AdamW (``optimizer.implementation = "fused"``)
reads a ``found_inf`` flag on the device and leaves parameters, moments and step counts as they
were when it is set (the mechanism of torch's ``GradScaler``), and the EMA update is weighted by the
same flag. Then forward, backward, clipping and the optimizer step run without waiting for the
device, and the trainer reads the step's loss, gradient norm and flag once, after the step
(``read_step``). Other optimizers (foreach or for-loop AdamW) must know on the host whether to step,
so the flag is read once before their step instead: still one read per step, but the host then
waits for the step's backward before it can queue the optimizer.
"""
from __future__ import annotations

from typing import Optional

import torch


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` honours a device-side ``found_inf`` flag (torch's fused Adam / AdamW)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False)) and all(
        group.get("fused", False) for group in optimizer.param_groups)


def guarded_step(optimizer: torch.optim.Optimizer, ema, finite: torch.Tensor) -> Optional[bool]:
    """The optimizer step and EMA update of a step, both skipped when ``finite`` is False.

    Args:
        optimizer: the step's optimizer (gradients already clipped).
        ema: the ``WeightEMA`` or None.
        finite: 0-dim bool tensor on the gradients' device: the loss and gradient norm are finite.

    Returns:
        None when the skip was decided on the device (``skips_on_device``); otherwise the flag's
        host value, which this call had to read before stepping.
    """
    if skips_on_device(optimizer):
        optimizer.found_inf = (~finite).to(torch.float32)
        optimizer.grad_scale = None
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf, optimizer.grad_scale
        if ema is not None:
            ema.update(keep=finite)
        return None
    stepped = bool(finite)
    if stepped:
        optimizer.step()
        if ema is not None:
            ema.update()
    return stepped


def read_step(loss: torch.Tensor, grad_norm: torch.Tensor, finite: torch.Tensor,
              group_norms: Optional[dict[str, torch.Tensor]] = None) -> tuple[float, float, bool, dict[str, float]]:
    """The step's values on the host, in one device-to-host copy: (loss, gradient norm, finite,
    {group: norm}); the group norms only when given (the steps that log them)."""
    names = list(group_norms or {})
    values = torch.stack([loss.float(), grad_norm.float(), finite.float(),
                          *(group_norms[n].float() for n in names)]).tolist()
    return values[0], values[1], values[2] > 0, dict(zip(names, values[3:]))
