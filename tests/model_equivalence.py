"""Whole-model equivalence across routing kernels and settings (shared by the equivalence matrix and
the GPU configs' CPU rehearsals).

A *combination* is a dict of `ModelArgs` fields (and ``ac``, the activation checkpointing mode).
`settings_axes` reads the values of every routing setting from `ModelArgs`' own schema (Literal and
bool fields take all their values; the few integer, real and free-text fields take the samples of
`SAMPLES`), so a new key or a new value of a Literal joins the matrix without anyone editing it.
`pairwise` covers every pair of values of every two axes with valid combinations (`ModelArgs`
decides validity). `check_combination` builds one small model with random, non-identity routing
parameters, runs forward and backward once per routing kernel the combination accepts, in fp64 and
fp32, on the same weights and batch, and compares the loss and every parameter's gradient with the
eager path in fp64; and KV-cache decoding logits with the full forward's.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import random
import typing
from types import SimpleNamespace

import torch

from mhar_titan.models.args import CONNECTION_KEYS, ModelArgs
from mhar_titan.models.kv_cache import KVCache
from mhar_titan.models.model import Transformer
from mhar_titan.parallel import apply_ac

SHAPE = dict(dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=48, vocab_size=96, max_seq_len=24)
"""The models' shape: 3 layers (a block of 2 layers then an open one), d = 32, 4 heads (2 KV)."""
EOS = 1
"""The EOS id of the batches (block_causal masks documents at it)."""

KERNELS = ("eager", "compile", "triton")
"""The routing kernels compared ("auto" is one of them on each device)."""

AXES_EXCLUDED = ("routing_kernel",)
"""Routing fields that are not an axis: the kernel is what every combination is compared across."""

SAMPLES: dict[str, tuple] = {
    "routing_heads": (1, 4, "kv"),
    "routing_block_layers": (1, 2),
    "routing_group_size": (1, 3),
    "routing_eps": (1e-6, 1e-3),
    "routing_head_layout_seed": (0, 5),
    "routing_logit_scale": (1.0, 0.5, "match_heads:4"),
    "dense_dilation": (1, 2),
    "dense_period": (1, 2),
}
"""Values of the routing fields whose type does not enumerate them (an int, a real, a string); a
Literal's values are added to these (routing_group_size's "auto")."""

EXTRA_FIELDS = ("attn_mask_type", "rope_per_document", *(k for keys in CONNECTION_KEYS.values() for k in keys))
"""Fields outside the routing prefix that change what the connections see (document masks) or
configure a connection (`args.CONNECTION_KEYS`)."""

AC_MODES = ("none", "full")
"""Activation checkpointing modes of the non-reference runs (a selective mode is a mix of both)."""

DEFAULTS = ModelArgs()
FP64_RTOL = 1e-9
FP32_RTOL = 2e-4


def _values(field: dataclasses.Field) -> tuple:
    """The values an axis takes: a Literal's, a bool's two, plus the field's `SAMPLES`."""
    hint = typing.get_type_hints(ModelArgs)[field.name]
    literal, plain = [], []
    for part in typing.get_args(hint) or (hint,):
        if typing.get_origin(part) is typing.Literal:
            literal += list(typing.get_args(part))
        else:
            plain.append(part)
    if typing.get_origin(hint) is typing.Literal:
        literal, plain = list(typing.get_args(hint)), []
    if hint is bool:
        return (False, True)
    if plain and field.name not in SAMPLES:
        raise KeyError(f"ModelArgs.{field.name} ({hint}) has values the type does not list: add samples for it to "
                       "tests/model_equivalence.py SAMPLES")
    return tuple(dict.fromkeys([*SAMPLES.get(field.name, ()), *literal]))


def settings_axes() -> dict[str, tuple]:
    """{field: its values} for every routing setting of `ModelArgs` (``residual``, every
    ``routing_*`` field but the kernel, the document-mask fields) and ``ac`` (the AC modes)."""
    axes = {}
    for field in dataclasses.fields(ModelArgs):
        if field.name in AXES_EXCLUDED:
            continue
        if field.name == "residual" or field.name.startswith("routing_") or field.name in EXTRA_FIELDS:
            axes[field.name] = _values(field)
    axes["ac"] = AC_MODES
    return axes


def model_args(combination: dict, kernel: str = "eager", shape: dict = SHAPE) -> ModelArgs:
    """The `ModelArgs` of `combination` (its ``ac`` left out) on `kernel`, at `shape`. Raises
    ValueError where `ModelArgs` refuses the combination."""
    fields = {k: v for k, v in combination.items() if k != "ac"}
    return ModelArgs(**shape, eos_id=EOS, routing_kernel=kernel, **fields)


INERT = {
    "routing_": lambda c: c["residual"] != "attn_res",
    **{key: (lambda residual: lambda c: c["residual"] != residual)(residual)
       for residual, keys in CONNECTION_KEYS.items() for key in keys},
    "routing_block_layers": lambda c: c.get("routing_granularity") == "sublayer",
    "routing_head_layout_seed": lambda c: c.get("routing_head_layout") == "contiguous",
}
"""Fields (a name, or a prefix ending in "_") that a combination ignores where the predicate holds:
only depth routing has routing fields, and each other connection its own keys
(`args.CONNECTION_KEYS`); sublayer granularity has no blocks, contiguous heads no permutation. Such
a field must keep its default there, so that no pair counts as covered by a combination that
ignores one of its values."""


def inert(combination: dict, name: str) -> bool:
    """Whether `combination` ignores field `name` (`INERT`)."""
    return any(name.startswith(key) if key.endswith("_") else name == key
               for key, ignores in INERT.items() if ignores(combination))


@functools.lru_cache(maxsize=None)
def _accepts(items: tuple, kernel: str) -> bool:
    try:
        model_args(dict(items), kernel)
    except ValueError:
        return False
    return True


def valid(combination: dict) -> bool:
    """Whether `ModelArgs` accepts `combination` and every field it ignores is at its default."""
    return canonical(combination) == combination and _accepts(tuple(combination.items()), "eager")


@functools.lru_cache(maxsize=None)
def _inert_keys(name: str) -> tuple[str, ...]:
    """The `INERT` keys that name field `name` (itself, or a prefix of it)."""
    return tuple(key for key in INERT if (name.startswith(key) if key.endswith("_") else name == key))


def canonical(combination: dict) -> dict:
    """`combination` with every field it ignores (`inert`) at `ModelArgs`' default."""
    ignored = {key for key, predicate in INERT.items() if predicate(combination)}
    return {k: getattr(DEFAULTS, k) if k != "ac" and not ignored.isdisjoint(_inert_keys(k)) else v
            for k, v in combination.items()}


def covered(combination: dict, axes: dict[str, tuple]) -> set:
    """What `combination` covers: for every routing kernel it accepts, (that kernel, a pair of
    (axis, value) it holds), its values among `axes`'. Covering these for every kernel makes the
    combinations each kernel runs hold every pair of values it accepts (a fault of one kernel under
    two settings, such as the fused kernels in the paper layout at block granularity, is found)."""
    held = [(n, repr(v)) for n, v in combination.items() if any(v == x and type(v) is type(x) for x in axes[n])]
    return {(kernel, pair) for kernel in kernels_of(combination) for pair in itertools.combinations(held, 2)}


STRUCTURE = ("residual", "routing_mode", "routing_null_source", "routing_layout", "routing_granularity",
             "routing_block_layers", "routing_group_size", "routing_head_layout", "routing_eps")
"""The axes whose values constrain each other (`ModelArgs` refuses some mixes: the paper layout
needs delta mode, null sources and routing eps = norm eps; grouping needs contiguous heads and the
clean layout; a connection's keys need it): `pairwise` takes every mix of them, so that valid
combinations of rare mixes are in its pool. The other axes are filled at random."""


def pairwise(axes: dict[str, tuple], seed: int = 0, completions: int = 2) -> list[dict]:
    """Valid combinations (dicts over every axis, `canonical`) that cover (`covered`), for every
    routing kernel, every pair of values of every two axes that some valid combination on that
    kernel holds. The pool: every mix of the `STRUCTURE` axes, each completed `completions` times
    with random values of the other axes, kept where valid; then, greedily, the pooled combination
    that covers the most of what no chosen one covers. A pair no pooled combination holds counts as
    impossible. Deterministic for a `seed`."""
    rng = random.Random(seed)
    names = list(axes)
    structure = [n for n in names if n in STRUCTURE]
    pool: dict[tuple, dict] = {}
    for mix in itertools.product(*(axes[n] for n in structure)):
        for _ in range(completions):
            combination = canonical({n: rng.choice(axes[n]) for n in names} | dict(zip(structure, mix)))
            key = tuple(combination.items())
            if key not in pool and valid(combination):
                pool[key] = combination
    coverage = {key: covered(c, axes) for key, c in pool.items()}
    uncovered = set().union(*coverage.values())
    chosen: list[dict] = []
    while uncovered:
        best = max(coverage, key=lambda key: len(coverage[key] & uncovered))  # the first of the best
        chosen.append(pool[best])
        uncovered -= coverage.pop(best)
    return chosen


def label(combination: dict) -> str:
    """The combination's fields that differ from `ModelArgs`' defaults, as ``key=value`` (its id)."""
    parts = [f"{k.removeprefix('routing_')}={v}" for k, v in combination.items()
             if k != "ac" and v != getattr(DEFAULTS, k)]
    return ",".join(parts + [f"ac={combination['ac']}"]) if parts or combination["ac"] != "none" else "baseline"


# -- one combination ------------------------------------------------------------------------------
def randomize(model: Transformer, seed: int = 0) -> None:
    """Move every routing parameter off its (identity) initialisation: zero pseudo-queries, unit key
    norms and zero gates and nulls hide wiring errors (a wrong source mixed at weight 0)."""
    if model.routing is None:
        return
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.routing.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype)
            if "norm" in name or name == "log_temperature":  # key norms, a connection's norm scales
                parameter.add_(0.3 * noise)
            else:
                parameter.copy_(0.6 * noise)


def reference_model(args: ModelArgs, seed: int = 0) -> Transformer:
    """The eager fp64 model of `args` with seeded weights and random routing parameters."""
    torch.manual_seed(seed)
    model = Transformer(dataclasses.replace(args, routing_kernel="eager"))
    model.init_weights()
    randomize(model, seed + 1)
    return model.to(torch.float64)


def copy_of(reference: Transformer, args: ModelArgs, dtype: torch.dtype, ac: str = "none") -> Transformer:
    """A model of `args` holding `reference`'s weights in `dtype`, its blocks under AC `ac`."""
    model = Transformer(args).to(dtype)
    model.load_state_dict({k: v.to(dtype) for k, v in reference.state_dict().items()})
    apply_ac(model, SimpleNamespace(mode=ac, selective_ac_option="1", preserve_rng_state=False))
    return model


def batch(length: int = 10, seed: int = 3) -> torch.Tensor:
    """(2, length) token ids with an EOS inside each row (two documents per row under block_causal)."""
    tokens = torch.randint(2, SHAPE["vocab_size"], (2, length), generator=torch.Generator().manual_seed(seed))
    tokens[0, 3], tokens[1, 6] = EOS, EOS
    return tokens


def loss_and_grads(model: Transformer, tokens: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The summed next-token loss of `tokens` and every parameter's gradient, by name (AC's wrapper
    prefix removed)."""
    named = [(n.replace("_checkpoint_wrapped_module.", ""), p) for n, p in model.named_parameters()]
    loss = model(tokens[:, :-1], tokens[:, 1:])
    grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
    return loss.detach(), {n: torch.zeros_like(p) if g is None else g for (n, p), g in zip(named, grads)}


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    """max |value - reference| over max |reference| (the absolute error where the reference is 0)."""
    scale = reference.abs().max().item()
    error = (value.double() - reference).abs().max().item()
    return error / scale if scale > 0 else error


def compare(what: str, result, reference, rtol: float) -> list[str]:
    """The failures of `result` (loss, grads) against `reference` within `rtol`, one line each."""
    (loss, grads), (ref_loss, ref_grads) = result, reference
    failures = []
    error = relative_error(loss, ref_loss)
    if not error <= rtol:
        failures.append(f"{what}: loss {loss.item():.12g} vs {ref_loss.item():.12g} (relative {error:.3g})")
    if grads.keys() != ref_grads.keys():
        failures.append(f"{what}: parameters {sorted(grads.keys() ^ ref_grads.keys())} differ")
    for name, ref in ref_grads.items():
        if name in grads:
            error = relative_error(grads[name], ref)
            if not error <= rtol:
                failures.append(f"{what}: grad {name} relative error {error:.3g} (largest entry "
                                f"{ref.abs().max().item():.3g})")
    return failures


def cached_logits(model: Transformer, tokens: torch.Tensor, prefill: int) -> torch.Tensor:
    """Logits (B, T, V) of `tokens` decoded with a KV cache: `prefill` tokens at once, then one at a
    time."""
    cache = KVCache(len(model.layers), [0] * tokens.shape[0], tokens.shape[1], model.args.max_seq_len)
    steps = [model(tokens[:, :prefill], cache=cache)]
    steps += [model(tokens[:, t:t + 1], cache=cache) for t in range(prefill, tokens.shape[1])]
    return torch.cat(steps, dim=1)


def kernels_of(combination: dict, kernels=KERNELS) -> list[str]:
    """The routing kernels among `kernels` that `ModelArgs` accepts for `combination`."""
    if combination["residual"] != "attn_res":  # the kernel is depth routing's: the others run one path
        return [kernel for kernel in kernels if kernel == "eager"]
    return [kernel for kernel in kernels if _accepts(tuple(combination.items()), kernel)]


FAST_RUNS = (("eager", torch.float32), ("triton", torch.float64))
"""The runs of the fast tier: the eager path in fp32, and the fused kernels in fp64 (where the
kernels differ from the eager path in their wiring, which fp64 shows to 1e-9)."""
SLOW_RUNS = (("triton", torch.float32), ("compile", torch.float32))
"""The runs of the slow tier: the fused kernels and the compiled routing body in fp32 (inductor
compiles the body per source count and dtype: in fp64 too it would double the tier's minutes for
the same wiring, which the fp32 bound already checks)."""


def check_combination(combination: dict, runs=FAST_RUNS + SLOW_RUNS, decode: tuple[str, ...] = ("eager", "triton"),
                      seed: int = 0, shape: dict = SHAPE) -> list[str]:
    """Every failure of `combination` (an empty list where it holds). For each (kernel, dtype) of
    `runs` whose kernel the combination accepts: the loss and every parameter's gradient against the
    eager fp64 model on the same weights and batch (fp64 within `FP64_RTOL`, fp32 within
    `FP32_RTOL`), under the combination's AC mode (the eager fp64 run too, where AC is on). For each
    kernel of `decode` it accepts: the fp64 logits of KV-cache decoding against the full forward's
    within `FP64_RTOL`. `shape`: the model's shape fields (`SHAPE`'s by default)."""
    args = model_args(combination, shape=shape)
    reference = reference_model(args, seed)
    tokens = batch()
    expected = loss_and_grads(reference, tokens)
    accepted = kernels_of(combination)
    runs = list(runs) + ([("eager", torch.float64)] if combination["ac"] != "none" else [])
    failures = []
    for kernel, dtype in runs:
        if kernel not in accepted:
            continue
        model = copy_of(reference, dataclasses.replace(args, routing_kernel=kernel), dtype, combination["ac"])
        rtol = FP64_RTOL if dtype == torch.float64 else FP32_RTOL
        failures += compare(f"{kernel} {str(dtype).removeprefix('torch.')}", loss_and_grads(model, tokens),
                            expected, rtol)
    with torch.no_grad():
        full = reference(tokens) if decode else None
        for kernel in (k for k in decode if k in accepted):
            model = reference if kernel == "eager" else copy_of(
                reference, dataclasses.replace(args, routing_kernel=kernel), torch.float64)
            error = relative_error(cached_logits(model, tokens, tokens.shape[1] - 3), full)
            if not error <= FP64_RTOL:
                failures.append(f"{kernel} KV-cache logits: relative error {error:.3g}")
    return failures
