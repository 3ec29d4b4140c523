"""The decoder: Qwen3/Llama-style pre-norm transformer with a pluggable residual path.

Residual paths (MHAR_SPEC sections 1, 2; names in args.py):
- standard: h = h + f(norm(h)) for every sublayer f (attention, then MLP).
- attn_res, replace (AttnRes H=1 / MHAR H>1, sublayer or block granularity): every sublayer
  input is route(sources); the final routing feeds the final norm and the LM head.
- attn_res, delta (MHAR_SPEC 1.4): the standard residual stream h is kept and every sublayer
  input is h + alpha * route(sources).

Which sources each routing site reads, and which entries each sublayer adds to the one growing
source list (sublayer outputs, block partial sums), is the routing plan (plan.py): the forward
below follows it and re-derives nothing. Blocks hold no routing parameters: `Transformer.routing`
holds all of them and the model passes each block its two sites' slices as tensor arguments.

Grouped routing (`routing_group_size` g > 1, grouped.py): the block holding a group's first site
runs its phase 1 (it gets the group's (g, d) query and key-norm rows) and merges the phase-1
states of its own sites; the states of sites in later blocks leave it in `BlockOutput.states`
and enter those blocks as inputs (under activation checkpointing, inputs the checkpoint keeps).
"""
from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .args import ModelArgs
from . import grouped
from .plan import OUTPUT, STREAM, RoutingPlan, Site
from .routing import route, share_gradient


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


class AttentionContext(NamedTuple):
    """Everything a block's attention needs besides its input, built once per forward and passed
    to every block as one argument (so a feature of attention adds a field here, not a block
    parameter; activation checkpointing keeps it as a block input).

    cos, sin: RoPE tables (T, head_dim) for the batch's T positions (`rope_cos_sin`).
    """

    cos: Tensor
    sin: Tensor


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

    def forward(self, x: Tensor, context: AttentionContext) -> Tensor:
        """x (B, T, d) -> (B, T, d); `context` holds the RoPE tables of the T positions."""
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, heads, T, head_dim)
        q, k = apply_rope(q, context.cos, context.sin), apply_rope(k, context.cos, context.sin)
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


class BlockOutput(NamedTuple):
    """What a block returns in every mode.

    h: the residual stream after the block (B, T, d); None in replace mode, where routing
    replaces it. sources: the entries its two sublayers added to the source list, in plan order
    (sublayer outputs or block partial sums, each (B, T, d)); empty for the standard residual.
    states: grouped routing only, {site index: phase-1 `grouped.State`} of later blocks' sites.
    """

    h: Tensor | None
    sources: list[Tensor]
    states: dict | None = None


def routed_sources(site: Site, sources: Sequence[Tensor], like: Tensor) -> list[Tensor]:
    """The entries `site` routes over. A site that reads only its (d,) null source (paper layout,
    layer 0's attention) gets it broadcast to the shape of `like` (B, T, d), so its mix is the null."""
    picked = [sources[j] for j in site.reads]
    if all(s.dim() == 1 for s in picked):
        picked = [s.to(like.dtype).expand_as(like).contiguous() for s in picked]
    return picked


def site_input(site: Site, sources: Sequence[Tensor], h: Tensor | None, query: Tensor, key_norm: Tensor,
               alpha: Tensor | None, args: ModelArgs) -> Tensor:
    """Input of a routed sublayer: route over the entries `site.reads` of `sources`; a delta-gated
    site returns h + alpha * mix (MHAR_SPEC 1.4). query, key_norm (d,), alpha (1,): the site's rows."""
    return route(
        routed_sources(site, sources, h), query, key_norm, args.resolved_routing_heads, args.routing_eps,
        args.routing_kernel, partial=h if site.gated else None, alpha=alpha if site.gated else None,
        permutation=args.routing_permutation,
    )


def new_sources(site: Site | None, sources: list[Tensor], output: Tensor, h: Tensor | None) -> list[Tensor]:
    """The entries `site`'s sublayer creates: each recipe of the plan summed left to right over
    the sublayer `output`, the stream `h` after it and earlier entries of `sources`."""
    created: list[Tensor] = []
    for entry in site.creates if site is not None else ():
        value = None
        for coefficient, operand in entry.recipe:
            if operand == OUTPUT:
                x = output
            elif operand == STREAM:
                x = h
            else:  # an index into the source list, the entries created here continuing it
                x = sources[operand] if operand < len(sources) else created[operand - len(sources)]
            value = x if value is None else (value + x if coefficient > 0 else value - x)
        created.append(value)
    return created


class TransformerBlock(nn.Module):
    """One decoder layer (attention sublayer, then MLP sublayer); self-contained for AC/compile/FSDP.

    forward(h, attention_context, sources=(), query=None, key_norm=None, alpha=None, states=None,
            group_query=None, group_key_norm=None) -> BlockOutput
      h: residual stream (B, T, d), None in replace mode. attention_context: `AttentionContext`
      (RoPE tables). sources: the source list so far.
      query, key_norm: (2, d) rows of this layer's two sites (attention, MLP); alpha: (2, 1), delta only.
      Grouped routing: states, the phase-1 states of this layer's sites computed in earlier blocks;
      group_query, group_key_norm: (g, d) rows of the group whose first site is in this layer.
    `self.sites` are the layer's two sites of the routing plan, (None, None) for the standard residual.
    """

    def __init__(self, layer_id: int, args: ModelArgs, plan: RoutingPlan | None = None):
        super().__init__()
        self.layer_id = layer_id
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, args.ffn_dim)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.args = args
        self.plan = plan if plan is not None else RoutingPlan.from_args(args)
        self.sites = self.plan.layer_sites(layer_id)

    def forward(self, h, attention_context, sources=(), query=None, key_norm=None, alpha=None, states=None,
                group_query=None, group_key_norm=None) -> BlockOutput:
        sources, start = list(sources), len(sources)
        states = dict(states or {})  # never mutate the input: checkpointing re-runs the block with it
        routing = (query, key_norm, alpha, states, group_query, group_key_norm)
        attention_site, mlp_site = self.sites
        a = self.attention(self.attention_norm(self._input(0, h, sources, *routing)), attention_context)
        h = None if h is None else h + a
        sources += self._shared(new_sources(attention_site, sources, a, h))
        m = self.feed_forward(self.ffn_norm(self._input(1, h, sources, *routing)))
        h = None if h is None else h + m
        sources += self._shared(new_sources(mlp_site, sources, m, h))
        return BlockOutput(h, sources[start:], states or None)

    def _shared(self, entries: list[Tensor]) -> list[Tensor]:
        """New source-list entries as the routing sites read them (`routing.share_gradient`)."""
        return [share_gradient(e, self.args.routing_kernel, self.args.resolved_routing_heads) for e in entries]

    def _input(self, row: int, h, sources, query, key_norm, alpha, states, group_query, group_key_norm) -> Tensor:
        """Input of sublayer `row` (0 attention, 1 MLP): h for the standard residual, else its site's
        routing: per call, or (grouped) phase 1 when its group starts here, then its merge."""
        site = self.sites[row]
        if site is None:
            return h
        alpha = None if alpha is None else alpha[row]
        group, position = self.plan.group_of(site.index)
        if group.size == 1:
            return site_input(site, sources, h, query[row], key_norm[row], alpha, self.args)
        heads, eps = self.args.resolved_routing_heads, self.args.routing_eps
        if position == 0:
            states.update(grouped.phase1(group, sources, group_query, group_key_norm, heads, eps,
                                         self.args.routing_kernel))
        late = [sources[j] for j in group.late[position]]
        return grouped.merge(site, late, states.pop(site.index), h, query[row], key_norm[row], alpha, heads, eps)


class DepthRouting(nn.Module):
    """All routing parameters of the model (MHAR_SPEC section 2; DESIGN.md "Placement").

    query (S, d): pseudo-queries, row 2i / 2i+1 = layer i's attention / MLP site, row 2L = final.
    key_norm (S, d): key RMSNorm weights. alpha (S, 1): delta gates (delta mode only; shape (1,)
    per site because FSDP rejects 0-dim parameters). null_source: when enabled, (d,), or (2L, d)
    in the paper layout (row k = the null of site k; plan.py).
    """

    def __init__(self, args: ModelArgs, plan: RoutingPlan | None = None):
        super().__init__()
        plan = plan or RoutingPlan.from_args(args)
        S, d, nulls = plan.n_sites, args.dim, plan.n_nulls
        self.query = nn.Parameter(torch.empty(S, d))
        self.key_norm = nn.Parameter(torch.empty(S, d))
        self.alpha = nn.Parameter(torch.empty(S, 1)) if args.routing_mode == "delta" else None
        self.null_source = nn.Parameter(torch.empty((nulls, d) if nulls > 1 else (d,))) if nulls else None

    def reset_parameters(self) -> None:
        """Pseudo-queries exactly 0 (uniform depth softmax, MHAR_SPEC pitfall 2), key norms 1, gates 0, null 0."""
        nn.init.zeros_(self.query)
        nn.init.ones_(self.key_norm)
        if self.alpha is not None:
            nn.init.zeros_(self.alpha)
        if self.null_source is not None:
            nn.init.zeros_(self.null_source)

    def null_sources(self) -> list[Tensor]:
        """The (d,) null sources in the order of the plan's null entries (empty when disabled)."""
        if self.null_source is None:
            return []
        return [self.null_source] if self.null_source.dim() == 1 else list(self.null_source.unbind(0))

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
        self.plan = RoutingPlan.from_args(args)
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(i, args, self.plan) for i in range(args.n_layers))
        self.routing = DepthRouting(args, self.plan) if args.residual == "attn_res" else None
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

    def hidden_states(self, tokens: Tensor, trace: list | None = None) -> Tensor:
        """Run embedding, layers and the final routing (not the final norm): (B, T) -> (B, T, d).

        With `trace` (a list), appends for each routing site, in order, the list of sources that
        site routes over (the attention and MLP sites of every layer, then the final one).
        """
        self._check_tokens(tokens)
        T = tokens.shape[1]
        context = AttentionContext(self.rope_cos[:T], self.rope_sin[:T])
        h = self.tok_embeddings(tokens)
        nulls = iter(self.routing.null_sources() if self.routing is not None else ())
        shared = share_gradient(h, self.args.routing_kernel, self.args.resolved_routing_heads) \
            if self.plan.initial and self.routing is not None else h
        sources = [next(nulls) if entry.kind == "null" else shared for entry in self.plan.initial]
        h = h if self.plan.stream else None
        states: dict = {}  # grouped routing: phase-1 states of sites in later blocks
        for i, layer in enumerate(self.layers):
            h, new, created = layer(h, context, sources, *self._layer_routing(i), **self._group_inputs(i, states))
            states.update(created or {})
            sources = sources + new
            if trace is not None:
                trace.extend(routed_sources(site, sources, h) for site in self.plan.sites[2 * i: 2 * i + 2])
            # Drop the entries no later site uses (block-delta partial sums are never routed over),
            # so that they are freed once autograd is done with them.
            sources = [s if self.plan.last_use[j] > 2 * i + 1 else None for j, s in enumerate(sources)]
        final = self.plan.final
        if final is None:
            return h
        if trace is not None:
            trace.append([sources[j] for j in final.reads])
        p = self.routing.site(final.index)
        if final.index in states:
            late = [sources[j] for j in self.plan.group_of(final.index)[0].late[-1]]
            return grouped.merge(final, late, states.pop(final.index), h, p["query"], p["norm_weight"], p["alpha"],
                                 self.args.resolved_routing_heads, self.args.routing_eps)
        return site_input(final, sources, h, p["query"], p["norm_weight"], p["alpha"], self.args)

    def _layer_routing(self, i: int) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        """query, key_norm (2, d) and alpha (2, 1) rows of layer i's two sites (None where absent)."""
        r, rows = self.routing, slice(2 * i, 2 * i + 2)
        if r is None:
            return None, None, None
        return r.query[rows], r.key_norm[rows], None if r.alpha is None else r.alpha[rows]

    def _group_inputs(self, i: int, states: dict) -> dict:
        """Grouped routing's keyword arguments of layer i (none at g = 1): the phase-1 states of its
        sites (taken out of `states`) and the (g, d) rows of a group of more than one site starting in it."""
        if self.plan.group_size == 1:
            return {}
        inputs = {"states": {s: states.pop(s) for s in (2 * i, 2 * i + 1) if s in states}}
        for site in (2 * i, 2 * i + 1):
            group, position = self.plan.group_of(site)
            if position == 0 and group.size > 1:
                rows = slice(site, site + group.size)
                inputs.update(group_query=self.routing.query[rows], group_key_norm=self.routing.key_norm[rows])
        return inputs

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

    def forward(self, tokens: Tensor, trace: list | None = None) -> Tensor:
        """Logits (B, T, vocab_size); `trace` as in `hidden_states` (through the module call, so
        FSDP gathers the parameters as for any forward)."""
        h = self.norm(self.hidden_states(tokens, trace=trace))
        if self.output is None:
            return F.linear(h, self.tok_embeddings.weight)
        return self.output(h)
