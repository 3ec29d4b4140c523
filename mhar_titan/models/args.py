"""Model arguments, the flavor table and parameter counting.

`ModelArgs` describes one decoder: its shape (Qwen3/Llama style, MHAR_SPEC section 3.1)
and its residual path (MHAR_SPEC sections 1 and 2):

| family        | residual     | routing_heads | routing_granularity | routing_mode |
|---------------|--------------|---------------|---------------------|--------------|
| baseline      | "standard"   | -             | -                   | -            |
| AttnRes       | "attn_res"   | 1             | "sublayer"          | "replace"    |
| MHAR          | "attn_res"   | H > 1 or "kv" | "sublayer"          | "replace"    |
| Block AttnRes | "attn_res"   | any           | "block"             | "replace"    |
| delta (conv.) | "attn_res"   | any           | either              | "delta"      |

and the other depth connections (`connections/`): `residual = "dense"` (DenseFormer, keys
`dense_dilation`, `dense_period`), `"mudd"` (MUDDFormer, key `mudd_prepost_norm`), `"hyper"`
(Hyper-Connections, keys `hyper_rate`, `hyper_dynamic`) and `"mhc"` (manifold-constrained
Hyper-Connections, keys `hyper_rate`, `mhc_exit`, `mhc_sinkhorn_iters`, `mhc_init`, `mhc_res_bias`);
their parameter counts are `connection_parameters`.

`routing_logit_scale` (a float > 0, or "match_heads:H" = 1/sqrt(H)) multiplies every depth logit
of every routing head, and `routing_temperature = "learned"` makes that factor one learnable
log-temperature per routing site and head, starting at the scale (docs/DESIGN.md "Logit scale and
temperature"; router.py `DepthRouting.effective_queries`, the one place the factor is applied).

`routing_group_size` (g, or "auto") cuts the routing sites into groups of g consecutive sites
routed in two phases (plan.py "Groups", router.py); it changes how routing is computed, not
the function or the weights.

Flavors and families are data: `FLAVORS[name]` holds the shape fields that differ from the
defaults, `FAMILIES[name]` the residual-path fields, and
`ModelArgs.from_flavor(name, **FAMILIES[family], **overrides)` builds one, and
`resolve_model_args` the one a job trains (`[model]` flavor + overrides, sized for the tokenizer
and the sequence length): the trainer, the dry run and the job config's validation all resolve
here, so they agree on the defaults and on which `[model]` key an error blames.

A leaf: imports nothing but the plan and the errors (no torch), so the job config checks its
`[model]` section here without loading the model.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Literal, Optional

from mhar_titan.errors import ConfigError

from .plan import RoutingPlan

ATTN_MASK_TYPES = ("causal", "block_causal")
"""Values of ``model.attn_mask_type`` (TorchTitan's key and values; attention_mask.py)."""
RESIDUALS = ("standard", "attn_res", "dense", "mudd", "hyper", "mhc")
"""Values of ``model.residual``: the depth connections (``connections.CONNECTIONS`` maps each to its class)."""
CONNECTION_KEYS = {"dense": ("dense_dilation", "dense_period"), "mudd": ("mudd_prepost_norm",),
                   "hyper": ("hyper_rate", "hyper_dynamic"),
                   "mhc": ("hyper_rate", "mhc_exit", "mhc_sinkhorn_iters", "mhc_init", "mhc_res_bias")}
"""The keys of each depth connection other than depth routing's (``routing_*``): set away from their
defaults they need one of the connections that list them (``hyper_rate``, the number of streams, is
both multi-stream connections')."""
MHC_EXITS = ("learned", "mean")
MHC_INITS = ("zero", "prenorm")
GRANULARITIES = ("sublayer", "block")
ROUTING_MODES = ("replace", "delta")
ROUTING_LAYOUTS = ("clean", "paper")
HEAD_LAYOUTS = ("contiguous", "permuted")
ROPE_SCALINGS = (None, "llama3")
ROUTING_TEMPERATURES = ("fixed", "learned")
MATCH_HEADS = "match_heads:"
"""Prefix of the `routing_logit_scale` spelling "match_heads:H" (the scale 1/sqrt(H))."""
ROUTING_KERNELS = ("eager", "compile", "triton", "auto")  # mhar_kernels.dispatch.KERNELS (a test checks)
INT_FIELDS = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "max_seq_len",
              "rope_original_max_seq_len", "routing_block_layers", "dense_dilation", "dense_period",
              "hyper_rate", "mhc_sinkhorn_iters")
REAL_FIELDS = ("norm_eps", "rope_theta", "rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor",
               "routing_eps", "mhc_res_bias")
BOOL_FIELDS = ("qk_norm", "tie_embeddings", "routing_null_source", "rope_per_document", "mudd_prepost_norm",
               "hyper_dynamic")
WEIGHT_NEUTRAL_FIELDS = ("routing_kernel", "max_seq_len", "routing_group_size")
"""Fields that change how the model is computed, not its weights: a checkpoint resumes, and a
converted folder loads, across them."""


def pad_vocab(n_vocab: int, multiple: int = 128) -> int:
    """Round a tokenizer's vocabulary size up to a multiple of `multiple` (embedding rows)."""
    if n_vocab <= 0 or multiple <= 0:
        raise ValueError(f"pad_vocab needs positive sizes, got n_vocab={n_vocab}, multiple={multiple}")
    return -(-n_vocab // multiple) * multiple


@dataclass
class ModelArgs:
    """Shape and residual path of one decoder. Validated on construction (ValueError)."""

    # -- decoder shape --------------------------------------------------------------------
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 384
    vocab_size: int = 50_304  # gpt2 (50,257) padded to a multiple of 128
    norm_eps: float = 1e-6
    rope_theta: float = 10_000.0
    rope_scaling: str | None = None  # None or "llama3" (Llama 3.1 frequency scaling)
    rope_scaling_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: int = 8192
    qk_norm: bool = True  # per-head RMSNorm on q and k (Qwen3); False for Llama
    tie_embeddings: bool = True
    max_seq_len: int = 512  # RoPE table length; forward rejects longer inputs
    attn_mask_type: Literal["causal", "block_causal"] = "causal"  # block_causal: attend within a document (attention_mask.py)
    rope_per_document: bool = False  # block_causal only: RoPE positions restart at each document
    eos_id: int | None = None  # the EOS closing each packed document; block_causal needs it (the tokenizer's)

    # -- residual path: the depth connection (MHAR_SPEC sections 1, 2; connections/) -------
    residual: Literal["standard", "attn_res", "dense", "mudd", "hyper", "mhc"] = "standard"
    routing_heads: int | str = 8  # H; 1 = single-head AttnRes; "kv" = n_kv_heads
    routing_granularity: Literal["sublayer", "block"] = "sublayer"
    routing_block_layers: int = 4  # transformer layers per block (block granularity)
    routing_mode: Literal["replace", "delta"] = "replace"
    routing_null_source: bool = False  # learnable (d,) source 0, init 0
    routing_kernel: Literal["eager", "compile", "triton", "auto"] = "eager"
    routing_eps: float = 1e-6
    routing_group_size: int | Literal["auto"] = 1  # g consecutive sites per routing group (plan.py "Groups"); 1 = per call; "auto"
    routing_layout: Literal["clean", "paper"] = "clean"  # delta bookkeeping: ours or the authors' (plan.py)
    routing_head_layout: Literal["contiguous", "permuted"] = "contiguous"  # permuted: eager kernel only
    routing_head_layout_seed: int = 0  # seed of the permuted layout's fixed permutation of the d coordinates
    routing_logit_scale: float | str = 1.0  # multiplies every depth logit (> 0); "match_heads:H" = 1/sqrt(H)
    routing_temperature: Literal["fixed", "learned"] = "fixed"  # learned: a log-temperature per site and head, from the scale
    dense_dilation: int = 1  # DenseFormer k: block i's average reads the outputs X_j with j = i+1 (mod k)
    dense_period: int = 1  # DenseFormer p: the average runs after block i only where (i+1) % p == 0
    mudd_prepost_norm: bool = True  # MUDDFormer's pre/post DA norm (normalised sources, streams = X + DA)
    hyper_rate: int = 4  # n, the residual streams of Hyper-Connections and mHC (the expansion rate)
    hyper_dynamic: bool = True  # Hyper-Connections' dynamic part (per-token alpha, beta); false: static only
    mhc_exit: Literal["learned", "mean"] = "learned"  # mHC's read-out: DeepSeek's learned head, or Megatron's mean
    mhc_sinkhorn_iters: int = 20  # Sinkhorn iterations of mHC's residual mixing (ending on a column normalisation)
    mhc_init: Literal["zero", "prenorm"] = "zero"  # mHC biases: 0 (Megatron's), or b_pre = logit(1/n), b_res = c I
    mhc_res_bias: float = 10.0  # c of mhc_init = "prenorm": the diagonal of the residual-mixing bias

    def __post_init__(self) -> None:
        self.validate()

    # -- validation ---------------------------------------------------------------------
    def validate(self) -> None:
        """Raise ValueError naming the offending field(s) and how to fix them."""
        self._check_types()
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads} (GQA)")
        if self.head_dim % 2:
            raise ValueError(f"head_dim = dim / n_heads = {self.head_dim} must be even for RoPE")
        if self.rope_scaling not in ROPE_SCALINGS:
            raise ValueError(f"unknown rope_scaling {self.rope_scaling!r}; choose one of {ROPE_SCALINGS}")
        if self.rope_scaling == "llama3" and not (
            self.rope_scaling_factor >= 1 and self.rope_high_freq_factor > self.rope_low_freq_factor > 0
            and self.rope_original_max_seq_len > 0
        ):
            raise ValueError(
                "llama3 rope scaling needs rope_scaling_factor >= 1, rope_high_freq_factor > rope_low_freq_factor > 0 "
                f"and rope_original_max_seq_len > 0; got factor={self.rope_scaling_factor}, "
                f"low={self.rope_low_freq_factor}, high={self.rope_high_freq_factor}, "
                f"original_max_seq_len={self.rope_original_max_seq_len}"
            )
        _check_choice("attn_mask_type", self.attn_mask_type, ATTN_MASK_TYPES)
        if self.rope_per_document and self.attn_mask_type != "block_causal":
            raise ValueError("rope_per_document=True restarts RoPE positions at each document, which needs "
                             "attn_mask_type='block_causal'; set it, or rope_per_document=False")
        eos = self.eos_id
        if eos is not None and (not isinstance(eos, int) or isinstance(eos, bool) or not 0 <= eos < self.vocab_size):
            raise ValueError(f"eos_id must be a token id in [0, vocab_size={self.vocab_size}) or unset, got {eos!r}")
        _check_choice("residual", self.residual, RESIDUALS)
        _check_choice("routing_granularity", self.routing_granularity, GRANULARITIES)
        _check_choice("routing_mode", self.routing_mode, ROUTING_MODES)
        _check_choice("routing_kernel", self.routing_kernel, ROUTING_KERNELS)
        _check_choice("routing_head_layout", self.routing_head_layout, HEAD_LAYOUTS)
        seed = self.routing_head_layout_seed
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise ValueError(f"routing_head_layout_seed must be an integer >= 0, got {seed!r}")
        if self.routing_head_layout == "permuted" and self.routing_kernel != "eager":
            raise ValueError(
                f"routing_head_layout='permuted' runs on the eager path only, not routing_kernel="
                f"{self.routing_kernel!r}: set routing_kernel='eager' (or use the contiguous layout)"
            )
        heads = self.routing_heads
        if heads != "kv" and (not isinstance(heads, int) or isinstance(heads, bool) or heads <= 0):
            raise ValueError(f"routing_heads must be a positive integer or 'kv', got {heads!r}")
        if self.residual == "attn_res" and self.dim % self.resolved_routing_heads:
            raise ValueError(
                f"dim d={self.dim} is not divisible by routing heads H={self.resolved_routing_heads}: "
                "MHAR splits the pseudo-query into H contiguous slices of d/H; choose H among the divisors of "
                f"d: {', '.join(str(h) for h in range(1, self.dim + 1) if self.dim % h == 0)}"
            )
        self._check_group_size()
        self._check_logit_scale()
        _check_choice("routing_layout", self.routing_layout, ROUTING_LAYOUTS)
        if self.routing_layout == "paper" and self.residual == "attn_res" and not (
            self.routing_mode == "delta" and self.routing_null_source and self.routing_eps == self.norm_eps
        ):
            raise ValueError(
                "routing_layout='paper' reproduces the authors' delta bookkeeping (MHAR_SPEC 1.4): it needs "
                f"routing_mode='delta', routing_null_source=true and routing_eps = norm_eps = {self.norm_eps} "
                f"(got routing_mode={self.routing_mode!r}, routing_null_source={self.routing_null_source}, "
                f"routing_eps={self.routing_eps})"
            )
        self._check_connection_keys()
        if self.residual == "standard" and (self.routing_mode == "delta" or self.routing_null_source):
            raise ValueError(
                f"routing_mode={self.routing_mode!r} and routing_null_source={self.routing_null_source} need "
                "residual='attn_res' (the standard residual has no routing sites); set residual='attn_res', "
                "or routing_mode='replace' and routing_null_source=False"
            )

    def _check_connection_keys(self) -> None:
        """A connection's own keys (`CONNECTION_KEYS`) need that connection, and depth routing's
        (`routing_*`, but the weight-neutral kernel) need residual='attn_res', unless left at their
        defaults (ValueError naming the keys); DenseFormer's dilation and period are at most n_layers;
        mHC's `mhc_res_bias` needs mhc_init='prenorm', and that init at least 2 streams."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        _check_choice("mhc_exit", self.mhc_exit, MHC_EXITS)
        _check_choice("mhc_init", self.mhc_init, MHC_INITS)
        for residual, keys in CONNECTION_KEYS.items():
            changed = [k for k in keys if getattr(self, k) != defaults[k] and self.residual not in key_owners(k)]
            if changed:
                owners = " or ".join(repr(r) for r in dict.fromkeys(r for k in changed for r in key_owners(k)))
                raise ValueError(f"{', '.join(f'{k}={getattr(self, k)!r}' for k in changed)} "
                                 f"{'configures' if len(changed) == 1 else 'configure'} residual="
                                 f"{owners}, not residual={self.residual!r}: set residual={residual!r}, or leave "
                                 f"{' and '.join(changed)} at the default")
        if self.residual not in ("standard", "attn_res"):
            changed = [f.name for f in dataclasses.fields(self) if f.name.startswith("routing_")
                       and f.name not in WEIGHT_NEUTRAL_FIELDS and getattr(self, f.name) != f.default]
            if changed:
                raise ValueError(f"{', '.join(f'{k}={getattr(self, k)!r}' for k in changed)} "
                                 f"{'configures' if len(changed) == 1 else 'configure'} depth routing "
                                 f"(residual='attn_res'); residual={self.residual!r} has no routing sites: leave "
                                 f"{' and '.join(changed)} at the default")
        if self.mhc_init == "prenorm" and self.hyper_rate < 2:
            raise ValueError(f"mhc_init='prenorm' starts pre at 1/n, which needs hyper_rate >= 2 streams (got "
                             f"{self.hyper_rate}): set hyper_rate >= 2, or mhc_init='zero'")
        if self.mhc_res_bias != defaults["mhc_res_bias"] and self.mhc_init != "prenorm":
            raise ValueError(f"mhc_res_bias={self.mhc_res_bias!r} is the residual-mixing bias of mhc_init='prenorm' "
                             f"(mhc_init={self.mhc_init!r} starts every bias at 0): set mhc_init='prenorm', or leave "
                             "mhc_res_bias at the default")
        for key in ("dense_dilation", "dense_period"):
            if getattr(self, key) > self.n_layers:
                raise ValueError(f"{key}={getattr(self, key)} is larger than n_layers={self.n_layers}: DenseFormer's "
                                 f"{'dilation' if key == 'dense_dilation' else 'period'} counts blocks; choose "
                                 f"1..{self.n_layers}")

    def _check_group_size(self) -> None:
        """routing_group_size: a positive int or "auto"; g != 1 rejects routing_kernel="compile" (ValueError)."""
        g = self.routing_group_size
        if g != "auto" and (not isinstance(g, int) or isinstance(g, bool) or g <= 0):
            raise ValueError(f"routing_group_size must be a positive integer (1 = per-call routing) or 'auto', "
                             f"got {g!r}")
        if g not in (1, "auto") and self.residual != "attn_res":
            raise ValueError(f"routing_group_size={g!r} needs residual='attn_res' (residual={self.residual!r} has no "
                             "routing sites); set routing_group_size=1")
        if g != 1 and self.routing_layout != "clean":
            raise ValueError(f"routing_group_size={g!r} supports routing_layout='clean' only (the paper layout's "
                             "per-site null sources are not grouped); set routing_group_size=1")
        if g != 1 and self.routing_head_layout != "contiguous":
            raise ValueError(f"routing_group_size={g!r} supports routing_head_layout='contiguous' only; set "
                             "routing_group_size=1 for the permuted head layout")
        if isinstance(g, int) and g > 1 and self.residual == "attn_res":
            n = RoutingPlan.from_args(self).n_sites
            if g > n:
                raise ValueError(f"routing_group_size={g} is larger than the {n} routing sites of this model "
                                 f"({self.n_layers} layers, {self.routing_granularity} granularity): a group holds "
                                 f"at most every site; choose 1..{n}, or 'auto' (the group size with the fewest "
                                 "routing reads)")
        if g != 1 and self.routing_kernel == "compile":
            raise ValueError(f"routing_group_size={g!r} runs with routing_kernel 'eager', 'triton' or 'auto' "
                             "(grouped routing has no torch.compile'd routing body; per-block compile is "
                             "compile.enable), got routing_kernel='compile'; set routing_kernel='triton' or "
                             "'eager', or routing_group_size=1")

    def _check_logit_scale(self) -> None:
        """routing_logit_scale (a finite float > 0 or "match_heads:H", `logit_scale`) and
        routing_temperature ("fixed" or "learned"); both need residual='attn_res' unless left at
        their defaults (ValueError). Every routing kernel takes both (the factor is folded into the
        pseudo-query, router.py `DepthRouting.effective_queries`), so no kernel is rejected."""
        logit_scale(self.routing_logit_scale)
        _check_choice("routing_temperature", self.routing_temperature, ROUTING_TEMPERATURES)
        if self.residual == "standard" and (self.routing_temperature != "fixed"
                                            or logit_scale(self.routing_logit_scale) != 1.0):
            raise ValueError(f"routing_logit_scale={self.routing_logit_scale!r} and routing_temperature="
                             f"{self.routing_temperature!r} scale the depth logits, which need residual='attn_res' "
                             "(the standard residual has no routing sites); set residual='attn_res', or "
                             "routing_logit_scale=1.0 and routing_temperature='fixed'")

    def _check_types(self) -> None:
        """Numeric and boolean fields: positive ints, finite positive reals, bools (ValueError)."""
        for name in INT_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelArgs.{name} must be a positive integer, got {value!r}")
        for name in REAL_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"ModelArgs.{name} must be a finite number > 0, got {value!r}")
        for name in BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ModelArgs.{name} must be true or false, got {getattr(self, name)!r}")

    # -- derived quantities -------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def resolved_routing_heads(self) -> int:
        """Routing heads H as an integer ("kv" resolves to n_kv_heads)."""
        return self.n_kv_heads if self.routing_heads == "kv" else int(self.routing_heads)

    @property
    def resolved_logit_scale(self) -> float:
        """The factor every depth logit starts with, as a float (`logit_scale`)."""
        return logit_scale(self.routing_logit_scale)

    @property
    def n_routing_sites(self) -> int:
        """Routing sites S: one per sublayer plus the final routing (2L+1; 2L in the paper layout,
        which has no final routing); 0 for the baseline."""
        return RoutingPlan.from_args(self).n_sites

    @classmethod
    def from_flavor(cls, name: str, **overrides) -> "ModelArgs":
        """Build the flavor `name` from `FLAVORS`, with field overrides (e.g. residual="attn_res")."""
        if name not in FLAVORS:
            raise ValueError(f"unknown model flavor {name!r}; valid flavors: {', '.join(FLAVORS)}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise ValueError(f"unknown ModelArgs field(s) {unknown}; valid fields: {sorted(fields)}")
        return cls(**{**FLAVORS[name], **overrides})


def logit_scale(value) -> float:
    """The depth-logit scale a `routing_logit_scale` setting means: a finite number > 0 as a float,
    or "match_heads:H" (H a positive decimal integer) as 1/sqrt(H), the temperature at which one
    routing head's logits have the spread of one of H heads' (each head's logit sums d/H products
    instead of d). The one parser of the setting.

    Raises:
        ValueError: naming the field: a bool, a number <= 0, NaN or infinite, a string other than
            "match_heads:H", or H not a positive integer ("match_heads:0", "match_heads:x",
            "match_heads:-3", "match_heads:"), or a scale outside `LOGIT_SCALE_RANGE`.
    """
    if isinstance(value, str):
        count = value[len(MATCH_HEADS):] if value.startswith(MATCH_HEADS) else None
        if count is None or not (0 < len(count) <= 18 and count.isascii() and count.isdigit()) or int(count) <= 0:
            raise ValueError(f"routing_logit_scale must be a number > 0 or 'match_heads:H' with H a positive integer "
                             f"(the scale 1/sqrt(H)), got {value!r}; e.g. routing_logit_scale='match_heads:8'")
        return _within_range(1.0 / math.sqrt(int(count)), value)
    try:
        scale = float(value) if isinstance(value, numbers.Real) and not isinstance(value, bool) else math.nan
    except OverflowError:  # an int beyond the float range
        scale = math.inf
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"routing_logit_scale must be a finite number > 0 or 'match_heads:H', got {value!r}")
    return _within_range(scale, value)


LOGIT_SCALE_RANGE = (2.0 ** -20, 2.0 ** 20)
"""The scales `logit_scale` accepts (about 9.5e-7 to 1.0e6). The scale is folded into the
pseudo-query in the parameters' dtype (float32) and then the compute dtype (bf16 on GPUs): 1e39
overflows float32 (the first step's loss is NaN), 1e-46 rounds to 0 (uniform routing, the very
setting 0 is refused for), and scales far inside those bounds already put the depth logits, or
their gradients (scale x the query's), beyond what a bf16 step keeps finite and meaningful."""


def _within_range(scale: float, value) -> float:
    low, high = LOGIT_SCALE_RANGE
    if not low <= scale <= high:
        raise ValueError(f"routing_logit_scale = {value!r} is the scale {scale:g}, outside [{low:.3g}, {high:.3g}] "
                         f"(2^-20 to 2^20): folded into the pseudo-query it would overflow or vanish in float32/bf16 "
                         f"training; use a scale in that range, e.g. 'match_heads:8' (0.354)")
    return scale


def key_owners(key: str) -> tuple[str, ...]:
    """The connections (values of ``residual``) whose keys (`CONNECTION_KEYS`) include `key`."""
    return tuple(residual for residual, keys in CONNECTION_KEYS.items() if key in keys)


def _check_choice(field: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"unknown {field} {value!r}; choose one of {choices}")


# The paper's flavors use MHAR_SPEC section 3.1 shapes (Qwen3-style: qk-norm, eps 1e-6,
# theta 1e4, tied embeddings, max_position = 2T) at the cl100k_base vocabulary (100,277
# padded to 100,352). `llama3_8b` is the Llama-3.1-8B shape used by the conversion path.
FLAVORS: dict[str, dict] = {
    "debug": dict(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=384, vocab_size=50_304, max_seq_len=512),
    "100m": dict(dim=512, n_layers=12, n_heads=8, n_kv_heads=4, ffn_dim=1536, vocab_size=100_352, max_seq_len=4096),
    "350m": dict(dim=1024, n_layers=24, n_heads=16, n_kv_heads=8, ffn_dim=4096, vocab_size=100_352, max_seq_len=2048),
    "1b": dict(dim=1280, n_layers=36, n_heads=16, n_kv_heads=8, ffn_dim=5120, vocab_size=100_352, max_seq_len=2048),
    "llama3_8b": dict(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14_336, vocab_size=128_256,
        norm_eps=1e-5, rope_theta=500_000.0, rope_scaling="llama3", qk_norm=False, tie_embeddings=False,
        max_seq_len=8192,
    ),
}


# Residual-path families the MHAR paper compares, plus the block and delta (conversion) variants:
# the rows of the zoo listing (`python -m mhar_titan.models`) and of the benchmarks.
FAMILIES: dict[str, dict] = {
    "baseline": dict(residual="standard"),
    "attn_res H=1": dict(residual="attn_res", routing_heads=1),
    "mhar H=8": dict(residual="attn_res", routing_heads=8),
    "mhar H=kv": dict(residual="attn_res", routing_heads="kv"),
    "block H=8": dict(residual="attn_res", routing_heads=8, routing_granularity="block"),
    "delta block H=8 +null": dict(
        residual="attn_res", routing_heads=8, routing_granularity="block", routing_mode="delta",
        routing_null_source=True,
    ),
    "dense": dict(residual="dense"),
    "mudd": dict(residual="mudd"),
    "mudd_plain": dict(residual="mudd", mudd_prepost_norm=False),
    "hyper": dict(residual="hyper"),
    "hyper_static": dict(residual="hyper", hyper_dynamic=False),
    "mhc": dict(residual="mhc"),
}


FAMILY_FIELDS = ("residual", "routing_heads", "routing_granularity", "routing_block_layers", "routing_mode",
                 "routing_null_source", "routing_layout", "routing_head_layout", "routing_logit_scale",
                 "routing_temperature", *dict.fromkeys(k for keys in CONNECTION_KEYS.values() for k in keys))
"""The ``ModelArgs`` fields that tell one residual-path family from another."""


def family_name(args: "ModelArgs") -> str:
    """The ``FAMILIES`` row ``args`` belongs to, e.g. ``"mhar H=8"``; with `` + field=value`` for
    each family field (``FAMILY_FIELDS``) that differs from the nearest row (fewest differences,
    the first row on a tie), e.g. ``"delta block H=8 +null + routing_layout='paper'"``."""
    defaults = ModelArgs()

    def differences(row: dict) -> list[str]:
        return [f"{k}={getattr(args, k)!r}" for k in FAMILY_FIELDS
                if getattr(args, k) != row.get(k, getattr(defaults, k))
                and (args.residual != "standard" or k == "residual")]  # a baseline has no routing fields

    name, diffs = min(((n, differences(row)) for n, row in FAMILIES.items()), key=lambda item: len(item[1]))
    return " + ".join([name, *diffs])


ROUTING_IN_FAMILY_TEXT = ("routing_heads", "routing_granularity", "routing_mode", "routing_kernel")
"""The routing fields the start line names on their own (the family text ``attn_res H=8 sublayer
replace`` and ``routing eager``); ``routing_settings`` gives the others."""


def routing_settings(args: "ModelArgs") -> list[str]:
    """``field=value`` of every ``routing_*`` field of a routed ``args`` (residual ``attn_res``) that
    differs from the ``ModelArgs`` default, but those the start line names otherwise
    (``ROUTING_IN_FAMILY_TEXT``), in field order; a logit scale with the factor it means
    (``routing_logit_scale=match_heads:8 (x0.354)``). [] for the baseline. What the trainer's
    start line and the dry run print, so a run that routes at another temperature (or with a
    null source, a permuted head layout, groups...) says so."""
    if args.residual != "attn_res":
        return []
    defaults = ModelArgs()
    out = []
    for f in dataclasses.fields(ModelArgs):
        name = f.name
        if not name.startswith("routing_") or name in ROUTING_IN_FAMILY_TEXT:
            continue
        value = getattr(args, name)
        if value == getattr(defaults, name):
            continue
        text = f"{name}={value}"
        if name == "routing_logit_scale" and isinstance(value, str):
            text += f" (x{logit_scale(value):.3g})"
        out.append(text)
    return out


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts of a model. `non_embedding` excludes the vocabulary-sized matrices
    (token embedding and, when untied, the LM head); `routing` is the extra over the baseline."""

    total: int
    non_embedding: int
    routing: int


def count_parameters(args: ModelArgs) -> ParamCounts:
    """Count parameters from the arguments alone (no allocation); equals `Transformer(args)`'s count.

    The extra over the baseline is the depth connection's (`connection_parameters`).
    """
    d, hd = args.dim, args.head_dim
    attention = d * hd * (2 * args.n_heads + 2 * args.n_kv_heads) + (2 * hd if args.qk_norm else 0)
    mlp = 3 * d * args.ffn_dim
    per_layer = attention + mlp + 2 * d  # + attention_norm and ffn_norm weights
    embedding = args.vocab_size * d * (1 if args.tie_embeddings else 2)
    routing = connection_parameters(args)
    non_embedding = args.n_layers * per_layer + d + routing  # + final norm
    return ParamCounts(total=non_embedding + embedding, non_embedding=non_embedding, routing=routing)


def connection_parameters(args: ModelArgs) -> int:
    """Parameters of the depth connection, beyond the baseline's (0 for the standard residual).

    - attn_res (MHAR_SPEC section 2): S = 2L+1 sites x (pseudo-query d + key-norm weight d), plus
      one (1,) gate per site in delta mode and a (d,) null source when enabled (one per sublayer
      site, and no final site, in the paper layout), and with a learned routing temperature one
      log-temperature per site and routing head.
    - dense (DenseFormer): one weight per (block i, source j) of every depth-weighted average,
      floor((i+1)/k) + 1 sources after each block i with (i+1) % p == 0: L(L+3)/2 at k = p = 1.
    - mudd (MUDDFormer): per block i, with C_i = 4 streams (1 after the last block) over i+2 sources
      and K_i the hidden width (`mudd_hidden`): d K_i + K_i C_i (i+2) + C_i (i+2); with the pre/post
      DA norm also the sources' norm scales ((L+1) d), each block's generator and post-norm scales
      (2 L d); and the K and V streams' input norms of blocks 1..L-1 (2 (L-1) d).
    - hyper (Hyper-Connections, n = hyper_rate streams): per sublayer site (2L of them) the static
      alpha (n x (n+1)) and beta (n), n (n+2); with the dynamic part also W_alpha (d x (n+1)), W_beta
      (d), the LayerNorm's weight and bias (2d) and the scales s_alpha, s_beta: d (n+2) + 2d + 2.
    - mhc (n streams): per sublayer site phi ((n^2+2n) x nd), the biases b (n^2+2n) and the three
      gating factors a: (n^2+2n) nd + n^2 + 2n + 3 (96d + 27 at n = 4); the learned exit adds its
      phi_h (n x nd), b_h (n) and a (1): n nd + n + 1 (none for the mean of streams).
    """
    d, L = args.dim, args.n_layers
    if args.residual == "attn_res":
        sites = args.n_routing_sites
        count = sites * (2 * d + (1 if args.routing_mode == "delta" else 0)) + RoutingPlan.from_args(args).n_nulls * d
        return count + (sites * args.resolved_routing_heads if args.routing_temperature == "learned" else 0)
    if args.residual == "dense":
        return sum(len(dense_sources(args, i)) for i in range(L) if dense_averages(args, i))
    if args.residual == "mudd":
        count = sum(d * mudd_hidden(args, i) + (mudd_hidden(args, i) + 1) * mudd_streams(args, i) * (i + 2)
                    for i in range(L))
        return count + ((L + 1) * d + 2 * L * d if args.mudd_prepost_norm else 0) + 2 * (L - 1) * d
    n, sites = args.hyper_rate, 2 * L
    if args.residual == "hyper":
        return sites * (n * (n + 2) + (d * (n + 2) + 2 * d + 2 if args.hyper_dynamic else 0))
    if args.residual == "mhc":
        mix = n * n + 2 * n
        head = n * n * d + n + 1 if args.mhc_exit == "learned" else 0
        return sites * (mix * n * d + mix + 3) + head
    return 0


def dense_averages(args: ModelArgs, block: int) -> bool:
    """Whether DenseFormer averages after block `block` (0-based): (block + 1) % dense_period == 0."""
    return (block + 1) % args.dense_period == 0


def dense_sources(args: ModelArgs, block: int) -> tuple[int, ...]:
    """The block outputs X_j (X_0 the embedding) DenseFormer's average after block `block` reads, in
    order: j <= block + 1 with j = block + 1 (mod dense_dilation); the last is the block's own X."""
    k = args.dense_dilation
    return tuple(range((block + 1) % k, block + 2, k))


def mudd_streams(args: ModelArgs, block: int) -> int:
    """MUDDFormer's streams C after block `block`: 4 (queries, keys, values, residual R), 1 (R)
    after the last block."""
    return 1 if block == args.n_layers - 1 else 4


def mudd_hidden(args: ModelArgs, block: int) -> int:
    """The hidden width K of MUDDFormer's weight generator after block `block`: C (block + 2), times 4
    after the last block, then (K // 64 + 1) * 64 (the reference's rounding, which adds 64 to a
    multiple of 64)."""
    k = mudd_streams(args, block) * (block + 2) * (4 if block == args.n_layers - 1 else 1)
    return (k // 64 + 1) * 64


def _blamed_model_key(m, overrides: dict) -> str:
    """Which ``[model]`` key makes ``ModelArgs`` fail: the first override (in config order)
    whose addition to the flavor breaks it; the flavor itself if nothing does alone."""
    try:
        ModelArgs.from_flavor(m.flavor)
    except (ValueError, TypeError):
        return f"'model.flavor' = {m.flavor!r}"
    applied = {}
    for key, value in overrides.items():
        applied[key] = value
        try:
            ModelArgs.from_flavor(m.flavor, **applied)
        except (ValueError, TypeError):
            return f"'model.{key}' = {value!r} (flavor {m.flavor!r})"
    return f"[model] flavor={m.flavor!r} overrides={m.overrides}"


def with_document_eos(args: ModelArgs, eos_id: Optional[int]) -> ModelArgs:
    """``args`` with ``eos_id`` set to the tokenizer's `eos_id` under ``attn_mask_type = "block_causal"``
    when the config left it unset (the id that closes every packed document); otherwise ``args``."""
    if args.attn_mask_type == "block_causal" and args.eos_id is None and eos_id is not None:
        return dataclasses.replace(args, eos_id=eos_id)
    return args


def resolve_model_args(m, seq_len: int, n_vocab: Optional[int] = None,
                       tokenizer: str = "", eos_id: Optional[int] = None) -> ModelArgs:
    """Flavor ``m.flavor`` with the ``[model]`` overrides ``m.overrides``, and the defaults
    ``vocab_size = pad_vocab(n_vocab)`` (a multiple of 128),
    ``max_seq_len = max(flavor's, seq_len)`` and, under ``attn_mask_type = "block_causal"``,
    ``eos_id`` (the tokenizer's, which closes every packed document) unless the config sets them:
    ``sized_for_tokenizer`` of the tokenizer-free resolution. A job's config resolves that once
    (``config.parser.job_model_args``, which ``load_config`` fills); the trainer and the dry run size it.

    Args:
        m: the ``[model]`` section (``mhar_titan.config.Model``: ``flavor``, ``overrides``).
        seq_len: ``training.seq_len`` (tokens per sequence).
        n_vocab: the tokenizer's vocabulary size (special tokens included); None checks
            the rest with the flavor's ``vocab_size`` (the config parser does, without a tokenizer).
        tokenizer: the tokenizer's name, for the error message.
        eos_id: the tokenizer's EOS id (None leaves ``eos_id`` as the config sets it).

    Raises:
        ConfigError: unknown flavor or field, arguments ``ModelArgs`` rejects, a vocab_size
            below ``n_vocab``, or ``seq_len`` above an explicit max_seq_len.
    """
    overrides = dict(m.overrides)
    try:
        overrides.setdefault("max_seq_len", max(ModelArgs.from_flavor(m.flavor).max_seq_len, seq_len))
        args = ModelArgs.from_flavor(m.flavor, **overrides)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{_blamed_model_key(m, overrides)}: {e}") from e
    if seq_len > args.max_seq_len:
        raise ConfigError(
            f"'training.seq_len' ({seq_len}) exceeds 'model.max_seq_len' ({args.max_seq_len}); "
            f"lower it or set --model.max_seq_len={seq_len}"
        )
    return sized_for_tokenizer(args, m, n_vocab, tokenizer, eos_id)


def sized_for_tokenizer(args: ModelArgs, m, n_vocab: Optional[int], tokenizer: str = "",
                        eos_id: Optional[int] = None) -> ModelArgs:
    """``args`` (``resolve_model_args`` without a tokenizer) for the tokenizer: ``vocab_size =
    pad_vocab(n_vocab)`` unless ``[model]`` ``m`` sets it, and the tokenizer's ``eos_id`` under
    ``attn_mask_type = "block_causal"`` unless the config sets one (``with_document_eos``).
    ``n_vocab`` None (a Hugging Face tokenizer before its files are read) keeps the vocabulary.

    Raises:
        ConfigError: a vocab_size below ``n_vocab``, or arguments ``ModelArgs`` rejects with it.
    """
    try:
        if n_vocab is not None and "vocab_size" not in m.overrides:
            args = dataclasses.replace(args, vocab_size=pad_vocab(n_vocab))
        args = with_document_eos(args, eos_id)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{_blamed_model_key(m, dict(m.overrides))}: {e}") from e
    if n_vocab is not None and args.vocab_size < n_vocab:
        raise ConfigError(
            f"'model.vocab_size' ({args.vocab_size}) is smaller than tokenizer {tokenizer!r} "
            f"({n_vocab} tokens); set --model.vocab_size to at least {n_vocab} (a multiple of 128 is faster) "
            "or leave it unset"
        )
    return args
