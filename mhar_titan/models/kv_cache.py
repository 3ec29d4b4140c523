"""Key/value cache for autoregressive decoding (every family, granularity, routing mode and layout).

Only attention needs a cache: a depth-routing site mixes the sources of its own position (the
depth softmax runs over one token's sublayer outputs, MHAR_SPEC section 2), so a new token's
routing reads nothing of earlier tokens. The cache travels to the attention layers as the
`cache` field of `model.AttentionContext`; `Transformer.forward(tokens, cache=cache)` appends
the T new tokens of every row and returns their logits.

Rows of different lengths are left-padded: slot s of row b holds a real token when
s >= pad[b]; that token's RoPE position is s - pad[b], so each row sees exactly the positions
it would see alone. Padding slots are never attended to by real tokens.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor


class KVCache:
    """Per-layer keys and values (B, n_kv_heads, capacity, head_dim) of a batch being decoded.

    Args:
        n_layers: the model's layer count (one slot per `Attention.layer_id`).
        pad: left-padding slots of each row, (B,) ints (zeros for equal-length prompts).
        capacity: slots per row (the padded prompt length plus the tokens to generate).
        max_seq_len: the model's largest position + 1 (RoPE tables are that long).

    Raises:
        ValueError: capacity < 1, a negative pad or one that leaves a row no slot.
    """

    def __init__(self, n_layers: int, pad: Sequence[int] | Tensor, capacity: int, max_seq_len: int,
                 device: torch.device | str | None = None):
        self.pad = torch.as_tensor(pad, dtype=torch.long, device=device).reshape(-1)
        if capacity < 1 or bool((self.pad < 0).any()) or bool((self.pad >= capacity).any()):
            raise ValueError(f"a KV cache needs capacity >= 1 and 0 <= pad < capacity, got capacity={capacity}, "
                             f"pad={self.pad.tolist()}")
        self.capacity, self.max_seq_len = capacity, max_seq_len
        self.keys: list[Tensor | None] = [None] * n_layers
        self.values: list[Tensor | None] = [None] * n_layers
        self.length = 0  # slots filled (the new tokens' slots included once `extend` ran)
        self.start = 0  # first slot of the tokens of the forward in progress
        self._mask: Tensor | None = None
        # document bookkeeping (block_causal): each slot's document index, the next token's
        # document, its first slot, and whether the last stored token was an EOS
        self._document: Tensor | None = None
        self._next_document: Tensor | None = None
        self._document_start: Tensor | None = None
        self._last_was_eos: Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self.pad.numel()

    def row_lengths(self) -> Tensor:
        """Real (non-padding) tokens held per row, (B,)."""
        return (self.length - self.pad).clamp(min=0)

    def extend(self, tokens: Tensor, eos_id: int | None = None, restart: bool = False) -> Tensor:
        """Reserve the slots of the T new tokens (B, T) per row; their RoPE positions (B, T) int64.

        Called once per forward (by `Transformer.attention_context`) before the layers run; every
        layer's `update` then writes the same slots. Also builds the attention mask of these T
        queries: (B, 1, T, length) bool, True where a query may attend (a real key at or before
        its slot, and its own slot, so that padding queries stay finite). With `eos_id`
        (attn_mask_type "block_causal") a query also attends only to keys of its own document: an
        EOS ends the document it belongs to, the token after it starts the next; with `restart`
        (rope_per_document) positions count from each document's first token.

        Raises:
            ValueError: the slots exceed the capacity, or a real position reaches max_seq_len.
        """
        T = tokens.shape[1]
        if self.length + T > self.capacity:
            raise ValueError(f"the KV cache holds {self.capacity} slots per row; {self.length} used, {T} more asked")
        device = self.pad.device
        slots = torch.arange(self.length, self.length + T, device=device)
        real_query = slots[None, :] >= self.pad[:, None]  # (B, T)
        if self._document is None:
            self._document = torch.zeros(self.batch_size, self.capacity, dtype=torch.long, device=device)
            self._next_document = torch.zeros(self.batch_size, dtype=torch.long, device=device)
            self._document_start = self.pad.clone()
        documents = self._next_document[:, None].expand(-1, T)
        starts = self._document_start[:, None].expand(-1, T)
        if eos_id is not None:
            ends = (tokens.to(device) == eos_id) & real_query  # (B, T): an EOS closes its document
            before = torch.cumsum(ends.long(), dim=1) - ends.long()  # EOS seen before each token
            documents = documents + before
            opened = torch.zeros_like(ends)
            opened[:, 1:] = ends[:, :-1]  # the token after an EOS opens a document
            if T and self._last_was_eos is not None:
                opened[:, 0] = self._last_was_eos
            new_start = torch.where(opened, slots[None, :].expand_as(opened), torch.full_like(starts, -1))
            starts = torch.maximum(starts, torch.cummax(new_start, dim=1).values)
            self._next_document = documents[:, -1] + ends[:, -1].long()
            self._last_was_eos = ends[:, -1]
            self._document_start = starts[:, -1].clone()
        self._document[:, self.length:self.length + T] = documents
        origin = starts if restart else self.pad[:, None]
        positions = (slots[None, :] - origin).clamp(min=0)  # (B, T); padding slots at 0
        if int(positions.max()) >= self.max_seq_len:
            raise ValueError(f"position {int(positions.max())} exceeds max_seq_len={self.max_seq_len}; "
                             "re-run the last max_seq_len tokens without the cache (generation does this)")
        self.start, self.length = self.length, self.length + T
        keys = torch.arange(self.length, device=device)
        real = keys[None, :] >= self.pad[:, None]  # (B, length)
        causal = keys[None, :] <= slots[:, None]  # (T, length)
        own = keys[None, :] == slots[:, None]
        same_document = self._document[:, None, :self.length] == documents[:, :, None]  # (B, T, length)
        self._mask = ((real[:, None, :] & causal[None] & same_document) | own[None]).unsqueeze(1)  # (B, 1, T, length)
        return positions

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Store layer `layer`'s new keys/values k, v (B, n_kv_heads, T, head_dim) in the slots
        `extend` reserved; returns all keys and values so far (B, n_kv_heads, length, head_dim)
        and the attention mask (B, 1, T, length)."""
        if self.keys[layer] is None:
            B, heads, _, hd = k.shape
            self.keys[layer] = k.new_zeros(B, heads, self.capacity, hd)
            self.values[layer] = v.new_zeros(B, heads, self.capacity, hd)
        self.keys[layer][:, :, self.start:self.length] = k
        self.values[layer][:, :, self.start:self.length] = v
        return self.keys[layer][:, :, :self.length], self.values[layer][:, :, :self.length], self._mask
