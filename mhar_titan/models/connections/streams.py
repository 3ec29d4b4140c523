"""The n-stream residual that Hyper-Connections (hyper.py) and mHC (mhc.py) carry: what they share.

Both widen the residual stream to n streams. The carried state is H (B, T, n, d), n copies of the
token embedding x0 at entry. At each sublayer site (s = 2 i + sublayer in block i, 2L sites) a
mapping computed from H gives three mixing weights,

    pre  (n,)      the read:        u = sum_i pre_i H_i                        (B, T, d)
    res  (n, n)    the residual mix: R_c = sum_i res[i, c] H_i                  (B, T, n, d)
    post (n,)      the write:       H'_c = R_c + post_c f(u)

(per token, (B, T, n) and (B, T, n, n), or the same for every token), with f the sublayer and its
own pre-RMSNorm. Hyper-Connections' pre, res, post are alpha[:, 0], alpha[:, 1:] and beta; mHC's
are its pre, comb and post. The two differ only in how the mapping is computed (`Site`) and in the
read-out before the final norm.

`StreamLink` is every block's link: `enter` computes the attention site's mapping from the H
carried in, `read` gives u, `write` makes H' and, after attention, the MLP site's mapping from H',
`leave` returns H'. The block returns H' alone, so activation checkpointing keeps, per block, its
input H (n rows of d per token: n times the baseline's stream) and recomputes the rest; H travels
into each block as the block call's tensor argument (FSDP2 hooks its post-backward on a block's
tensor inputs). A site's parameters are views of `Transformer.routing`'s, taken once per forward by
the flow and held by the `Site` objects of the link.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Protocol

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, distribute_tensor


class Mapping(NamedTuple):
    """One site's mixing weights (module docstring), in the state's dtype: pre (n,) or (B, T, n),
    res (n, n) or (B, T, n, n) (res[i, c]: stream i's weight in the new stream c), post (n,) or
    (B, T, n)."""

    pre: Tensor
    res: Tensor
    post: Tensor


class Site(Protocol):
    """A sublayer site's mapping in one forward: site(H (B, T, n, d)) -> its `Mapping`."""

    def __call__(self, streams: Tensor) -> Mapping: ...


@torch.no_grad()
def copy_full(parameter: Tensor, values: Tensor) -> None:
    """parameter <- values (the parameter's whole shape), for a plain parameter or an FSDP2-sharded
    one (a DTensor: this rank's slice of `values` is taken locally, without communication)."""
    values = values.to(device=parameter.device, dtype=parameter.dtype)
    if isinstance(parameter, DTensor):
        values = distribute_tensor(values, parameter.device_mesh, parameter.placements, src_data_rank=None)
    parameter.copy_(values)


def expand(x0: Tensor, n: int) -> Tensor:
    """The entry state: n copies of the embedding x0 (B, T, d) -> H (B, T, n, d), contiguous."""
    return x0.unsqueeze(-2).expand(*x0.shape[:-1], n, x0.shape[-1]).contiguous()


def read(pre: Tensor, streams: Tensor) -> Tensor:
    """u = sum_i pre_i H_i: pre (n,) or (B, T, n), H (B, T, n, d) -> (B, T, d). One batched
    product per token (weights the same for every token are expanded, not copied: a product of an
    (n,) vector with H itself would copy H transposed)."""
    weights = pre.unsqueeze(-2).expand(*streams.shape[:-2], 1, streams.shape[-2])
    return (weights @ streams).squeeze(-2)


def mix(res: Tensor, streams: Tensor) -> Tensor:
    """R_c = sum_i res[i, c] H_i: res (n, n) or (B, T, n, n), H (B, T, n, d) -> (B, T, n, d)."""
    n = streams.shape[-2]
    return res.transpose(-1, -2).expand(*streams.shape[:-2], n, n) @ streams


def write(mixed: Tensor, post: Tensor, output: Tensor) -> Tensor:
    """H'_c = R_c + post_c f: R (B, T, n, d), post (n,) or (B, T, n), f (B, T, d) -> (B, T, n, d),
    in one pass over R (no (B, T, n, d) product made first)."""
    return torch.addcmul(mixed, post.unsqueeze(-1), output.unsqueeze(-2))


def state_rows(ac: str, n_layers: int, n: int, exit_rows: int) -> int:
    """Rows of d per token of the state H that the backward keeps under activation checkpointing
    `ac` (`Connection.state_rows`): under "full" every block's input H (n rows; the block returns
    H' alone), L n; otherwise (and "selective", an upper bound as `kept_rows`) each sublayer site's
    H (n rows, saved by the read and the mixing), 2 L n; plus the read-out's `exit_rows`."""
    return (n_layers if ac == "full" else 2 * n_layers) * n + exit_rows


class StreamLink:
    """Block i's link (module docstring): `sites` are its attention and MLP sites' `Site`s. The
    state inside the block is (H, the mapping of the next site) until the MLP's write, then H."""

    __slots__ = ("sites",)

    def __init__(self, sites: tuple[Site, Site]):
        self.sites = sites

    def enter(self, streams: Tensor) -> tuple[Tensor, Mapping]:
        return streams, self.sites[0](streams)

    def read(self, sublayer: int, state: tuple[Tensor, Mapping]) -> Tensor:
        streams, mapping = state
        return read(mapping.pre, streams)

    def write(self, sublayer: int, state: tuple[Tensor, Mapping], output: Tensor):
        streams, mapping = state
        streams = write(mix(mapping.res, streams), mapping.post, output)
        return (streams, self.sites[1](streams)) if sublayer == 0 else streams

    def leave(self, streams: Tensor) -> Tensor:
        return streams


class StreamFlow:
    """One forward of an n-stream connection: the state H carried from block to block, each block's
    link (`links[i]`) and the read-out `exit` (H (B, T, n, d) -> (B, T, d))."""

    def __init__(self, streams: Tensor, links: list[StreamLink], exit: Callable[[Tensor], Tensor]):
        self.streams, self.links, self.exit = streams, links, exit

    def block(self, layer: int) -> tuple[Tensor, StreamLink]:
        return self.streams, self.links[layer]

    def done(self, layer: int, streams: Tensor) -> None:
        self.streams = streams

    def final(self) -> Tensor:
        return self.exit(self.streams)
