"""The decoder: Qwen3/Llama-style pre-norm transformer with a pluggable depth connection.

`ModelArgs.residual` picks how the sublayers are connected across depth (connections/): the
standard residual (h <- h + f(norm(h))), depth routing (AttnRes / MHAR, every mode of MHAR_SPEC
sections 1 and 2), DenseFormer and MUDDFormer. A block reads each sublayer's input from its
connection's link and writes the sublayer's output back (connections/base.py), so the block below
reads the same for every connection; the connection's parameters are the top-level
`Transformer.routing` module (None for the standard residual), never inside a block.
"""
from __future__ import annotations

import contextlib
import math
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .args import ModelArgs
from .attention_mask import attend, dense_mask, document_ids, document_positions, flex_block_mask
from .connections import build_connection
from .connections.base import Link
from .cross_entropy import plain_linear_cross_entropy
from .norms import RMSNorm
from .plan import RoutingPlan
from .router import Observer

if TYPE_CHECKING:
    from .kv_cache import KVCache


def rope_frequencies(args: ModelArgs, device=None) -> Tensor:
    """RoPE inverse frequencies (head_dim/2,), with Llama 3.1 "llama3" scaling when configured:
    wavelengths above original_max/low_freq_factor are divided by `factor`, those below
    original_max/high_freq_factor kept, and the band between interpolated smoothly."""
    hd = args.head_dim
    inv_freq = 1.0 / args.rope_theta ** (torch.arange(0, hd, 2, device=device, dtype=torch.float64) / hd)
    if args.rope_scaling == "llama3":
        factor, low, high = args.rope_scaling_factor, args.rope_low_freq_factor, args.rope_high_freq_factor
        old_len = args.rope_original_max_seq_len
        wavelen = 2 * math.pi / inv_freq
        smooth = ((old_len / wavelen - low) / (high - low)).clamp(0.0, 1.0)
        # smooth = 0 for long wavelengths (scaled by 1/factor), 1 for short ones (unchanged).
        inv_freq = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return inv_freq.float()


def rope_cos_sin(args: ModelArgs, device=None) -> tuple[Tensor, Tensor]:
    """cos, sin tables (max_seq_len, head_dim) in the rotate-half layout (HF Llama/Qwen3)."""
    inv_freq = rope_frequencies(args, device)
    positions = torch.arange(args.max_seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE on x (B, heads, T, head_dim) with cos/sin (T, head_dim), or (B, 1, T, head_dim)
    for per-row or per-token positions."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class AttentionContext(NamedTuple):
    """Everything a block's attention needs besides its input, built once per forward and passed
    to every block as one argument (so a feature of attention adds a field here, not a block
    parameter; activation checkpointing keeps it as a block input).

    cos, sin: RoPE tables (T, head_dim) for the batch's T positions (`rope_cos_sin`), or
      (B, 1, T, head_dim) for per-token positions: restarting at each document
      (`rope_per_document`), or each row's own positions when decoding with a cache (left padding).
    mask: None for "causal" (SDPA's is_causal); under "block_causal" the batch's document mask,
      a (B, 1, T, T) bool tensor or a FlexAttention BlockMask on CUDA (attention_mask.py).
    cache: decoding only, the `kv_cache.KVCache` the attention layers append their keys and
      values to and read the earlier ones and the mask (padding, causal, documents) from; None in training.
    """

    cos: Tensor
    sin: Tensor
    mask: object = None
    cache: "KVCache | None" = None


class Attention(nn.Module):
    """GQA causal (or document-masked) self-attention; optional per-head q/k RMSNorm."""

    def __init__(self, args: ModelArgs, layer_id: int = 0):
        super().__init__()
        self.layer_id = layer_id  # its slot in a decoding `KVCache`
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        self.q_norm = RMSNorm(self.head_dim, args.norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, args.norm_eps) if args.qk_norm else None

    def forward(self, x: Tensor | tuple[Tensor, Tensor, Tensor], context: AttentionContext) -> Tensor:
        """x (B, T, d) -> (B, T, d), or the three streams (x_q, x_k, x_v) that queries, keys and
        values are projected from (MUDDFormer's). `context` holds the RoPE tables of the T positions,
        the mask and, when decoding, the cache: the T new keys/values are appended to it and the
        queries attend to every cached position the cache's mask allows (earlier tokens of the
        row's document, no padding)."""
        xq, xk, xv = x if isinstance(x, tuple) else (x, x, x)
        B, T, _ = xq.shape
        q = self.wq(xq).view(B, T, self.n_heads, self.head_dim)
        k = self.wk(xk).view(B, T, self.n_kv_heads, self.head_dim)
        v = self.wv(xv).view(B, T, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, heads, T, head_dim)
        q, k = apply_rope(q, context.cos, context.sin), apply_rope(k, context.cos, context.sin)
        if context.cache is None:
            y = attend(q, k, v, context.mask)
        else:
            k, v, mask = context.cache.update(self.layer_id, k, v)
            y = attend(q, k, v, mask)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    """SwiGLU MLP: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        """x (B, T, d) -> (B, T, d)."""
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """One decoder layer: an attention sublayer, then an MLP sublayer, each reading its input from
    the depth connection and writing its output back (connections/base.py); self-contained for AC,
    compile and FSDP.

    forward(carried, attention_context, link) -> what the connection's flow takes back
      carried: what the connection carries into the block (the stream h (B, T, d) for the
      standard residual; connections/). attention_context: `AttentionContext` (RoPE tables, mask,
      cache). link: the block's `connections.base.Link` in this forward.
    `attention_norm` is the connection's (`Connection.attention_norm`): an RMSNorm, or one per
    stream where the connection feeds attention its queries, keys and values separately.
    """

    def __init__(self, layer_id: int, args: ModelArgs, attention_norm: nn.Module | None = None):
        super().__init__()
        self.layer_id = layer_id
        self.attention = Attention(args, layer_id)
        self.feed_forward = FeedForward(args.dim, args.ffn_dim)
        self.attention_norm = attention_norm if attention_norm is not None else RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, carried, attention_context: AttentionContext, link: Link):
        state = link.enter(carried)
        state = link.write(0, state, self.attention(self.attention_norm(link.read(0, state)), attention_context))
        state = link.write(1, state, self.feed_forward(self.ffn_norm(link.read(1, state))))
        return link.leave(state)


class Transformer(nn.Module):
    """Decoder LM: tokens (B, T) int64 -> logits (B, T, vocab_size), or with labels the summed loss.
    Under attn_mask_type "block_causal" attention stays inside each document of the packed window
    (attention_mask.py).

    forward / hidden_states raise ValueError for an empty batch, T > max_seq_len, or token ids
    outside [0, vocab_size) (a tokenizer / vocab_size mismatch). The id range check reads the
    batch's min and max back from the device (a synchronisation); a caller that checks its ids
    on the host before the copy (the trainer: ``components.batches.check_token_ids``) sets
    ``check_token_ids = False``."""

    check_token_ids: bool = True
    """Whether forward reads the token ids' range back from the device (see the class docstring)."""
    compiled_blocks: bool = False
    """Set where each block is torch.compile'd (`parallel.compile_blocks`): the fused routing then
    runs as custom ops over lists of sources inside the compiled blocks, not over a depth buffer."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.connection = build_connection(args)  # plain data: the depth connection (connections/)
        self.plan = getattr(self.connection, "plan", None) or RoutingPlan.from_args(args)  # empty but for attn_res
        self.routing_observer: Observer | None = None  # set by `observe_routing`
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(i, args, self.connection.attention_norm(i))
                                    for i in range(args.n_layers))
        self.routing = self.connection.parameters()  # the connection's parameters; None for the standard residual
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = None if args.tie_embeddings else nn.Linear(args.dim, args.vocab_size, bias=False)
        cos, sin = rope_cos_sin(args, device=self.tok_embeddings.weight.device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self._rope_device = cos.device  # where the tables were last computed (`_ready_rope`)

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """(Re)initialise every parameter and the RoPE buffers; works after `to_empty()`.

        Linear and embedding weights ~ N(0, 0.02^2); norm weights 1; the connection's parameters
        (`routing`) by its own `reset_parameters` (depth routing: `DepthRouting.reset_parameters`).
        RoPE tables are recomputed on `buffer_device` (default: where they are now).
        """
        device = buffer_device if buffer_device is not None else self.rope_cos.device
        self.rope_cos, self.rope_sin = rope_cos_sin(self.args, device=device)
        self._rope_device = self.rope_cos.device
        for name, module in self.named_modules():
            if name == "routing" or name.startswith("routing."):
                continue
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            elif isinstance(module, RMSNorm):
                module.reset_parameters()
        if self.routing is not None:
            self.routing.reset_parameters()

    @contextlib.contextmanager
    def observe_routing(self, observer: Observer):
        """Within the block, every forward calls `observer(site index, sources, router)` for each
        routing site in order (the attention and MLP sites of every layer, then the final one):
        the entries that site routes over (as `router.routed_sources`) while the forward runs, and
        the `router.Router`, whose `weights(site, sources)` gives the reference's depth-softmax
        weights (analysis; under FSDP the root's parameters are unsharded then). Depth routing
        (attn_res) only: the other connections have no routing sites."""
        previous, self.routing_observer = self.routing_observer, observer
        try:
            yield
        finally:
            self.routing_observer = previous

    def hidden_states(self, tokens: Tensor, cache: "KVCache | None" = None) -> Tensor:
        """Run the embedding, the layers and the connection's read-out (not the final norm):
        (B, T) -> (B, T, d).

        With `cache` (decoding, `kv_cache.KVCache`), `tokens` continue the sequences it holds:
        attention reads the cached keys/values; the depth connections need no cache, since each
        token's connection reads only its own depth history. Raises ValueError (from the cache) past
        its capacity or max_seq_len.
        """
        self._check_tokens(tokens)
        context = self.attention_context(tokens, cache)
        flow = self.connection.flow(self.routing, self.tok_embeddings(tokens), self.routing_observer,
                                    buffered=not self.compiled_blocks)
        for i, layer in enumerate(self.layers):
            carried, link = flow.block(i)
            flow.done(i, layer(carried, context, link))
            del carried, link  # hold nothing of a finished block: the flow drops the entries it released
        return flow.final()

    def _check_tokens(self, tokens: Tensor) -> None:
        """ValueError for tokens that are not a non-empty (B, T) integer batch of ids in
        [0, vocab_size), or longer than max_seq_len. The id range check reads one min/max pair
        back from the device (skipped on the meta device, while torch.compile traces, and with
        ``check_token_ids = False``)."""
        if tokens.dim() != 2 or tokens.dtype.is_floating_point or tokens.dtype.is_complex:
            raise ValueError(f"tokens must be a (B, T) integer tensor, got {tuple(tokens.shape)} {tokens.dtype}")
        B, T = tokens.shape
        if B == 0 or T == 0:
            raise ValueError(f"tokens must hold at least one token per sequence, got shape {(B, T)}")
        if T > self.args.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds max_seq_len={self.args.max_seq_len}; raise max_seq_len")
        if not self.check_token_ids or torch.compiler.is_compiling() or tokens.device.type == "meta":
            return
        low, high = (int(v) for v in torch.aminmax(tokens))
        if low < 0 or high >= self.args.vocab_size:
            raise ValueError(
                f"token ids span [{low}, {high}] but vocab_size={self.args.vocab_size}: the tokenizer does not match "
                "the model; set the model's vocab_size to the tokenizer's vocabulary padded up to a multiple of 128"
            )

    def _ready_rope(self, device: torch.device) -> None:
        """Compute the RoPE tables on `device` (the tokens') unless they were computed there: they
        are buffers that are not saved, so a model built on the meta device and then given storage
        (`to_empty`, or a loader such as transformers' `from_pretrained`, which may also leave them
        on the meta device) holds uninitialised tables until `init_weights` recomputes them; this
        makes every forward (training, `generate`, `generate_batch`) read real tables whichever way
        the model was built. A host-side check only (no device read): capture-safe and a plain
        guard under torch.compile."""
        if self.rope_cos.device != device or self._rope_device != device:
            with torch.no_grad():
                self.rope_cos, self.rope_sin = rope_cos_sin(self.args, device=device)
            self._rope_device = device

    def attention_context(self, tokens: Tensor, cache: "KVCache | None" = None) -> AttentionContext:
        """The `AttentionContext` of a (B, T) batch, built once per forward and shared by every layer:
        the RoPE tables of positions 0..T-1 under "causal"; under "block_causal" also the document
        mask from the EOS positions (a FlexAttention BlockMask on CUDA, a dense bool mask elsewhere)
        and, with `rope_per_document`, per-token tables of the positions inside each document.
        With `cache` (decoding), the cache reserves the tokens' slots and gives each row's
        positions and the attention mask (documents included under "block_causal")."""
        self._ready_rope(tokens.device)
        T, block = tokens.shape[1], self.args.attn_mask_type == "block_causal"
        if block and self.args.eos_id is None:
            raise ValueError("attn_mask_type='block_causal' needs ModelArgs.eos_id (the tokenizer's EOS id)")
        if cache is not None:
            positions = cache.extend(tokens, self.args.eos_id if block else None,
                                     restart=block and self.args.rope_per_document).unsqueeze(1)  # (B, 1, T)
            return AttentionContext(self.rope_cos[positions], self.rope_sin[positions], cache=cache)
        if not block:
            return AttentionContext(self.rope_cos[:T], self.rope_sin[:T])
        ids = document_ids(tokens, self.args.eos_id)
        mask = flex_block_mask(ids) if tokens.device.type == "cuda" else dense_mask(ids)
        if not self.args.rope_per_document:
            return AttentionContext(self.rope_cos[:T], self.rope_sin[:T], mask)
        positions = document_positions(ids)
        return AttentionContext(self.rope_cos[positions].unsqueeze(1), self.rope_sin[positions].unsqueeze(1), mask)

    def forward(self, tokens: Tensor, labels: Tensor | None = None, *, loss_fn=None,
                cache: "KVCache | None" = None) -> Tensor:
        """Logits (B, T, vocab_size) of tokens (B, T); `cache` (decoding) as in `hidden_states`;
        with `labels` (B, T) the summed loss instead,
        `loss_fn(h (B, T, d), head_weight (vocab_size, d), labels)` (default: the plain
        cross-entropy, `cross_entropy.plain_linear_cross_entropy`), so the LM head runs inside this
        forward and a chunked loss never makes the full logits."""
        h = self.norm(self.hidden_states(tokens, cache=cache))
        if labels is not None:
            weight = self.tok_embeddings.weight if self.output is None else self.output.weight
            return (loss_fn or plain_linear_cross_entropy)(h, weight, labels)
        if self.output is None:
            return F.linear(h, self.tok_embeddings.weight)
        return self.output(h)
