"""RMSNorm, the one norm of the decoder and of the depth connections that normalise what they read."""
from __future__ import annotations

import torch
from torch import Tensor, nn


class RMSNorm(nn.Module):
    """RMSNorm rounded like Hugging Face Llama/Qwen3: normalise in fp32 (fp64 stays fp64), cast back,
    times weight.
    x (..., dim) -> (..., dim); `weight` (dim,) starts at `init` (1; MUDDFormer's post-norm 1e-3)."""

    def __init__(self, dim: int, eps: float, init: float = 1.0):
        super().__init__()
        self.eps, self.init = eps, init
        self.weight = nn.Parameter(torch.empty(dim))

    def reset_parameters(self) -> None:
        nn.init.constant_(self.weight, self.init) if self.init != 1.0 else nn.init.ones_(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        return self.weight * rms_normalized(x, self.eps)


def rms_normalized(x: Tensor, eps: float) -> Tensor:
    """x / sqrt(mean(x^2) + eps) over the last dimension, computed in fp32 (fp64 in fp64) and cast back
    to x's dtype (RMSNorm without a scale)."""
    x32 = x if x.dtype == torch.float64 else x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
