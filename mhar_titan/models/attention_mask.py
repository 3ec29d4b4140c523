"""Document masking of packed windows (``model.attn_mask_type = "block_causal"``) and the attention call.

The loader packs documents into fixed windows with one EOS after every document
(``data/stream.py``). Under "block_causal" a token attends only to earlier tokens of its own
document. **An EOS closes the document it ends** (TorchTitan's convention): the EOS token belongs
to the document before it, so the label at an EOS position (the next document's first token) is
scored in the context of the document that EOS ends, and the next document starts right after
the EOS. A window's first tokens (the tail of a document cut by the window) form a document of
their own. With ``model.rope_per_document`` the RoPE positions restart at 0 at every document's
first token. Depth routing mixes the sources of each token separately (MHAR_SPEC 2), so it needs
no change under document masking.

The mask is built once per batch, in the model's forward (``Transformer.attention_context``), and
shared by every layer through ``AttentionContext.mask``:
- on CUDA a FlexAttention ``BlockMask`` (``flex_block_mask``), run by a compiled
  ``flex_attention`` (compiled whatever ``[compile]`` says: eager FlexAttention is a slow reference);
- elsewhere (FlexAttention has no CPU backward in torch 2.13) a dense boolean mask
  (B, 1, T, T) for ``scaled_dot_product_attention`` (``dense_mask``), exact and differentiable.

Everything here is built from the token tensor by device ops whose shapes depend on (B, T) only:
no value is read back to the host and no table is made on it (``create_block_mask`` included: an
arange, the mask function vmapped over indices, block sums and a stable argsort). So under
``training.cuda_graphs`` the captured forward rebuilds the document ids, the mask (and the ids the
BlockMask's mask function closes over) and the per-document positions from the static token
buffer at every replay, with nothing copied in by hand (``components/cuda_graphs.py``;
``tests/test_cuda_graphs.py`` checks it on the meta device and by replaying a trace).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

def document_ids(tokens: Tensor, eos_id: int) -> Tensor:
    """(B, T) int64: the index of each token's document in its window, counted from 0; an EOS
    closes its document (it carries the id of the tokens before it)."""
    is_eos = (tokens == eos_id).long()
    return torch.cumsum(is_eos, dim=1) - is_eos


def document_positions(ids: Tensor) -> Tensor:
    """(B, T) int64 position of each token inside its document (0 at each document's first token),
    from ``document_ids`` (B, T)."""
    T = ids.shape[1]
    index = torch.arange(T, device=ids.device).expand_as(ids)
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    return index - torch.where(starts, index, 0).cummax(dim=1).values


def dense_mask(ids: Tensor) -> Tensor:
    """(B, 1, T, T) bool, True where query t may attend key s: s <= t within the same document."""
    T = ids.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=ids.device).tril()
    return (ids.unsqueeze(2) == ids.unsqueeze(1)).logical_and(causal).unsqueeze(1)


def flex_block_mask(ids: Tensor):
    """FlexAttention ``BlockMask`` of the same mask as ``dense_mask`` for document ids (B, T),
    shared by all heads (its block sparsity skips the blocks between documents)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, q, k):
        return (k <= q) & (ids[b, q] == ids[b, k])

    B, T = ids.shape
    return create_block_mask(mask_mod, B, None, T, T, device=ids.device)


@functools.cache
def _compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention
    return torch.compile(flex_attention, dynamic=False)


def attend(q: Tensor, k: Tensor, v: Tensor, mask=None, *, compiled_flex: bool = True) -> Tensor:
    """Scaled dot-product attention of q (B, H, T, hd) over k, v (B, H_kv, T, hd) (GQA when
    H_kv < H) -> (B, H, T, hd). ``mask``: None (causal, ``is_causal=True``: the path of "causal"),
    a (B, 1, T, T) bool tensor (``dense_mask``) or a FlexAttention ``BlockMask`` (``flex_block_mask``,
    through the compiled ``flex_attention`` unless ``compiled_flex=False``, the eager reference)."""
    gqa = k.shape[1] != q.shape[1]
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    if isinstance(mask, Tensor):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    from torch.nn.attention.flex_attention import flex_attention
    fn = _compiled_flex_attention() if compiled_flex else flex_attention
    return fn(q, k, v, block_mask=mask, enable_gqa=gqa)
