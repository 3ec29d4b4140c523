"""Text generation from a decoder: greedy (temperature 0), temperature and top-k sampling.

The model has no KV cache: every new token re-runs the forward over the last
``max_seq_len`` tokens (fine for samples and evaluation prompts, not for serving).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor


def next_token_logits(model: torch.nn.Module, tokens: Tensor, n_vocab: Optional[int] = None) -> Tensor:
    """Logits (B, V) for the token after ``tokens`` (B, T), in float32.

    The input is cut to the model's last ``max_seq_len`` tokens. With ``n_vocab``, the padded
    embedding rows ``[n_vocab, V)`` (ids the tokenizer never produces) get -inf.
    """
    window = tokens[:, -model.args.max_seq_len:]
    logits = model(window)[:, -1].float()
    if n_vocab is not None and n_vocab < logits.shape[-1]:
        logits[:, n_vocab:] = float("-inf")
    return logits


def choose_token(logits: Tensor, temperature: float = 0.0, top_k: Optional[int] = None,
                 generator: Optional[torch.Generator] = None) -> Tensor:
    """The next token ids (B,) from logits (B, V).

    temperature 0: argmax (ties go to the lowest id). Otherwise sample from
    softmax(logits / temperature), restricted to the ``top_k`` largest logits when given.

    Raises:
        ValueError: temperature < 0 or top_k < 1.
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1 (or None for no cut), got {top_k}")
    if temperature == 0:
        return logits.argmax(-1)
    scaled = logits / temperature
    if top_k is not None and top_k < scaled.shape[-1]:
        kth = scaled.topk(top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(model: torch.nn.Module, prompt: Tensor | Sequence[int], max_new_tokens: int, *,
             temperature: float = 0.0, top_k: Optional[int] = None, n_vocab: Optional[int] = None,
             stop_ids: Sequence[int] = (), seed: Optional[int] = None) -> Tensor:
    """Continue ``prompt`` by up to ``max_new_tokens`` tokens; returns only the new tokens.

    Args:
        model: a ``Transformer`` (eval mode is the caller's business).
        prompt: token ids (T,) or a batch (B, T); at least one token per row.
        max_new_tokens: how many tokens to add (>= 0).
        temperature, top_k: see ``choose_token``; temperature 0 is deterministic.
        n_vocab: the tokenizer's vocabulary size (padded ids are never produced).
        stop_ids: ids that end a (single-row) generation; the stop id is kept.
        seed: seed of the sampling generator (None: torch's global RNG).

    Returns:
        (max_new_tokens',) for a 1-D prompt, else (B, max_new_tokens'), int64 on the model's device.

    Raises:
        ValueError: an empty prompt, max_new_tokens < 0, or bad temperature / top_k.
    """
    device = next(model.parameters()).device
    tokens = torch.as_tensor(prompt, dtype=torch.long, device=device)
    single = tokens.dim() == 1
    tokens = tokens.unsqueeze(0) if single else tokens
    if tokens.numel() == 0:
        raise ValueError("generation needs a prompt of at least one token (e.g. the tokenizer's eos id)")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    generator = None
    if seed is not None:
        generator = torch.Generator(device=device).manual_seed(seed)
    start = tokens.shape[1]
    for _ in range(max_new_tokens):
        nxt = choose_token(next_token_logits(model, tokens, n_vocab), temperature, top_k, generator)
        tokens = torch.cat([tokens, nxt.unsqueeze(-1)], dim=1)
        if single and int(nxt[0]) in stop_ids:
            break
    new = tokens[:, start:]
    return new[0] if single else new
