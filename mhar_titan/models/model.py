"""The decoder: Qwen3/Llama-style pre-norm transformer with a pluggable residual path.

Residual paths (MHAR_SPEC sections 1, 2; names in args.py):
- standard: h = h + f(norm(h)) for every sublayer f (attention, then MLP).
- attn_res, replace, sublayer granularity (AttnRes H=1 / MHAR H>1): every sublayer input is
  route(sources) over [embedding, a_0, m_0, ..., earlier outputs]; the final routing over all
  2L+1 sources feeds the final norm and the LM head.
- attn_res, replace, block granularity (Kimi Block AttnRes, MHAR_SPEC 1.2): sources are the
  completed block sums plus the running partial sum. The embedding is block b_0; layer i
  (0-indexed) starts a new block when i % routing_block_layers == 0, so layer 0 starts block
  b_1, whose attention site routes over [b_0] alone.
- attn_res, delta (MHAR_SPEC 1.4): the standard residual stream h is kept and every sublayer
  input is h + alpha * route(sources). Sources: [null?, embedding, a_0, m_0, ...] at sublayer
  granularity; [null?, embedding, D_1, ..., D_k] at block granularity, D_j the sum of the
  sublayer outputs of completed block j (the final routing also sees the last block).

Blocks hold no routing parameters: `Transformer.routing` holds all of them and the model
passes each block its two sites' slices as tensor arguments.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .args import ModelArgs
from .routing import route


class RMSNorm(nn.Module):
    """RMSNorm rounded like Hugging Face Llama/Qwen3: normalise in fp32, cast back, times weight."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


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
    """Rotate-half RoPE on x (B, heads, T, head_dim) with cos/sin (T, head_dim)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class Attention(nn.Module):
    """GQA causal self-attention through scaled_dot_product_attention; optional per-head q/k RMSNorm."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        self.q_norm = RMSNorm(self.head_dim, args.norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, args.norm_eps) if args.qk_norm else None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, heads, T, head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv_heads != self.n_heads)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    """SwiGLU MLP: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """One decoder layer (attention sublayer, then MLP sublayer); self-contained for AC/compile/FSDP.

    forward(h, cos, sin, sources=None, query=None, key_norm=None, alpha=None) -> list of tensors:
      standard:               h (B, T, d)                              -> [h_out]
      replace, sublayer:      sources (list, attention site)           -> [a, m]
      replace, block:         sources = blocks + [partial]             -> [partial + a, partial + a + m]
                              (at a block start, partial is closed: -> [a, a + m])
      delta:                  h and sources                            -> [h_out, a, m]
    query, key_norm: (2, d) rows of this layer's two sites (attention, MLP); alpha: (2, 1), delta only.
    """

    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.layer_id = layer_id
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, args.ffn_dim)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.residual, self.mode, self.granularity = args.residual, args.routing_mode, args.routing_granularity
        self.starts_block = layer_id % args.routing_block_layers == 0
        self.heads, self.eps, self.kernel = args.resolved_routing_heads, args.routing_eps, args.routing_kernel

    def _route(self, sources, query, key_norm, site: int, partial=None, alpha=None) -> Tensor:
        return route(
            sources, query[site], key_norm[site], self.heads, self.eps, self.kernel,
            partial=partial, alpha=None if alpha is None else alpha[site],
        )

    def forward(self, h, cos, sin, sources=None, query=None, key_norm=None, alpha=None) -> list[Tensor]:
        if self.residual == "standard":
            h = h + self.attention(self.attention_norm(h), cos, sin)
            return [h + self.feed_forward(self.ffn_norm(h))]
        if self.mode == "delta":
            a = self.attention(self.attention_norm(self._route(sources, query, key_norm, 0, h, alpha)), cos, sin)
            h = h + a
            mlp_sources = sources + [a] if self.granularity == "sublayer" else sources
            m = self.feed_forward(self.ffn_norm(self._route(mlp_sources, query, key_norm, 1, h, alpha)))
            return [h + m, a, m]
        a = self.attention(self.attention_norm(self._route(sources, query, key_norm, 0)), cos, sin)
        if self.granularity == "sublayer":
            m = self.feed_forward(self.ffn_norm(self._route(sources + [a], query, key_norm, 1)))
            return [a, m]
        partial = a if self.starts_block else sources[-1] + a
        blocks = sources if self.starts_block else sources[:-1]
        m = self.feed_forward(self.ffn_norm(self._route(blocks + [partial], query, key_norm, 1)))
        return [partial, partial + m]


class DepthRouting(nn.Module):
    """All routing parameters of the model (MHAR_SPEC section 2; DESIGN.md "Placement").

    query (S, d): pseudo-queries, row 2i / 2i+1 = layer i's attention / MLP site, row 2L = final.
    key_norm (S, d): key RMSNorm weights. alpha (S, 1): delta gates (delta mode only; shape (1,)
    per site because FSDP rejects 0-dim parameters). null_source (d,): when enabled.
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        S, d = args.n_routing_sites, args.dim
        self.query = nn.Parameter(torch.empty(S, d))
        self.key_norm = nn.Parameter(torch.empty(S, d))
        self.alpha = nn.Parameter(torch.empty(S, 1)) if args.routing_mode == "delta" else None
        self.null_source = nn.Parameter(torch.empty(d)) if args.routing_null_source else None

    def reset_parameters(self) -> None:
        """Pseudo-queries exactly 0 (uniform depth softmax, MHAR_SPEC pitfall 2), key norms 1, gates 0, null 0."""
        nn.init.zeros_(self.query)
        nn.init.ones_(self.key_norm)
        if self.alpha is not None:
            nn.init.zeros_(self.alpha)
        if self.null_source is not None:
            nn.init.zeros_(self.null_source)

    def site(self, index: int) -> dict:
        """Parameters of one site (for the final routing and analysis)."""
        return dict(
            query=self.query[index], norm_weight=self.key_norm[index],
            alpha=None if self.alpha is None else self.alpha[index],
        )


class Transformer(nn.Module):
    """Decoder LM: tokens (B, T) int64 -> logits (B, T, vocab_size).

    forward / hidden_states raise ValueError for an empty batch, T > max_seq_len, or token ids
    outside [0, vocab_size) (a tokenizer / vocab_size mismatch)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(i, args) for i in range(args.n_layers))
        self.routing = DepthRouting(args) if args.residual == "attn_res" else None
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = None if args.tie_embeddings else nn.Linear(args.dim, args.vocab_size, bias=False)
        cos, sin = rope_cos_sin(args, device=self.tok_embeddings.weight.device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """(Re)initialise every parameter and the RoPE buffers; works after `to_empty()`.

        Linear and embedding weights ~ N(0, 0.02^2); norm weights 1; routing as
        `DepthRouting.reset_parameters`. RoPE tables are recomputed on `buffer_device`
        (default: where they are now).
        """
        device = buffer_device if buffer_device is not None else self.rope_cos.device
        self.rope_cos, self.rope_sin = rope_cos_sin(self.args, device=device)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            elif isinstance(module, (RMSNorm, DepthRouting)):
                module.reset_parameters()

    def _route_final(self, sources: list[Tensor], h: Tensor | None) -> Tensor:
        site = self.routing.site(self.args.n_routing_sites - 1)
        return route(
            sources, site["query"], site["norm_weight"], self.args.resolved_routing_heads, self.args.routing_eps,
            self.args.routing_kernel, partial=h, alpha=site["alpha"],
        )

    def hidden_states(self, tokens: Tensor, trace: list | None = None) -> Tensor:
        """Run embedding, layers and the final routing (not the final norm): (B, T) -> (B, T, d).

        With `trace` (a list), appends for each routing site, in order, the list of sources that
        site routes over (the attention and MLP sites of every layer, then the final one).
        """
        self._check_tokens(tokens)
        T = tokens.shape[1]
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        h = self.tok_embeddings(tokens)
        if self.routing is None:
            for layer in self.layers:
                (h,) = layer(h, cos, sin)
            return h

        args, r = self.args, self.routing
        null = [r.null_source] if r.null_source is not None else []
        delta, by_block = args.routing_mode == "delta", args.routing_granularity == "block"
        sources = null + [h]  # replace+block: blocks + [partial]; otherwise all current sources
        block_delta = None  # delta+block: running sum of the current block's sublayer outputs
        for i, layer in enumerate(self.layers):
            if delta and by_block and layer.starts_block and block_delta is not None:
                sources, block_delta = sources + [block_delta], None
            params = dict(query=r.query[2 * i: 2 * i + 2], key_norm=r.key_norm[2 * i: 2 * i + 2])
            if delta:
                params["alpha"] = r.alpha[2 * i: 2 * i + 2]
            out = layer(h if delta else None, cos, sin, sources, **params)
            if trace is not None:
                trace.extend(self._site_sources(layer, sources, out))
            if not delta:
                if by_block:
                    sources = (sources if layer.starts_block else sources[:-1]) + [out[1]]
                else:
                    sources = sources + out
            else:
                h, a, m = out
                if by_block:
                    block_delta = a + m if block_delta is None else block_delta + a + m
                else:
                    sources = sources + [a, m]
        if delta and by_block and block_delta is not None:
            sources = sources + [block_delta]
        if trace is not None:
            trace.append(sources)
        return self._route_final(sources, h if delta else None)

    def _check_tokens(self, tokens: Tensor) -> None:
        """ValueError for tokens that are not a non-empty (B, T) integer batch of ids in
        [0, vocab_size), or longer than max_seq_len. The id range check reads one min/max pair
        back from the device (skipped on the meta device and while torch.compile traces)."""
        if tokens.dim() != 2 or tokens.dtype.is_floating_point or tokens.dtype.is_complex:
            raise ValueError(f"tokens must be a (B, T) integer tensor, got {tuple(tokens.shape)} {tokens.dtype}")
        B, T = tokens.shape
        if B == 0 or T == 0:
            raise ValueError(f"tokens must hold at least one token per sequence, got shape {(B, T)}")
        if T > self.args.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds max_seq_len={self.args.max_seq_len}; raise max_seq_len")
        if torch.compiler.is_compiling() or tokens.device.type == "meta":
            return
        low, high = (int(v) for v in torch.aminmax(tokens))
        if low < 0 or high >= self.args.vocab_size:
            raise ValueError(
                f"token ids span [{low}, {high}] but vocab_size={self.args.vocab_size}: the tokenizer does not match "
                "the model; set the model's vocab_size to the tokenizer's vocabulary padded up to a multiple of 128"
            )

    def _site_sources(self, layer: TransformerBlock, sources: list[Tensor], out: list[Tensor]) -> list[list[Tensor]]:
        """The source lists `layer` routed over at its attention and MLP sites (for tracing)."""
        if self.args.routing_mode == "delta":
            return [sources, sources + [out[1]] if self.args.routing_granularity == "sublayer" else sources]
        if self.args.routing_granularity == "sublayer":
            return [sources, sources + [out[0]]]
        return [sources, (sources if layer.starts_block else sources[:-1]) + [out[0]]]

    def forward(self, tokens: Tensor, trace: list | None = None) -> Tensor:
        """Logits (B, T, vocab_size); `trace` as in `hidden_states` (through the module call, so
        FSDP gathers the parameters as for any forward)."""
        h = self.norm(self.hidden_states(tokens, trace=trace))
        if self.output is None:
            return F.linear(h, self.tok_embeddings.weight)
        return self.output(h)


@torch.no_grad()
def routing_entropy(model: Transformer, tokens: Tensor) -> float:
    """Mean depth-softmax entropy (nats) over all routing sites, heads and tokens.

    Uses the eager reference weights on the model's own sources; 0.0 for the baseline.
    Single-source sites (entropy 0) are included. Uniform routing over N sources gives log N.
    """
    if model.routing is None:
        return 0.0
    from .routing import route_reference

    trace: list[list[Tensor]] = []
    model.hidden_states(tokens, trace=trace)
    args, total = model.args, 0.0
    for index, sources in enumerate(trace):
        _, weights = route_reference(
            sources, model.routing.query[index], model.routing.key_norm[index],
            args.resolved_routing_heads, args.routing_eps, return_weights=True,
        )
        total += -(weights * weights.clamp_min(torch.finfo(weights.dtype).tiny).log()).sum(0).mean().item()
    return total / len(trace)
