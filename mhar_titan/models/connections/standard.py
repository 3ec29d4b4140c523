"""The standard residual (pre-norm): h <- h + f(norm(h)) for every sublayer f; the read-out is h."""
from __future__ import annotations

from torch import Tensor

from .base import Connection


class StandardLink:
    """Every block's link: the stream h (B, T, d) is carried, read as it is, and each output added."""

    def enter(self, h: Tensor) -> Tensor:
        return h

    def read(self, sublayer: int, h: Tensor) -> Tensor:
        return h

    def write(self, sublayer: int, h: Tensor, output: Tensor) -> Tensor:
        return h + output

    def leave(self, h: Tensor) -> Tensor:
        return h


LINK = StandardLink()


class StandardFlow:
    """One forward of the standard residual: the stream from block to block."""

    def __init__(self, x0: Tensor):
        self.h = x0

    def block(self, layer: int) -> tuple[Tensor, StandardLink]:
        return self.h, LINK

    def done(self, layer: int, h: Tensor) -> None:
        self.h = h

    def final(self) -> Tensor:
        return self.h


class StandardResidual(Connection):
    """`residual = "standard"`: the pre-norm baseline (no connection parameters)."""

    name = "standard"

    def flow(self, params, x0: Tensor, observer=None, buffered: bool = True) -> StandardFlow:
        return StandardFlow(x0)
