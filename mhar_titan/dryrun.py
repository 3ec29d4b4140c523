"""Dry run: check a job before spending GPUs on it.

    python -m mhar_titan.dryrun --config train_configs/mhar_1b.toml --world-size 16 [--section.key=value ...]

Loads and validates the whole config (every section, the model arguments, batch
geometry for the given world size), builds the model on the meta device (no
parameter memory is allocated), prints parameter counts, a per-rank memory
estimate, whether it fits (in ``--memory-gib`` GiB per rank, else in this machine's
memory for the device when it has one: ``mhar_titan.components.memory``, the check the
trainer makes before building the model) and the resolved config, and exits: 0 when the
job is valid, 2 with one line naming the bad key otherwise, or saying "does not fit"
(with ``training.memory_check = "warn"`` it says so and exits 0): the exit code train.py gives
the same job, since the dry run makes train.py's start-up checks (``validate_job``). The last line says what
was checked: ``dry run: OK`` only when everything was; a valid job with a check that could
not be made (the memory fit: no such device here and no ``--memory-gib``, or
``training.memory_check = "off"``; the tokenizer: its files not cached, or a Hugging Face
folder) ends ``dry run: config valid, nothing trained; NOT checked: memory fit (why); ...``.
It opens no data file, stream or network connection; the tokenizer is only checked when its
files are already cached.

Memory estimate (bytes per rank; W data-parallel ranks, FSDP2 over all of them;
c = compute bytes: 2 for bf16 on CUDA, 4 for fp32 on CPU; b x T tokens per micro-batch):

    sharded state      16 N / W        fp32 params 4, grads 4, AdamW exp_avg + exp_avg_sq 8
                                       (optimizer.name = "Muon": its matrices' momentum 4 instead
                                       of 8, plus the largest matrix's gathered update and
                                       Newton-Schulz buffers, 4 x its size in that dtype, unsharded)
                                       (+ 4 N / W for the weight EMA, training.ema_decay > 0)
    gathered params    (2 P_block + P_root) c    two blocks in flight (current + prefetch)
                                                 and the root unit (embedding, routing, norms);
                       N c                       with fsdp_reshard_after_forward = "never"
    unsharded grads    (P_block + P_root) 4      before reduce-scatter (fp32 reduce)
    activations        b T [ sum over blocks (a_layer + keys) or, checkpointed, k
                             + one recomputed block + final keys ] c
    loss path          training.loss_path (models.cross_entropy.loss_path_bytes):
                       plain   b T V (c + 8)   logits (c) and fp32 log-probabilities and their gradient
                       chunked n V 12 + 4 V d + 4 b T   one chunk of n = min(loss_chunk_tokens, b T)
                                                        tokens (fp32 logits, probabilities, gradient),
                                                        the fp32 head-weight gradient, the fp32 lse

with, per token and layer, in elements of the compute dtype,

    a_layer = (5 d + 3 d_kv) attention (input, its norm, q, k, v, normed q/k, SDPA output)
            + (2 d + 4 f)    SwiGLU MLP (input, its norm, gate, up, silu(gate), product)
            + 2 d            the two sublayer outputs kept as depth-routing sources (attn_res)

a checkpointed block keeps only its outputs (k = 2 d routing sources, or d for the baseline)
and one block is recomputed at a time; eager/compile routing (and "auto" on CPU) also saves
the RMS-normalised keys of its sources at every site: one d row per (B, T, d) source the
routing plan lists for the site (s d at site s = 1..S, S = 2L + 1, for sublayer routing)
(S (S + 1) d / 2 in all without checkpointing; the Triton kernel saves none). Which one runs is
planned for the target, not read from this machine (`components.performance.planned_routing`):
a CUDA job plans the fused kernels for routing_kernel "auto" or "triton" where one token's tile
fits, whether or not triton is installed where the dry run runs; a CPU job plans what the trainer
runs on this machine. The dry run prints the path and why ("routing: ..."), and what the estimate
covers beside the trainer's own fit check (the same formula, for the device the trainer runs on).
Delta mode is estimated like replacement.
This is a rough planning number (it ignores allocator fragmentation, NCCL
buffers, CUDA context and temporary workspaces): leave 15-25 % headroom.
"""
from __future__ import annotations

import dataclasses
import math
import pathlib
import re
import sys
from dataclasses import dataclass
from typing import Optional

import torch

from mhar_kernels import dispatch
from mhar_titan.cli_args import ArgumentParser, positive_float, positive_int, run_command
from mhar_titan.components import performance
from mhar_titan.components.batches import batch_geometry
from mhar_titan.components.cuda_graphs import capture_blockers, check_cuda_graphs
from mhar_titan.components.memory import MemoryFitError, available_memory, check_memory_fit
from mhar_titan.components.run_folder import RunFolder
from mhar_titan.components.performance import (HOST_STEP_MS, MODEL_BANDWIDTH, MODEL_MFU, depth_read_bytes,
                                               planned_routing, routing_step_bytes, step_verdict)
from mhar_titan.config import ConfigError, JobConfig, load_config, to_toml
from mhar_titan.config.parser import job_model_args
from mhar_titan.data.tokenizer import HF_PREFIX, tokenizer_n_vocab
from mhar_titan.errors import UserError
from mhar_titan.files import check_output_folder
from mhar_titan.metrics import flops_per_token
from mhar_titan.models.args import ModelArgs, count_parameters, family_name, routing_settings, sized_for_tokenizer
from mhar_titan.models.connections import build_connection
from mhar_titan.models.connections.base import checkpointed_blocks
from mhar_titan.models.cross_entropy import loss_path_bytes
from mhar_titan.models.model import Transformer
from mhar_titan.models.plan import RoutingPlan
from mhar_titan.optim import describe_split, muon_comm_bytes, optimizer_split, resolved_ns_dtype, schedule_warnings

GIB = 2**30
FIT_NOT_CHECKED = "memory fit not checked"
"""How the warning starts that `report` adds when it could not check the memory fit."""
NOT_CHECKED = re.compile(r"^(memory fit|tokenizer( '[^']*')?) not checked\b")
"""A warning saying a check could not be made (the memory fit, the tokenizer): "<what> not checked ..."."""


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-rank memory in bytes (see the module docstring for the formula)."""

    params: int
    grads: int
    optimizer: int
    gathered_params: int
    unsharded_grads: int
    activations: int
    loss_path: int

    @property
    def total(self) -> int:
        return sum(dataclasses.astuple(self))


def build_model_args(cfg: JobConfig) -> ModelArgs:
    """The ``ModelArgs`` the trainer builds: the config's (``config.parser.job_model_args``, resolved
    once when it was loaded) sized for the tokenizer's vocabulary from ``data.tokenizer.N_VOCAB``
    (no file is read).

    Raises:
        ConfigError: unknown tokenizer or flavor, or arguments the trainer would reject.
    """
    return sized_for_tokenizer(job_model_args(cfg), cfg.model, tokenizer_n_vocab(cfg.data.tokenizer), cfg.data.tokenizer)


def validate_job(cfg: JobConfig, args: ModelArgs, world_size: int, device: str = "cuda") -> list[str]:
    """Checks that need the world size or the model arguments, for ranks of ``device``: those of
    ``train.check_config`` (the run folder can be written, batch geometry, CUDA graphs), so that
    a job train.py refuses with exit 2 the dry run refuses with exit 2, and more (every section
    again, the FSDP degree, data files, the tokenizer when cached); returns warnings.

    Raises:
        ConfigError: naming the first invalid key.
        UserError: the run folder cannot be created or written (``files.OutputFolderError``).
    """
    if world_size < 1:
        raise ConfigError(f"--world-size must be >= 1, got {world_size}")
    # Section dataclasses validate in __post_init__ or validate(); load_config sets fields
    # one by one, so run those checks again on the final values.
    for f in dataclasses.fields(cfg):
        section = getattr(cfg, f.name)
        try:
            type(section)(**{k.name: getattr(section, k.name) for k in dataclasses.fields(section)})
            if hasattr(section, "validate"):
                section.validate()
        except (ValueError, TypeError, RuntimeError) as e:
            raise ConfigError(f"[{f.name}]: {e}") from e
    degree = cfg.parallelism.data_parallel_shard_degree
    if degree not in (-1, world_size):
        raise ConfigError(
            f"'parallelism.data_parallel_shard_degree' = {degree} but the job has {world_size} ranks; "
            "use -1 (all ranks) or the world size"
        )
    batch_geometry(cfg.training, world_size)
    # the settings a CUDA graph cannot capture (a GPU job is checked as one wherever the dry run runs)
    check_cuda_graphs(cfg, args, cuda_available=device == "cuda")
    # as train.py does before anything is built: every folder the run writes exists or can be created, and is writable
    RunFolder(cfg).check_writable()
    warnings = []
    if not cfg.data.is_mixture and cfg.data.source in ("local", "pretokenized") and not cfg.data.files:
        raise ConfigError(f"'data.files' is empty but data.source = {cfg.data.source!r}; list the training files")
    warnings += _check_tokenizer(cfg, args)
    return warnings + schedule_warnings(cfg.lr_scheduler, cfg.training.steps)


def _check_tokenizer(cfg: JobConfig, args: ModelArgs) -> list[str]:
    """vocab_size >= the tokenizer's vocabulary, when its files are cached locally (never downloads)."""
    try:
        from mhar_titan.data.tokenizer import ENCODING_FILES, build_tokenizer, check_cache, resolve_cache_dir
    except ImportError as e:  # pragma: no cover - data stack missing
        return [f"tokenizer not checked: {e}"]
    name = cfg.data.tokenizer
    if name.startswith(HF_PREFIX):  # the dry run reads no model folder
        return [f"tokenizer {name!r} not checked: a Hugging Face folder's tokenizer is read when training starts "
                f"(model.vocab_size = {args.vocab_size} must cover it)"]
    if name not in ENCODING_FILES:
        raise ConfigError(f"'data.tokenizer' = {name!r} is unknown; valid: {', '.join(ENCODING_FILES)}")
    try:
        if cfg.data.tokenizer_file is None:
            check_cache(name, resolve_cache_dir(cfg.data))
        tok = build_tokenizer(cfg.data)
    except Exception as e:  # missing or unverified local files: the run would fail the same way
        return [f"tokenizer {name!r} not checked: {e}"]
    if tok.n_vocab > args.vocab_size:
        raise ConfigError(
            f"model vocab_size {args.vocab_size} is smaller than tokenizer {name!r} ({tok.n_vocab} tokens); "
            f"set --model.vocab_size to at least {tok.n_vocab} (a multiple of 128 is faster)"
        )
    return []


def build_meta_model(args: ModelArgs) -> Transformer:
    """The model on the meta device: shapes only, no parameter storage."""
    with torch.device("meta"):
        return Transformer(args)


def ac_mode(cfg: JobConfig) -> str:
    """The job's activation checkpointing as the connections' cost model spells it
    (`models.connections.base.checkpointed_blocks`): "none", "full" or "selective:k"."""
    ac = cfg.activation_checkpoint
    return ac.mode if ac.mode in ("none", "full") else f"selective:{int(ac.selective_ac_option)}"


def _activation_elements_per_token(args: ModelArgs, cfg: JobConfig, device: str,
                                   routing: Optional[str] = None) -> float:
    """Saved activations per token in elements (module docstring); blocks checkpointed as in parallel.apply_ac.

    The baseline's blocks, plus what the depth connection keeps beyond them
    (`Connection.kept_rows`, rows of d: depth routing's sources, DenseFormer's history, MUDDFormer's
    streams), plus the normalised keys eager routing saves: the routing sites, the layer each
    belongs to and the (B, T, d) sources each reads come from the routing plan; the keys are saved
    unless `routing` (default: `mhar_kernels.dispatch.backend`'s choice for `device` on this
    machine) is "triton"."""
    d, f = args.dim, args.ffn_dim
    d_kv = args.n_kv_heads * args.head_dim
    plan = RoutingPlan.from_args(args)
    layer = (5 * d + 3 * d_kv) + (2 * d + 4 * f)
    if routing is None:
        routing = dispatch.backend(args.routing_kernel, device, d, args.resolved_routing_heads)
    saves_keys = plan.final is not None and routing != "triton"

    def keys(sites) -> int:  # normalised keys saved by these routing sites: one row per (B, T, d) source read
        if not saves_keys:
            return 0
        return sum(d for site in sites for j in site.reads if plan.sources[j].kind != "null")

    mode = ac_mode(cfg)
    total, recompute = 0, 0
    for i, checkpointed in enumerate(checkpointed_blocks(mode, args.n_layers)):
        inside = layer + keys(plan.sites[2 * i: 2 * i + 2])  # attention site, then MLP site of layer i
        if checkpointed:
            total += d  # what a checkpointed block leaves behind: its output
            recompute = max(recompute, inside)  # one block is recomputed at a time
        else:
            total += inside
    connection = build_connection(args).kept_rows(mode) * d
    return total + recompute + keys(plan.sites[2 * args.n_layers:]) + connection  # + the final routing site


def _optimizer_bytes(model: Transformer, cfg: JobConfig, world_size: int, device: str) -> int:
    """Optimizer state per rank: AdamW's two fp32 moments (8 B per parameter) and Muon's fp32 momentum
    (4 B per matrix element), sharded over the ranks, plus, unsharded on every rank, the whole update
    of the largest Muon matrix and the Newton-Schulz work buffers (about 4 of its size in the
    Newton-Schulz dtype)."""
    split = optimizer_split(model, cfg.optimizer)
    adamw = sum(math.prod(s) for _, s in split["AdamW"])
    muon = sum(math.prod(s) for _, s in split["Muon"])
    sharded = (8 * adamw + 4 * muon) // world_size
    if not muon:
        return sharded
    largest = max(math.prod(s) for _, s in split["Muon"])
    return sharded + 4 * largest * (2 if resolved_ns_dtype(cfg.optimizer, device) == "bfloat16" else 4)


def estimate_memory(model: Transformer, cfg: JobConfig, world_size: int, device: str,
                    routing: Optional[str] = None) -> MemoryEstimate:
    """Per-rank bytes for ``model`` (meta) trained with ``cfg`` on ``world_size`` ranks of ``device``.

    ``device`` is "cuda" (compute in ``training.mixed_precision_param``) or "cpu" (fp32).
    ``routing``: the routing implementation the ranks run ("eager", "compile", "triton"); None:
    what runs on ``device`` here (`mhar_kernels.dispatch.backend`, the trainer's own fit check at
    start-up); the dry run passes the planned one (`components.performance.planned_routing`).
    """
    args: ModelArgs = model.args
    c = 4 if device == "cpu" or cfg.training.mixed_precision_param == "float32" else 2
    n = sum(p.numel() for p in model.parameters())
    p_block = max(sum(p.numel() for p in layer.parameters()) for layer in model.layers)
    p_root = n - sum(p.numel() for p in model.layers.parameters())
    tokens = cfg.training.local_batch_size * cfg.training.seq_len
    act = tokens * _activation_elements_per_token(args, cfg, device, routing) * c
    t = cfg.training
    loss = loss_path_bytes(tokens, args.vocab_size, args.dim, c, t.loss_path, t.loss_chunk_tokens)
    return MemoryEstimate(
        params=4 * n // world_size,
        grads=4 * n // world_size,
        optimizer=_optimizer_bytes(model, cfg, world_size, device)
        + (4 * n // world_size if cfg.training.ema_decay > 0 else 0),  # (+ weight EMA)
        gathered_params=(n if cfg.parallelism.fsdp_reshard_after_forward == "never" else 2 * p_block + p_root) * c,
        unsharded_grads=(p_block + p_root) * 4,
        activations=int(act),
        loss_path=loss,
    )


def optimizer_lines(model: Transformer, cfg: JobConfig, world_size: int, device: str) -> list[str]:
    """Which parameters each optimizer updates (``optim.optimizer_split``) and, for Muon, the
    modelled all-gather bytes per step and rank (``optim.muon_comm_bytes``)."""
    o = cfg.optimizer
    split = optimizer_split(model, o)
    lines = [f"optimizer: {o.name}" + (" (Muon for the matrices of optimizer.muon_groups, AdamW for the rest)"
                                       if o.name == "Muon" else "")]
    lines += [f"  {line}" for line in describe_split(split)]
    if split["Muon"]:
        dtype = resolved_ns_dtype(o, device)
        comm = muon_comm_bytes([s for _, s in split["Muon"]], world_size, dtype)
        lines.append(f"  Muon communication: all-gather of every matrix's update in {dtype}, {comm / 2**20:,.1f} MiB "
                     f"received per rank per step on {world_size} FSDP ranks (modelled: numel x (W - 1) / W x "
                     f"{2 if dtype == 'bfloat16' else 4} B); Newton-Schulz {o.muon_ns_steps} steps, redundant on "
                     "every rank")
    return lines


def verdict(warnings: list[str]) -> str:
    """What a valid job's dry run checked, from `report`'s warnings (the last line of the dry run,
    after "dry run: "): "OK (nothing was trained)" only when every check ran; "config valid,
    nothing trained; NOT checked: <what> (<why>); ..." when a check could not be made
    (`NOT_CHECKED`); "does not fit (...)" when the estimate exceeds the memory and
    training.memory_check = "warn"."""
    unchecked = [w for w in warnings if NOT_CHECKED.match(w)]
    if any(w.startswith("the job does not fit") for w in warnings):
        return "does not fit (training.memory_check = \"warn\": the trainer would start anyway)"
    if unchecked:
        return "config valid, nothing trained; NOT checked: " + "; ".join(
            w.replace(" not checked", "", 1) for w in unchecked)
    return "OK (nothing was trained)"


def report(cfg: JobConfig, world_size: int, device: str,
           available: Optional[tuple[int, str]] = None) -> tuple[str, list[str]]:
    """The dry-run text and its warnings.

    Args:
        available: (bytes per rank, where the number comes from) to check the estimate against
            (``components.memory.check_memory_fit`` with ``training.memory_check``); None: not checked.

    Raises:
        ConfigError: the job is invalid (the message names the key).
        MemoryFitError: the estimate exceeds ``available`` and training.memory_check is "error"
            (the message says "does not fit", by how much and what to lower).
    """
    args = build_model_args(cfg)
    warnings = validate_job(cfg, args, world_size, device)
    model = build_meta_model(args)
    if any(not p.is_meta for p in model.parameters()):
        raise RuntimeError("the model allocated parameter storage outside the meta device")
    built = sum(p.numel() for p in model.parameters())
    counts = count_parameters(args)
    if built != counts.total:
        raise RuntimeError(
            f"parameter count of the built model ({built:,}) differs from count_parameters ({counts.total:,}): "
            "mhar_titan.models is inconsistent"
        )
    planned = planned_routing(args, device)  # the routing the target's ranks run, not what this machine has
    routing = planned[1] if planned is not None else None
    mem = estimate_memory(model, cfg, world_size, device, routing)
    _, accum = batch_geometry(cfg.training, world_size)
    t = cfg.training
    family = {"standard": "baseline",
              "attn_res": "AttnRes" if args.resolved_routing_heads == 1 else f"MHAR (H={args.resolved_routing_heads})",
              }.get(args.residual) or family_name(args)
    if args.residual == "attn_res" and args.routing_mode == "delta":
        family += f", delta, {args.routing_layout} layout"
    lines = [
        f"job: {cfg.job.name} -> {cfg.job.dump_folder}/{cfg.job.name}",
        f"model: flavor={cfg.model.flavor} {family} d={args.dim} L={args.n_layers} heads={args.n_heads}/"
        f"{args.n_kv_heads} ffn={args.ffn_dim} vocab={args.vocab_size} routing_kernel={args.routing_kernel}"
        + _routing_runs(args, device),
        *([f"routing: the {planned[1]} path on {device} ranks ({planned[2]})"] if planned is not None else []),
        *([f"routing settings: {', '.join(routing_settings(args))}"] if routing_settings(args) else []),
        "parameters (built on the meta device, equal to count_parameters):",
        f"  total           {counts.total:>15,}",
        f"  non-embedding   {counts.non_embedding:>15,}",
        f"  embedding       {counts.total - counts.non_embedding:>15,}",
        f"  connection      {counts.routing:>15,}  (models.args.connection_parameters)",
        *connection_lines(cfg, args, device, mem.activations),
        f"batch: {world_size} ranks x local {t.local_batch_size} x grad accumulation {accum} = "
        f"{world_size * t.local_batch_size * accum} sequences x {t.seq_len} tokens "
        f"= {world_size * t.local_batch_size * accum * t.seq_len:,} tokens per step",
        *optimizer_lines(model, cfg, world_size, device),
        f"memory estimate per rank ({device}, {_compute_dtype(cfg, device)} compute, "
        + (f"routing {routing}, " if routing is not None else "")
        + f"{world_size} FSDP ranks, activation checkpointing {cfg.activation_checkpoint.mode}; formula in "
        "mhar_titan/dryrun.py):",
    ]
    for name, value in dataclasses.asdict(mem).items():
        lines.append(f"  {name:<16}{value / GIB:>10.2f} GiB")
    lines.append(f"  {'total':<16}{mem.total / GIB:>10.2f} GiB")
    lines.append(f"  {'covers':<16}the trainer's own fit check (components/memory.py) makes this estimate at start-up "
                 "for the device it runs on (a CPU run: fp32 compute and the routing that runs there, the number of "
                 "--device cpu); neither counts allocator fragmentation, NCCL buffers or the CUDA context")
    if available is None:
        why = f"no {device} device here: pass --memory-gib, the memory per rank"
        lines.append(f"  fit             not checked ({why})")
        warnings.append(f"{FIT_NOT_CHECKED} ({why})")
    elif cfg.training.memory_check == "off":
        lines.append("  fit             not checked (training.memory_check = \"off\")")
        warnings.append(f"{FIT_NOT_CHECKED} (training.memory_check = \"off\")")
    else:
        warning = check_memory_fit(mem, available[0], available[1], cfg)  # raises for "error"
        if warning is not None:
            warnings.append(warning)
        lines.append(f"  fit             {'does not fit' if warning else 'fits'} in {available[0] / GIB:.2f} GiB "
                     f"({available[1]})")
    if device == "cuda":
        lines += step_time_lines(cfg, args, world_size, accum)
    lines += mixture_lines(cfg, world_size, accum)
    lines += ["resolved config:", to_toml(cfg)]
    return "\n".join(lines), warnings


def connection_lines(cfg: JobConfig, args: ModelArgs, device: str, activations: int) -> list[str]:
    """What the depth connection costs per token beyond the baseline, from its cost model
    (`models.connections.base.Connection`: `flops_per_token`, `depth_reads`, `kept_rows`,
    `state_rows`): FLOPs, the rows of its depth history it reads and their bytes per micro-batch
    step, the bytes the step moves for it (`components.performance.routing_step_bytes`), the rows it
    keeps for the backward (in the memory estimate's activations) and, for a multi-stream
    connection, the bytes of its n-stream state among them and their share of `activations` (the
    memory estimate's, bytes per rank)."""
    connection = build_connection(args)
    t, mode = cfg.training, ac_mode(cfg)
    forward, backward = connection.depth_reads()
    if (forward, backward) == (0, 0) and not connection.flops_per_token():
        return [f"depth connection: residual = {args.residual!r}, nothing beyond the blocks' own"]
    tokens = t.local_batch_size * t.seq_len
    c = 4 if device == "cpu" or t.mixed_precision_param == "float32" else 2
    flops = flops_per_token(args, t.seq_len)
    kept = connection.kept_rows(mode)
    recomputed = sum(checkpointed_blocks(mode, args.n_layers))
    again = f", the forward's again for the {recomputed} recomputed blocks" if recomputed else ""
    return [
        f"depth connection: residual = {args.residual!r}, modelled per token beyond the baseline "
        "(models/connections/, docs/CONNECTIONS.md):",
        f"  FLOPs           {connection.flops_per_token():>15,} forward; {3 * connection.flops_per_token():,} per "
        f"trained token, {100 * flops.routing / flops.total:.2f}% of the step's (metrics.flops_per_token)",
        f"  depth reads     {forward:>15,} forward + {backward:,} backward rows of d; "
        f"{depth_read_bytes(args, tokens, mode) / 1e9:,.2f} GB per micro-batch step of {t.local_batch_size} x "
        f"{t.seq_len} tokens in bf16{again}",
        f"  step bytes      {routing_step_bytes(args, tokens, mode) / 1e9:>15,.2f} GB per micro-batch step "
        "(components/performance.py: the fused routing kernels' counted traffic for depth routing, the depth "
        "reads otherwise)",
        f"  kept rows       {kept:>15,} rows of d beyond the baseline's under AC {mode}: "
        f"{kept * args.dim * tokens * c / GIB:,.2f} GiB per rank at {c} B per value (in the activations below)",
        *_stream_state_lines(connection.state_rows(mode), args.dim, tokens, c, mode, activations),
    ]


def _stream_state_lines(rows: int, d: int, tokens: int, c: int, mode: str, activations: int) -> list[str]:
    """The n-stream state's line (none for a connection of one stream): its `rows` of d per token
    kept for the backward under AC `mode`, in bytes per rank and as a share of the activations."""
    if not rows:
        return []
    where = ("every block's input H, n rows where the baseline keeps its one stream" if mode == "full"
             else "every sublayer site's H")
    state = rows * d * tokens * c
    return [f"  stream state    {rows:>15,} rows of d of the n x d state H kept for the backward under AC {mode} "
            f"({where}; the read-out's): {state / GIB:,.2f} GiB per rank, "
            f"{100 * state / activations:.0f}% of the activation estimate ({activations / GIB:,.2f} GiB)"]


def _compute_dtype(cfg: JobConfig, device: str) -> str:
    """The dtype `estimate_memory` counts activations in: fp32 on CPU, else training.mixed_precision_param."""
    return "float32" if device == "cpu" else cfg.training.mixed_precision_param


def _routing_runs(args: ModelArgs, device: str) -> str:
    """`` (runs eager on cpu)`` where the routing kernel asked for is not what the ranks of
    ``device`` run (`components.performance.planned_routing`), else ``""``."""
    planned = planned_routing(args, device)
    return "" if planned is None or planned[0] == planned[1] else f" (runs {planned[1]} on {device})"


def step_time_lines(cfg: JobConfig, args: ModelArgs, world_size: int, accum: int,
                    host_ms: Optional[dict] = None) -> list[str]:
    """The host-vs-GPU verdict of one micro-batch step of a CUDA job (`performance.step_verdict`:
    the measured host time of the flavor, family and AC mode beside the modelled H200 time) and,
    when the step is host-bound, what to change. Not modelled where the measured host times do
    not describe the job: routing on another path than the fused kernels they were measured on
    (`performance.planned_routing`), or CUDA graphs (training.cuda_graphs = true: the micro-batch
    replays as one launch; its remaining host work was not measured). host_ms: the measured host
    times (default `performance.HOST_STEP_MS`)."""
    t, ac = cfg.training, cfg.activation_checkpoint.mode
    head = f"step time per micro-batch ({t.local_batch_size} x {t.seq_len} tokens, AC {ac}; model in " \
        "mhar_titan/components/performance.py):"
    if t.cuda_graphs:
        return [head, "  not modelled: training.cuda_graphs = true replays each micro-batch's forward and backward as "
                "one graph launch; the host times (bench/step_host.py) were measured without graphs and the host work "
                "left (clipping, optimizer step) was not measured"]
    planned = planned_routing(args, "cuda")
    if planned is not None and planned[1] != "triton":
        return [head, f"  not modelled: the host times (bench/step_host.py) were measured on the fused Triton routing "
                f"path; this job routes on the {planned[1]} path ({planned[2]}), whose host time was not measured"]
    v = step_verdict(cfg.model.flavor, args, ac, t.local_batch_size, t.seq_len, accum, world_size, host_ms)
    if v is None:
        measured = sorted({k[0] for k in (host_ms if host_ms is not None else HOST_STEP_MS)})
        family = performance.host_family(args)
        return [head, f"  not modelled: no measured host time for flavor {cfg.model.flavor!r}, "
                f"{family or family_name(args)} with AC {ac!r} (bench/step_host.py measured "
                f"{', '.join(measured) or 'none'}: the baseline and depth routing, AC none and full)"]
    lines = [head,
             f"  host            {v['host_ms']:>8.1f} ms  measured (bench/step_host.py, launches stubbed, shared CPU: "
             "an upper bound)",
             f"  GPU             {v['gpu_ms']:>8.1f} ms  modelled (H200, {100 * MODEL_MFU:.0f}% MFU, routing bytes at "
             f"{MODEL_BANDWIDTH / 1e12:.1f} TB/s)"]
    if v["bound"] == "GPU-bound":
        return lines + [f"  verdict         GPU-bound by {v['by']:.2f}x: the host keeps ahead of the GPU"]
    lines.append(f"  verdict         host-bound by {v['by']:.2f}x: the GPU waits for the host")
    global_batch = world_size * t.local_batch_size * accum
    split = (f"training.local_batch_size = {v['local_batch']} with gradient accumulation {v['accumulation']} "
             f"(the same global batch of {global_batch} sequences)")
    # graphs are advised only as the check that refuses them would take them (capture_blockers)
    blockers = capture_blockers(cfg, args)
    graphs = ("CUDA graphs (training.cuda_graphs = true)" if not blockers else
              "CUDA graphs once this job can be captured (training.cuda_graphs = true refuses it today: "
              + "; ".join(blockers) + ")")
    if v["local_batch"] is not None and v["covers"]:
        lines.append(f"  to change       {split}, or {graphs}")
    elif v["local_batch"] is not None:
        lines.append(f"  to change       {split}: still host-bound by {v['then_by']:.2f}x (the largest local batch "
                     f"that keeps the global batch), or {graphs}, or a larger global batch")
    else:
        lines.append(f"  to change       {graphs} (no larger local batch keeps the global batch of {global_batch} "
                     f"sequences at {world_size} ranks: the gradient accumulation is {accum}), or a larger global "
                     "batch")
    if v["local_batch"] is not None:
        lines.append("  (a larger local batch needs more activation memory: dry-run it with the override)")
    return lines


def mixture_lines(cfg: JobConfig, world_size: int, accum: int) -> list[str]:
    """The data mixture of the job (none for one source): per source its weight, its training and
    validation files (local patterns with the number of paths they match here; no file is
    opened) and the tokens it gives the planned ``training.steps`` (the draws of
    ``data.mixture.planned_source_windows``, exact for infinite data)."""
    specs = cfg.data.mixture()
    if not specs:
        return []
    import glob

    from mhar_titan.data.mixture import planned_source_windows

    t, d = cfg.training, cfg.data
    seed = d.seed if d.seed is not None else cfg.debug.seed
    windows = planned_source_windows([m.weight for m in specs], seed=seed, sharding=d.sharding, dp_world=world_size,
                                     num_workers=d.num_workers, local_batch_size=t.local_batch_size,
                                     batches=t.steps * accum)
    total = int(windows.sum()) * t.seq_len

    def files(patterns: list[str], source: str) -> str:
        if not patterns:
            return "none"
        if source == "hub":
            return ", ".join(patterns) + " (in the hub repository)"
        found = sum(len(glob.glob(p)) if glob.has_magic(p) else int(pathlib.Path(p).exists()) for p in patterns)
        return f"{', '.join(patterns)} ({found} path{'s' * (found != 1)} here)"

    lines = [f"data mixture: {len(specs)} source(s), {d.sharding} sharding, seed {seed}; tokens over the planned "
             f"{t.steps:,} steps ({total:,} in all):"]
    for m, n in zip(specs, windows.tolist()):
        what = (f"hub {m.data.hub_path}" + (f" ({m.data.hub_name})" if m.data.hub_name else "")
                if m.data.source == "hub" else m.data.source)
        lines += [f"  {m.name:<12} weight {m.weight:.4f}  tokens {n * t.seq_len:>18,} "
                  f"({n * t.seq_len / max(1, total):.2%})  {what}",
                  f"  {'':<12} train: " + (files(m.data.files, m.data.source) if m.data.source != "hub" else
                                           files(m.data.hub_data_files, "hub") if m.data.hub_data_files else
                                           f"the files of {m.data.hub_name or 'the default'} configuration, split "
                                           f"{m.data.hub_split}, less the validation files"),
                  f"  {'':<12} validation: {files(m.data.validation_files, m.data.source)}"]
    return lines


def _available(known) -> Optional[tuple[int, str]]:
    """The memory per rank to check against: --memory-gib, else this machine's for the device."""
    if known.memory_gib is not None:
        return int(known.memory_gib * GIB), "--memory-gib"
    if known.device == "cuda" and not torch.cuda.is_available():
        return None
    return available_memory(torch.device("cuda:0" if known.device == "cuda" else "cpu"))


def main(argv: Optional[list[str]] = None) -> int:
    parser = ArgumentParser(
        prog="python -m mhar_titan.dryrun",
        description="Validate a job config, build the model on the meta device, print parameter counts, "
        "a memory estimate and the resolved config. Opens no data and no network connection.",
        epilog="Other arguments are --section.key=value overrides, as for train.py.",
    )
    parser.add_argument("--config", "--job.config_file", dest="config", required=True, help="TOML job file")
    parser.add_argument("--world-size", type=positive_int, default=1, help="data-parallel ranks of the planned job")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="device the estimate is for (default cuda: bf16 compute as configured)")
    parser.add_argument("--memory-gib", type=positive_float, default=None,
                        help="memory per rank of the planned machine in GiB, checked against the estimate "
                             "(default: this machine's, when it has the device: free memory of cuda:0, or "
                             "the host's available memory for cpu)")
    known, overrides = parser.parse_known_args(argv)
    try:
        cfg = load_config(known.config, overrides)
        text, warnings = report(cfg, known.world_size, known.device, _available(known))
    except MemoryFitError as e:
        print(f"dry run: {e}", file=sys.stderr)
        return 2
    except ConfigError as e:
        print(f"dry run: invalid job: {e}", file=sys.stderr)
        return 2
    except UserError as e:  # what train.py refuses with exit 2 (a run folder, a tokenizer file, ...)
        print(f"dry run: invalid job: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    print(text)
    for w in warnings:
        print(f"warning: {w}", file=sys.stderr)
    print(f"dry run: {verdict(warnings)}")
    return 0


if __name__ == "__main__":
    run_command(main)
