"""The depth-connection interface: how a decoder's sublayers are connected across depth.

`ModelArgs.residual` names a connection (the table in connections/__init__.py). A connection owns
what is carried between sublayers (a stream, the source list of depth routing, a depth history of
block outputs, n streams), how each sublayer's input is read from it, how each sublayer's output is
written into it, and the read-out before the final norm. It comes in three lifetimes:

- the **connection** (`Connection`, one per model, plain data): built from `ModelArgs` once; it makes
  the model's connection parameters (`parameters()`, registered as `Transformer.routing`: None
  where it has none) and the norm each block applies to its attention sublayer's input
  (`attention_norm`, a plain RMSNorm except where the connection feeds attention several streams).
- the **flow** (`Flow`, one per forward): `Connection.flow(params, x0, ...)` starts it from the token
  embedding x0 (B, T, d); `block(i)` gives block i its two arguments, what is carried into it and
  its `Link`; `done(i, out)` takes the block's result back; `final()` is the read-out (B, T, d)
  before the final norm.
- the **link** (`Link`, one per block and forward): what a block calls. The block's forward is

      state = link.enter(carried)
      state = link.write(0, state, attention(attention_norm(link.read(0, state))))
      state = link.write(1, state, feed_forward(ffn_norm(link.read(1, state))))
      return link.leave(state)

  with one read and one write per sublayer (0 attention, 1 MLP) whatever the connection. `enter`
  makes the block call's own state from what the flow carried in (activation checkpointing re-runs
  the block with the same arguments, so nothing of a block call may outlive it but its result),
  `read` gives a sublayer's input ((B, T, d), or a tuple of (B, T, d) streams for attention where
  `attention_norm` takes them), `write` folds a sublayer's output (B, T, d) into the state, `leave`
  gives what the block returns.

Everything a link holds that the backward needs is a tensor argument of the block call or reachable
from one (the wrappers around a block, activation checkpointing, FSDP2 and torch.compile, see them
as block inputs); parameters a link reads are views of `Transformer.routing`'s, taken once per
forward by the flow (under FSDP2 the root's parameters are unsharded for the whole forward).
"""
from __future__ import annotations

from typing import Any, Callable, Protocol

import torch
from torch import Tensor, nn

from ..args import ModelArgs
from ..norms import RMSNorm


class Link(Protocol):
    """A block's view of the connection in one forward (module docstring)."""

    def enter(self, carried: Any) -> Any: ...

    def read(self, sublayer: int, state: Any) -> Tensor | tuple[Tensor, ...]: ...

    def write(self, sublayer: int, state: Any, output: Tensor) -> Any: ...

    def leave(self, state: Any) -> Any: ...


class Flow(Protocol):
    """The connection in one forward (module docstring)."""

    def block(self, layer: int) -> tuple[Any, Link]: ...

    def done(self, layer: int, returned: Any) -> None: ...

    def final(self) -> Tensor: ...


MixObserver = Callable[[str, Tensor], None]
"""observer(name, weights) of a connection other than depth routing (`Transformer.observe_routing`):
every forward hands it each mixing weight the connection computes, detached, in forward order, named
by where it applies (e.g. "block 3", "site 5 comb"): DenseFormer's per-block weights (n,), MUDDFormer's
per-token dynamic weights (B, T, C, n), and so on (each connection's docstring says which). Depth
routing's observer has its own signature (`router.Observer`)."""


@torch.no_grad()
def init_from(param: Tensor, full: Tensor) -> None:
    """Set `param` to the values `full` (its whole shape), for a plain parameter or one FSDP2 has
    sharded (a DTensor: `full` is distributed with its placements, a collective every rank makes,
    as `Transformer.init_weights` runs on every rank). Index assignment on a sharded parameter is
    not this: it writes nothing (a split's element) or has no sharding rule (a column)."""
    if hasattr(param, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        full = distribute_tensor(full.to(param.to_local().device), param.device_mesh, param.placements)
    param.copy_(full.to(param.dtype))


def checkpointed_blocks(ac: str, n_layers: int) -> tuple[bool, ...]:
    """Per block, whether activation checkpointing `ac` ("none", "full", "selective:k") recomputes
    it: none, every block, or blocks k, 2k, ... (1-based, `parallel.apply_ac`'s counter).

    Raises:
        ValueError: another spelling, or k not a positive integer."""
    if ac in ("none", "full"):
        return (ac == "full",) * n_layers
    every = ac.removeprefix("selective:")
    if not ac.startswith("selective:") or not every.isdigit() or int(every) < 1:
        raise ValueError(f"activation checkpointing must be 'none', 'full' or 'selective:k' (k >= 1), got {ac!r}")
    return tuple((i + 1) % int(every) == 0 for i in range(n_layers))


class Connection:
    """One model's depth connection (module docstring). Subclasses set `name` (the
    `ModelArgs.residual` value) and implement `flow`; those with parameters override `parameters`.

    Args:
        args: the model's `ModelArgs`.
    """

    name = ""

    def __init__(self, args: ModelArgs):
        self.args = args

    def parameters(self) -> nn.Module | None:
        """A new module holding the connection's parameters (uninitialised until its
        `reset_parameters`), registered as `Transformer.routing`; None where there are none."""
        return None

    def attention_norm(self, layer: int) -> nn.Module:
        """The norm block `layer` applies to its attention sublayer's input (`Link.read(0)`'s value)."""
        return RMSNorm(self.args.dim, self.args.norm_eps)

    # -- the cost model (torch-free arithmetic; the dry run, the metrics and the bytes model read it) --
    def flops_per_token(self) -> int:
        """Forward FLOPs per token the connection adds to the baseline's (multiply-adds count 2);
        the backward is twice that (the metrics' 3x rule)."""
        return 0

    def depth_reads(self) -> tuple[int, int]:
        """(forward, backward) (B, T, d) rows of activations the connection reads per token in one
        training step beyond the baseline's (its bytes: rows x d x the element size): the bytes model
        of docs/DESIGN.md, counted per connection."""
        return 0, 0

    def kept_rows(self, ac: str) -> int:
        """(B, T, d) rows per token the connection keeps alive for the backward beyond the baseline's
        under activation checkpointing `ac` ("none", "full", or "selective:k": blocks k, 2k, ...
        checkpointed, as `parallel.apply_ac`; `checkpointed_blocks` reads it): its depth history,
        its streams and what its blocks save, with, under checkpointing, the one block recomputed at
        a time; elements that are not whole rows (per-token weights, norms' statistics) are
        rounded up to rows (the dry run's memory estimate)."""
        return 0

    def state_rows(self, ac: str) -> int:
        """(B, T, d) rows per token of the carried n-stream state H (B, T, n, d) that the backward
        keeps under `ac` (as `kept_rows`), the rows the baseline keeps of its one stream included:
        what decides a multi-stream connection's micro-batch (the dry run states its share of the
        activation estimate). 0 for a connection that carries one stream."""
        return 0

    def flow(self, params: nn.Module | None, x0: Tensor, observer=None, buffered: bool = True) -> Flow:
        """The flow of one forward from the token embedding `x0` (B, T, d), with the connection's
        parameters `params` (`Transformer.routing`). observer: the analysis observer
        (`Transformer.observe_routing`), for connections that route; buffered: the blocks are not
        torch.compile'd, so a connection may keep its sources in one depth buffer per forward."""
        raise NotImplementedError
