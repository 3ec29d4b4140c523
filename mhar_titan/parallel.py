"""Process group, device mesh, and the model build: meta -> AC -> compile -> FSDP2 -> init.

The order follows TorchTitan v0.2.2's ``parallelize_llama`` (``torchtitan/models/llama3/infra/parallelize.py``):

1. ``Transformer(args)`` on the meta device (no memory);
2. activation checkpointing: ``checkpoint_wrapper`` around every block (``full``)
   or every k-th block (``selective``, TorchTitan's counter: blocks k, 2k, ...);
3. optional per-block ``torch.compile`` (blocks of different depth see different
   numbers of sources, so dynamo compiles one graph per depth; the recompile limit
   is raised to cover them, otherwise later blocks silently run eager), ``[compile]
   components = ["model"]``;
4. ``fully_shard`` on every block, then on the root (token embedding, routing
   parameters, final norm and LM head stay in the root unit: the routing
   parameters of all sites are needed by every block, and a tied LM head reuses
   the embedding weight at the end of the forward);
5. ``to_empty`` on the device and ``init_weights``;
6. ``components = ["whole_model"]``: ``model.compile()`` of the root, so its forward from the
   embedding to the loss is one compiled function (state-dict keys unchanged); FSDP2's unit hooks
   run outside the graphs (dynamo skips them), so graphs break only there.

Gradient reduction: FSDP2 averages gradients over the data-parallel ranks. We do
not change its divide factor (``set_gradient_divide_factor`` makes FSDP2 use
``ReduceOp.PREMUL_SUM``, which gloo lacks); the trainer scales each rank's loss
by the world size instead (see ``mhar_titan.train``).
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from mhar_titan.config import ConfigError
from mhar_titan.launch_env import LaunchEnvError, resolve_device, resolve_launch_env


@dataclasses.dataclass
class ParallelEnv:
    """Where this process runs: ``rank`` of ``world_size`` data-parallel ranks on ``device``."""

    rank: int
    world_size: int
    device: torch.device
    mesh: DeviceMesh


def init_distributed(cfg) -> ParallelEnv:
    """Start the process group (NCCL on CUDA, gloo on CPU) and a 1-D FSDP mesh.

    Under ``torchrun`` the rank and world come from the environment; a plain
    ``python train.py`` gets a 1-rank group on an in-memory store, so the same
    FSDP2 code path runs in both cases.

    Raises:
        LaunchEnvError: SLURM started several tasks without torchrun (each would train
            alone as rank 0 of 1 into the same run folder).
        ConfigError: ``parallelism.data_parallel_shard_degree`` is neither -1 nor the world size.
    """
    use_cuda = torch.cuda.is_available()
    backend = "nccl" if use_cuda else "gloo"
    launch = resolve_launch_env()
    if not dist.is_initialized() and launch.source == "slurm" and launch.world_size > 1:
        raise LaunchEnvError(
            f"SLURM started {launch.world_size} tasks (SLURM_NTASKS) but RANK/WORLD_SIZE are unset: "
            "`srun python train.py` would run independent 1-rank jobs writing the same run folder. "
            "Run one torchrun per node (slurm/torchrun_node.sh, see docs/MULTINODE.md), "
            "or srun with --ntasks=1"
        )
    # torchrun sets LOCAL_RANK, SLURM sets SLURM_LOCALID; a task that sees one GPU uses cuda:0.
    device = resolve_device()
    if use_cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=cfg.parallelism.timeout_s)
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend, timeout=timeout)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    world = dist.get_world_size()
    degree = cfg.parallelism.data_parallel_shard_degree
    if degree not in (-1, world):
        raise ConfigError(
            f"parallelism.data_parallel_shard_degree={degree} but the job has {world} ranks; "
            "use -1 (all ranks) or the world size (FSDP is the only parallelism)"
        )
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp_shard",))
    return ParallelEnv(dist.get_rank(), world, device, mesh)


def apply_ac(model: nn.Module, ac_cfg) -> int:
    """Wrap blocks of ``model.layers`` with non-reentrant ``checkpoint_wrapper``.

    ``full``: every block; ``selective`` with option k: blocks k, 2k, ... (1-based).
    Returns the number of wrapped blocks.
    """
    if ac_cfg.mode == "none":
        return 0
    every = 1 if ac_cfg.mode == "full" else int(ac_cfg.selective_ac_option)
    wrapped = 0
    for i, block in enumerate(model.layers):
        if (i + 1) % every == 0:
            model.layers[i] = checkpoint_wrapper(block, preserve_rng_state=ac_cfg.preserve_rng_state)
            wrapped += 1
    return wrapped


def _raise_recompile_limits(n_layers: int) -> None:
    """One graph per distinct block signature (number of sources, block start or not), so up to
    n_layers graphs of the same code object; default limits (8) would make the deeper blocks fall
    back to eager without an error."""
    limit = 2 * n_layers + 8
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), limit))
    for name in ("accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 4 * limit))


def apply_compile(model: nn.Module, compile_cfg) -> None:
    """``torch.compile`` each block (after AC, before FSDP), registered back into ``model.layers``."""
    _raise_recompile_limits(len(model.layers))
    for i, block in enumerate(model.layers):
        model.layers[i] = torch.compile(block, backend=compile_cfg.backend)
    model.compiled_blocks = True  # the fused routing runs as custom ops inside them (models.Transformer)


def compile_whole_model(model: nn.Module, backend: str, fullgraph: bool = False) -> nn.Module:
    """``model.compile()``: the root's forward (embedding, blocks, routing kernels as custom ops, final
    norm, LM head and loss) as one compiled function, in place (parameter names unchanged).
    ``fullgraph=True`` refuses graph breaks (an unwrapped model; FSDP2's hooks break the graph at
    every unit). Returns ``model``."""
    _raise_recompile_limits(len(model.layers))
    model.compile(backend=backend, fullgraph=fullgraph)
    return model


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, param_dtype: torch.dtype, reduce_dtype: torch.dtype,
               reshard_after_forward: str) -> None:
    """``fully_shard`` every block, then the root (embedding, routing, final norm, LM head)."""
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    reshard = reshard_after_forward != "never"
    # Blocks return views (shared-gradient sources, grouped routing's phase-1 states). FSDP2 warns
    # that an in-place op on a block's view output would skip its pre-backward hook; the model
    # only reads block outputs (every update is out of place), so the warning does not apply.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(.*\) returned a view tensor",
                            category=UserWarning)
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)


def build_model(model_cls, args, cfg, env: ParallelEnv) -> nn.Module:
    """Build ``model_cls(args)`` sharded over ``env.mesh`` with initialised weights.

    Precision: on CUDA, parameters are fp32 masters with compute in
    ``training.mixed_precision_param`` and gradient reduction in
    ``training.mixed_precision_reduce``; on CPU everything is fp32.

    Initialisation: with ``parallelism.init_full_on_rank0`` (default) rank 0 builds
    the full model on its CPU, seeds it with ``debug.seed`` and runs
    ``init_weights``; the shards are then broadcast, so every world size starts
    from the same weights. Otherwise each rank runs ``init_weights`` on its own
    shards (fast at scale, but the values then depend on the world size).
    """
    with torch.device("meta"):
        model = model_cls(args)
    apply_ac(model, cfg.activation_checkpoint)
    if cfg.compile.enable and "model" in cfg.compile.components:
        apply_compile(model, cfg.compile)
    if env.device.type == "cuda":
        param_dtype = getattr(torch, cfg.training.mixed_precision_param)
        reduce_dtype = getattr(torch, cfg.training.mixed_precision_reduce)
    else:
        param_dtype = reduce_dtype = torch.float32
    apply_fsdp(model, env.mesh, param_dtype, reduce_dtype, cfg.parallelism.fsdp_reshard_after_forward)
    model.to_empty(device=env.device)
    torch.manual_seed(cfg.debug.seed + env.rank)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="DTensor random operators")
        model.init_weights(buffer_device=env.device)
    if cfg.parallelism.init_full_on_rank0:
        load_full_init(model, model_cls, args, cfg.debug.seed, env)
    if cfg.compile.enable and "whole_model" in cfg.compile.components:
        compile_whole_model(model, cfg.compile.backend)
    return model


def load_full_init(model: nn.Module, model_cls, args, seed: int, env: ParallelEnv) -> None:
    """Overwrite the sharded parameters with a full model initialised on rank 0's CPU."""
    full_sd = {}
    if env.rank == 0:
        torch.manual_seed(seed)
        with torch.device("meta"):
            full = model_cls(args)
        full.to_empty(device="cpu")
        full.init_weights(buffer_device="cpu")
        full_sd = {k: v for k, v in full.state_dict().items()}
        del full
    set_model_state_dict(
        model, full_sd, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    )
