"""Weight EMA: an exponential moving average of the parameters, used for evaluation and export.

After every optimizer step ``update`` sets, for each parameter p and its average e,

    e <- decay * e + (1 - decay) * p

so after k steps from e_0 = p_0:  e_k = decay^k p_0 + (1 - decay) sum_{j=1..k} decay^(k-j) p_j
(MHAR_SPEC 3.4: the 8B mid-training evaluates the EMA with decay 0.999). The averages are fp32
tensors shaped and sharded like the parameters (FSDP2 DTensors stay DTensors), keyed by the
plain model's parameter names, and are part of checkpoints (``state_dict``: DCP shards them
like the model). ``swapped(model)`` puts the averages into the model for evaluation or export
and restores the trained weights afterwards.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

_WRAPPERS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def plain_name(name: str) -> str:
    """A parameter name without the torch.compile / activation-checkpoint / FSDP wrapper parts."""
    for part in _WRAPPERS:
        name = name.replace(part, "")
    return name


class WeightEMA:
    """EMA of ``model``'s parameters with ``decay`` in [0, 1); starts at the current weights.

    Raises:
        ValueError: decay outside [0, 1).
    """

    def __init__(self, model: nn.Module, decay: float):
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"EMA decay must be in [0, 1) (0.999 averages over ~1000 steps), got {decay}")
        self.decay = decay
        self._params = dict(self._named(model))
        self.averages = {name: p.detach().float().clone() for name, p in self._params.items()}
        self.loaded = False
        """True once ``load_state_dict`` restored averages (a resume); False: they start from the weights."""

    @staticmethod
    def _named(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
        for name, p in model.named_parameters():
            yield plain_name(name), p

    @torch.no_grad()
    def reset(self) -> None:
        """Restart the averages at the current weights (after loading pretrained weights)."""
        for name, p in self._params.items():
            self.averages[name].copy_(p.detach())

    @torch.no_grad()
    def update(self, keep: torch.Tensor | None = None) -> None:
        """One EMA step from the current weights (call after every optimizer step).

        ``keep``: a 0-dim bool tensor on the parameters' device; where it is False the averages stay
        exactly as they are (a skipped step), decided on the device without a host read:
        e <- e + w (p - e) with w = (1 - decay) * keep."""
        averages = list(self.averages.values())
        params = [p.detach().float() for p in self._params.values()]
        if keep is None:
            torch._foreach_mul_(averages, self.decay)
            torch._foreach_add_(averages, params, alpha=1.0 - self.decay)
            return
        weight = keep.to(torch.float32) * (1.0 - self.decay)
        torch._foreach_add_(averages, torch._foreach_mul(torch._foreach_sub(params, averages), weight))

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The averages by plain parameter name (the tensors themselves: DCP loads into them in place)."""
        return dict(self.averages)

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Copy saved averages in (a no-op for DCP's in-place load) and mark them loaded.

        Raises:
            KeyError: a parameter without a saved average, or a saved one without a parameter.
        """
        if set(state) != set(self.averages):
            missing, extra = sorted(set(self.averages) - set(state)), sorted(set(state) - set(self.averages))
            raise KeyError(f"EMA state does not match the model: missing {missing[:5]}, unexpected {extra[:5]}")
        for name, value in state.items():
            if value is not self.averages[name]:
                self.averages[name].copy_(value)
        self.loaded = True

    @contextmanager
    def swapped(self):
        """Inside the block the model holds the averages (cast to each parameter's dtype); the
        trained weights are restored on exit, also after an error."""
        backup = {name: p.detach().clone() for name, p in self._params.items()}
        try:
            with torch.no_grad():
                for name, p in self._params.items():
                    p.copy_(self.averages[name])
            yield
        finally:
            with torch.no_grad():
                for name, p in self._params.items():
                    p.copy_(backup[name])
