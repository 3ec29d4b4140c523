"""Depth connections: how a decoder's sublayers are connected across depth (`ModelArgs.residual`).

base.py states the interface (a connection per model, a flow per forward, a link per block); each
module below is one connection. `CONNECTIONS` maps every value of `ModelArgs.residual`
(`args.RESIDUALS`) to its class, imported on first use so that reading the table imports no torch.

| residual     | connection                                   | module          |
|--------------|----------------------------------------------|-----------------|
| "standard"   | pre-norm residual stream (the baseline)      | standard.py     |
| "attn_res"   | depth routing: AttnRes, MHAR, every mode     | attn_res.py     |
| "dense"      | DenseFormer's depth-weighted averages        | dense.py        |
| "mudd"       | MUDDFormer's multiway dynamic dense streams  | mudd.py         |
"""
from __future__ import annotations

import importlib

CONNECTIONS: dict[str, str] = {
    "standard": "standard:StandardResidual",
    "attn_res": "attn_res:AttnRes",
    "dense": "dense:DenseFormer",
    "mudd": "mudd:MUDDFormer",
}
"""`ModelArgs.residual` -> "module:class" of its connection (a module of this package)."""


def connection_class(residual: str) -> type:
    """The connection class of `residual` (a value of `ModelArgs.residual`).

    Raises:
        ValueError: no connection is registered under that name (naming the registered ones).
    """
    if residual not in CONNECTIONS:
        raise ValueError(f"no depth connection named {residual!r}; choose one of {tuple(CONNECTIONS)}")
    module, name = CONNECTIONS[residual].split(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def build_connection(args):
    """The `base.Connection` of `args` (a `ModelArgs`), by `args.residual`."""
    return connection_class(args.residual)(args)
