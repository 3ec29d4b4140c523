"""Text generation from a decoder with a KV cache: greedy (temperature 0), temperature, top-k and
top-p sampling, stop ids (EOS) and stop strings, batched prompts of different lengths.

`Decoding` keeps each row's next-token logits up to date as tokens are appended: the prompts
run once (left-padded to one length), then every step runs only the new token of each row
through the model with a `models.kv_cache.KVCache`. Without the cache (``use_cache=False``,
the reference the tests compare against) every step re-runs each row's last ``max_seq_len``
tokens. Once a row outgrows ``max_seq_len``, the cached path does the same (its positions
would run past the RoPE tables), so both paths compute the same logits at every step.
"""
from __future__ import annotations

import math

from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from mhar_titan.models.kv_cache import KVCache

PAD_ID = 0
"""Token id written into left-padding slots (never attended to by real tokens)."""


def next_token_logits(model: torch.nn.Module, tokens: Tensor, n_vocab: Optional[int] = None) -> Tensor:
    """Logits (B, V) for the token after ``tokens`` (B, T), in float32, without a cache.

    The input is cut to the model's last ``max_seq_len`` tokens. With ``n_vocab``, the padded
    embedding rows ``[n_vocab, V)`` (ids the tokenizer never produces) get -inf.
    """
    window = tokens[:, -model.args.max_seq_len:]
    return _mask_vocab(model(window)[:, -1].float(), n_vocab)


def _mask_vocab(logits: Tensor, n_vocab: Optional[int]) -> Tensor:
    if n_vocab is not None and n_vocab < logits.shape[-1]:
        logits[:, n_vocab:] = float("-inf")
    return logits


def check_sampling(temperature: float, top_k: Optional[int], top_p: Optional[float]) -> None:
    """ValueError for a temperature that is negative or not finite, top_k < 1 or top_p outside
    (0, 1] (None: no cut)."""
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1 (or None for no cut), got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] (or None for no cut), got {top_p}")


def choose_token(logits: Tensor, temperature: float = 0.0, top_k: Optional[int] = None,
                 generator: Optional[torch.Generator] = None, top_p: Optional[float] = None) -> Tensor:
    """The next token ids (B,) from logits (B, V).

    temperature 0: argmax (ties go to the lowest id). Otherwise sample from
    softmax(logits / temperature), restricted to the ``top_k`` largest logits when given, and
    then to the smallest set of most likely tokens whose probability reaches ``top_p``
    (nucleus sampling; the most likely token is always kept).

    Raises:
        ValueError: temperature < 0, top_k < 1 or top_p outside (0, 1].
    """
    check_sampling(temperature, top_k, top_p)
    if temperature == 0:
        return logits.argmax(-1)
    scaled = logits / temperature
    if top_k is not None and top_k < scaled.shape[-1]:
        kth = scaled.topk(top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        ordered, order = scaled.sort(dim=-1, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        beyond = probs.cumsum(-1) - probs >= top_p  # the mass before this token already reaches top_p
        scaled = scaled.scatter(-1, order, ordered.masked_fill(beyond, float("-inf")))
    probs = torch.softmax(scaled, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def left_padded_forward(model: torch.nn.Module, rows: Sequence[Sequence[int]], extra_slots: int = 0
                        ) -> tuple[Tensor, KVCache]:
    """Run rows of different lengths as one left-padded batch, each exactly as if it ran alone.

    Row b is padded with ``PAD_ID`` on the left to the longest row's length T; its real tokens
    get RoPE positions 0, 1, ... and attend only to each other (the ``KVCache`` keeps each row's
    padding count). Returns the logits (B, T, V) in the model's dtype (row b's real tokens are the
    last ``len(rows[b])`` columns; padding columns hold finite values of no meaning) and the cache,
    which holds ``extra_slots`` more slots per row for tokens appended later.

    Raises:
        ValueError: an empty row, or a row longer than the model's ``max_seq_len``.
    """
    if not rows or any(len(r) == 0 for r in rows):
        raise ValueError("every row needs at least one real (unpadded) token")
    longest = max(len(r) for r in rows)
    if longest > model.args.max_seq_len:
        raise ValueError(f"a row of {longest} tokens exceeds the model's max_seq_len={model.args.max_seq_len}")
    device = next(model.parameters()).device
    pad = [longest - len(r) for r in rows]
    tokens = torch.tensor([[PAD_ID] * p + [int(t) for t in r] for p, r in zip(pad, rows)], device=device)
    cache = KVCache(model.args.n_layers, pad, longest + extra_slots, model.args.max_seq_len, device)
    return model(tokens, cache=cache), cache


class Decoding:
    """The next-token logits of a batch of token sequences, kept current as tokens are appended.

    Args:
        model: a ``Transformer`` (eval mode is the caller's business).
        prompts: one list of token ids per row (lengths may differ), each at least one token.
        n_vocab: the tokenizer's vocabulary size (padded ids get -inf logits).
        use_cache: decode with a ``KVCache`` (True) or re-run every row's window (False).
        capacity: tokens that will be appended per row (sizes the cache; more only re-prefill).

    Attributes:
        rows: the token ids of every row so far (prompt and appended tokens).
        logits: (B, V) float32 logits of each row's next token.

    Raises:
        ValueError: no rows, or an empty row.
    """

    def __init__(self, model: torch.nn.Module, prompts: Sequence[Sequence[int]], n_vocab: Optional[int] = None,
                 use_cache: bool = True, capacity: int = 64):
        self.rows = [[int(t) for t in p] for p in prompts]
        if not self.rows or any(not r for r in self.rows):
            raise ValueError("generation needs a prompt of at least one token per row (e.g. the tokenizer's eos id)")
        self.model, self.n_vocab, self.use_cache, self.capacity = model, n_vocab, use_cache, max(capacity, 1)
        self.device = next(model.parameters()).device
        self.max_len = model.args.max_seq_len
        self.cache: KVCache | None = None
        self.logits = self._prefill() if use_cache else self._recompute()

    def _windows(self) -> list[list[int]]:
        return [r[-self.max_len:] for r in self.rows]

    def _prefill(self) -> Tensor:
        """Run every row's window left-padded into a fresh cache; the last column's logits."""
        logits, self.cache = left_padded_forward(self.model, self._windows(), self.capacity)
        return _mask_vocab(logits[:, -1].float(), self.n_vocab)

    def _recompute(self) -> Tensor:
        """Without a cache: each row's window through the model (equal lengths in one batch)."""
        windows = self._windows()
        if len({len(w) for w in windows}) == 1:
            return next_token_logits(self.model, torch.tensor(windows, device=self.device), self.n_vocab)
        return torch.cat([next_token_logits(self.model, torch.tensor([w], device=self.device), self.n_vocab)
                          for w in windows])

    @torch.no_grad()
    def append(self, tokens: Tensor | Sequence[int]) -> Tensor:
        """Append one token per row (B,); returns (and stores) the new next-token logits (B, V)."""
        tokens = torch.as_tensor(tokens, dtype=torch.long, device=self.device).reshape(-1)
        for row, t in zip(self.rows, tokens.tolist()):
            row.append(t)
        if not self.use_cache:
            self.logits = self._recompute()
        elif self.cache.length < self.cache.capacity and max(len(r) for r in self.rows) <= self.max_len:
            self.logits = _mask_vocab(self.model(tokens[:, None], cache=self.cache)[:, -1].float(), self.n_vocab)
        else:  # out of slots, or a row outgrew max_seq_len: re-run the windows
            self.logits = self._prefill()
        return self.logits


@torch.no_grad()
def generate_batch(model: torch.nn.Module, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                   temperature: float = 0.0, top_k: Optional[int] = None, top_p: Optional[float] = None,
                   n_vocab: Optional[int] = None, stop_ids: Sequence[int] = (), stop_strings: Sequence[str] = (),
                   decode: Optional[Callable[[list[int]], str]] = None, seed: Optional[int] = None,
                   use_cache: bool = True) -> list[list[int]]:
    """Continue each prompt by up to ``max_new_tokens`` tokens; returns only the new tokens per row.

    A row stops after producing a token of ``stop_ids`` (kept), or once ``decode`` of its new
    tokens contains one of ``stop_strings`` (the tokens are kept; cut the text yourself); the
    others go on. Sampling draws all rows from one generator seeded with ``seed`` (None: torch's
    global RNG), so a row's sample depends on the batch it is in; greedy rows do not.

    Raises:
        ValueError: an empty prompt, max_new_tokens < 0, bad temperature / top_k / top_p, or
            stop_strings without decode.
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if stop_strings and decode is None:
        raise ValueError("stop_strings needs decode (token ids -> text) to find them")
    check_sampling(temperature, top_k, top_p)  # before the model runs
    state = Decoding(model, prompts, n_vocab, use_cache, capacity=max_new_tokens)
    generator = None if seed is None else torch.Generator(device=state.device).manual_seed(seed)
    new: list[list[int]] = [[] for _ in state.rows]
    done = [False] * len(new)
    stops = set(int(s) for s in stop_ids)
    for step in range(max_new_tokens):
        nxt = choose_token(state.logits, temperature, top_k, generator, top_p)
        for i, t in enumerate(nxt.tolist()):
            if done[i]:
                continue
            new[i].append(t)
            done[i] = t in stops or bool(stop_strings) and any(s in decode(new[i]) for s in stop_strings)
        if all(done) or step == max_new_tokens - 1:
            break
        state.append(nxt)
    return new


@torch.no_grad()
def generate(model: torch.nn.Module, prompt: Tensor | Sequence[int], max_new_tokens: int, *,
             temperature: float = 0.0, top_k: Optional[int] = None, top_p: Optional[float] = None,
             n_vocab: Optional[int] = None, stop_ids: Sequence[int] = (), seed: Optional[int] = None,
             use_cache: bool = True) -> Tensor:
    """Continue ``prompt`` by up to ``max_new_tokens`` tokens; returns only the new tokens.

    Args:
        model: a ``Transformer`` (eval mode is the caller's business).
        prompt: token ids (T,) or an equal-length batch (B, T); at least one token per row
            (``generate_batch`` takes rows of different lengths).
        max_new_tokens: how many tokens to add (>= 0).
        temperature, top_k, top_p: see ``choose_token``; temperature 0 is deterministic.
        n_vocab: the tokenizer's vocabulary size (padded ids are never produced).
        stop_ids: ids that end a (single-row) generation; the stop id is kept.
        seed: seed of the sampling generator (None: torch's global RNG).
        use_cache: decode with the KV cache (False re-runs the prefix at every step).

    Returns:
        (max_new_tokens',) for a 1-D prompt, else (B, max_new_tokens), int64 on the model's device.

    Raises:
        ValueError: an empty prompt, max_new_tokens < 0, or bad temperature / top_k / top_p.
    """
    device = next(model.parameters()).device
    tokens = torch.as_tensor(prompt, dtype=torch.long, device=device)
    single = tokens.dim() == 1
    tokens = tokens.unsqueeze(0) if single else tokens
    if tokens.numel() == 0:
        raise ValueError("generation needs a prompt of at least one token (e.g. the tokenizer's eos id)")
    new = generate_batch(model, tokens.tolist(), max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                         n_vocab=n_vocab, stop_ids=stop_ids if single else (), seed=seed, use_cache=use_cache)
    out = torch.tensor(new, dtype=torch.long, device=device).reshape(len(new), -1)
    return out[0] if single else out
