"""The job config schema: one dataclass per TOML section, plain types and defaults only.

Section and key names follow TorchTitan v0.2.2 where they overlap. ``[data]`` is
``mhar_titan.config.data`` (``DataConfig``) and ``[checkpoint]``
``mhar_titan.config.checkpoint`` (``CheckpointConfig``, with the checkpoint errors): the
config package owns every section; the builders import them. Nothing here imports torch,
the data stack, the model or any builder: the parser
(``mhar_titan.config.parser``) type-checks TOML values against these annotations.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal, Optional

from mhar_titan.config.checkpoint import CheckpointConfig
from mhar_titan.config.data import SOURCE_KEYS, DataConfig

PARAM_GROUPS = ("routing", "embeddings", "norms", "biases", "head", "other")
"""Parameter groups of the optimizer (``mhar_titan.optim.param_group_of`` assigns them; "head" is the
untied LM head, "other" the hidden matrices of attention and MLP)."""
NO_DECAY_GROUPS = PARAM_GROUPS[:-1]
"""Groups ``optimizer.no_decay`` may name (every group but "other")."""
MUON_GROUPS = ("other", "head", "embeddings")
"""Groups ``optimizer.muon_groups`` may name: groups of matrices. Routing parameters are never
orthogonalised; norms and biases are vectors."""
MUON_NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""Keller Jordan's quintic Newton-Schulz coefficients (a, b, c), torch.optim.Muon's default."""


@dataclass
class Job:
    """``[job]``: where the run folder goes and what it is called."""

    dump_folder: str = "./outputs"
    """Parent folder of run folders."""
    name: str = ""
    """Run folder name under ``dump_folder``; empty (or unset) means the config file's stem
    (``run`` without a config file)."""
    description: str = ""
    print_config: bool = False
    """Print the resolved config at start (rank 0)."""
    save_config_file: str = "config.toml"
    """Name of the resolved config written into the run folder."""


@dataclass
class Model:
    """``[model]``: the flavor plus per-field ``ModelArgs`` overrides.

    There is one decoder; its ``residual`` field picks the family (baseline, AttnRes,
    MHAR). Any extra key must be a ``ModelArgs`` field; it replaces that field of the
    flavor (``mhar_titan.models.args.resolve_model_args``).
    """

    flavor: str = "debug"
    """Row of ``mhar_titan.models.FLAVORS``."""
    overrides: dict = field(default_factory=dict)
    """``ModelArgs`` fields set in the TOML/CLI (collected from the other keys of ``[model]``)."""


@dataclass
class Optimizer:
    """``[optimizer]``: AdamW, or Muon for the hidden matrices with AdamW for the rest.

    ``name = "Muon"`` (``mhar_titan.optim.MuonWithAdamW``): the 2-D parameters of the groups in
    ``muon_groups`` (default the hidden matrices: attention q/k/v/o, MLP w1/w2/w3) get Muon; every
    other parameter (embedding, LM head, norms, all routing parameters) gets AdamW with ``lr``,
    ``beta1``, ``beta2``, ``eps`` and ``weight_decay`` below, as under ``name = "AdamW"``.
    """

    name: str = "AdamW"
    """"AdamW" or "Muon"."""
    lr: float = 8e-4
    """Peak learning rate (of AdamW; with Muon, of its AdamW part, and Muon's unless ``muon_lr`` is set)."""
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    no_decay: list[str] = field(default_factory=list)
    """Parameter groups excluded from weight decay: any of ``NO_DECAY_GROUPS``."""
    implementation: str = "foreach"
    """"foreach", "fused" or "for-loop" (AdamW's implementation)."""
    muon_groups: list[str] = field(default_factory=lambda: ["other"])
    """Parameter groups whose matrices Muon updates: any of ``MUON_GROUPS`` ("other": the hidden
    matrices; "head", "embeddings" to try Muon there too)."""
    muon_lr: Optional[float] = None
    """Muon's peak learning rate; None: ``lr`` (meant for ``muon_lr_scale = "match_rms_adamw"``)."""
    muon_weight_decay: Optional[float] = None
    """Muon's decoupled weight decay; None: ``weight_decay``."""
    muon_momentum: float = 0.95
    muon_nesterov: bool = True
    muon_lr_scale: str = "match_rms_adamw"
    """Shape-dependent scale of Muon's step on a (rows, cols) matrix: "match_rms_adamw"
    (0.2 sqrt(max(rows, cols)): an update RMS like AdamW's, so AdamW's LR and weight decay carry
    over; Moonlight, arXiv:2502.16982) or "original" (sqrt(max(1, rows / cols)), Keller Jordan's)."""
    muon_ns_coefficients: list[float] = field(default_factory=lambda: list(MUON_NS_COEFFICIENTS))
    """Newton-Schulz coefficients (a, b, c): three finite numbers."""
    muon_ns_steps: int = 5
    """Newton-Schulz iterations, 1 to 99."""
    muon_eps: float = 1e-7
    """Floor of the Frobenius norm the update is divided by before the iterations (> 0)."""
    muon_ns_dtype: str = "auto"
    """Arithmetic of the Newton-Schulz iterations: "bfloat16", "float32", or "auto" (bfloat16 on
    CUDA, float32 on CPU). bfloat16 is torch.optim.Muon's arithmetic."""


@dataclass
class LRScheduler:
    """``[lr_scheduler]``: linear warmup, optional stable phase, decay to a floor.

    ``decay_ratio`` unset: decay starts right after warmup (warmup + cosine, the
    paper's schedule with ``decay_type="cosine"``). ``decay_ratio = r``: the last
    ``round(r * steps)`` steps decay and the ones before are stable (WSD); a warm-up that ends
    later than ``steps - round(r * steps)`` delays the decay's start to its end, so the decay gets
    fewer steps (a warning says so, as for a warm-up-then-decay whose decay is shorter than its
    warm-up: ``mhar_titan.optim.decay_warning``).
    """

    warmup_steps: int = 200
    """Linear warm-up steps. At or above ``training.steps`` the run ends inside the warm-up, at
    ``steps / warmup_steps`` of the peak (no decay; a warning says so)."""
    decay_ratio: Optional[float] = None
    decay_type: str = "cosine"
    """"linear", "sqrt" or "cosine"."""
    min_lr_factor: float = 0.0
    """Floor as a fraction of the peak LR, reached at the last step (when the warm-up ends before it)."""


@dataclass
class Training:
    """``[training]``: batch geometry, steps, clipping, precision, health guards."""

    local_batch_size: int = 8
    """Sequences per rank per micro-batch."""
    global_batch_size: int = -1
    """Sequences per optimizer step over all ranks; -1 means local_batch_size * dp world.
    Gradient accumulation = global / (local * dp world), which must be an integer."""
    seq_len: int = 2048
    steps: int = 10000
    max_norm: float = 1.0
    """Gradient clipping threshold on the global L2 norm; <= 0 disables clipping."""
    mixed_precision_param: str = "bfloat16"
    """Parameter/compute dtype under FSDP on GPU; CPU always runs fp32."""
    mixed_precision_reduce: str = "float32"
    gc_freq: int = 50
    """Run ``gc.collect()`` every this many steps (automatic GC is disabled in the loop)."""
    max_consecutive_nonfinite: int = 3
    """Stop the run after this many consecutive steps with a non-finite loss or gradient norm."""
    z_loss: float = 0.0
    """Weight z of the z-loss: the training loss adds z * mean(logsumexp(logits)^2) over the
    target tokens (components/loss.py); 0 disables it. The 8B mid-training recipe uses 1e-4."""
    loss_path: str = "chunked"
    """How the LM head and the loss run (components/loss.py, models/cross_entropy.py): "chunked"
    computes the logits ``loss_chunk_tokens`` tokens at a time and again in backward, never holding
    the (tokens, vocab) logits; "plain" materialises them (the reference). The same numbers up to fp32
    rounding (within 1e-6 relative in fp32)."""
    loss_chunk_tokens: int = 1024
    """Tokens per chunk of the chunked loss: its memory is about 3 x chunk x vocab x 4 bytes (fp32
    logits, probabilities, their gradient) plus the fp32 head-weight gradient."""
    memory_check: Literal["error", "warn", "off"] = "error"
    """Before the model is built, compare the dry run's memory estimate per rank with the memory the
    rank has (free device memory; on CPU the host's available memory shared by its ranks):
    "error" refuses a job that does not fit (exit 2, naming the settings to lower), "warn" only
    says so, "off" skips the check (``mhar_titan.components.memory``)."""
    ema_decay: float = 0.0
    """Decay of the weight EMA (components/ema.py) updated after every optimizer step, kept in
    checkpoints and used for validation and export; 0 disables it. The 8B recipe uses 0.999."""
    cuda_graphs: bool = False
    """Replay each micro-batch's forward and backward as a CUDA graph after one eager warm-up
    (components/cuda_graphs.py); CUDA only, refused with settings that cannot be captured.
    Experimental: it has not run on a GPU yet (off by default until the GPU suite's row has)."""


@dataclass
class Parallelism:
    """``[parallelism]``: data parallelism with FSDP2 (the only parallelism)."""

    data_parallel_shard_degree: int = -1
    """-1 means all ranks."""
    data_parallel_replicate_degree: int = 1
    fsdp_reshard_after_forward: str = "default"
    """"default", "always" or "never"."""
    init_full_on_rank0: bool = True
    """Initialise the full model on rank 0's CPU and broadcast the shards, so any world size
    starts from the same weights (costs rank 0 host memory for the fp32 model). False: each
    rank initialises its own shards on the device (values then depend on the world size)."""
    timeout_s: float = 600.0
    """Seconds a collective may wait for the other ranks before the process group fails the job
    (``torch.distributed.init_process_group(timeout=...)``: NCCL / gloo). Raise it where one rank
    can be slower than the others for long (a long checkpoint save, a first compile, a shared
    machine); a hung job then takes that long to fail."""


@dataclass
class ActivationCheckpoint:
    """``[activation_checkpoint]``: which blocks recompute their activations in backward."""

    mode: str = "none"
    """"none", "full" (every block) or "selective" (every k-th block)."""
    selective_ac_option: str = "2"
    """For "selective": k as a string (TorchTitan's per-op "op" is not supported)."""
    preserve_rng_state: bool = False


@dataclass
class Compile:
    """``[compile]``: ``torch.compile`` of the blocks, the loss or the whole model."""

    enable: bool = False
    components: list[str] = field(default_factory=lambda: ["model"])
    """"model": every block on its own (after AC, before FSDP); "loss": the loss function;
    "whole_model" (alone): the model's forward from the embedding to the loss as one compiled
    function (routing kernels as custom ops), after FSDP, so graphs break only at FSDP's unit hooks."""
    backend: str = "inductor"


@dataclass
class Metrics:
    """``[metrics]``: logging sinks and frequency. Console and JSONL are always on."""

    log_freq: int = 10
    enable_tensorboard: bool = False
    save_tb_folder: str = "tb"
    enable_wandb: bool = False
    wandb_project: str = "mhar-titan"
    disable_color_printing: bool = False
    jsonl_file: str = "metrics.jsonl"


@dataclass
class Validation:
    """``[validation]``: periodic loss on the held-out set (``data.validation_files``).

    The validation set is a fixed set of tokens: the first ``sequences`` windows of
    ``training.seq_len + 1`` tokens of the held-out files, so ``sequences * training.seq_len``
    target tokens. ``val_loss`` is their mean loss, the same (up to float summation order)
    whatever ``local_batch_size``, gradient accumulation or world size.
    """

    enable: bool = False
    freq: int = 500
    sequences: int = 256
    """Sequences of training.seq_len tokens evaluated each time (the same ones every time).
    Checked against the files before training starts; ranks split them (the last micro-batch
    is padded with ignored rows)."""
    tokens: Optional[int] = None
    """The set's size in target tokens instead: ``tokens // training.seq_len`` sequences
    (whole sequences; overrides ``sequences`` when set)."""
    local_batch_size: int = -1
    """Sequences per evaluation micro-batch (memory only: it does not change the set);
    -1 means training.local_batch_size."""
    steps: Optional[int] = None
    """Removed: it counted micro-batches, so the set changed with the batch layout. Use
    ``sequences`` (the message says which value gives the old set)."""

    def sequences_for(self, seq_len: int) -> int:
        """Sequences in the validation set at ``seq_len`` tokens each (``tokens`` or ``sequences``)."""
        return self.tokens // seq_len if self.tokens is not None else self.sequences


@dataclass
class Eval:
    """``[eval]``: downstream tasks scored during training (lm-eval tasks by name, local YAML
    folders through ``include_path``), every ``freq`` steps and at the last step, on the weights
    validation uses (the EMA when there is one). Needs the ``lm-eval`` extra. Only log-likelihood
    tasks (multiple choice, log-likelihood, rolling perplexity) run in training; generation tasks
    are refused (evaluate them on a checkpoint with ``python -m mhar_titan.eval lm-eval``). The
    metrics go to every sink as ``eval/<task>/<metric>`` (``mhar_titan.components.downstream``).
    """

    enable: bool = False
    tasks: list[str] = field(default_factory=list)
    """lm-eval task names."""
    include_path: list[str] = field(default_factory=list)
    """Folders of local lm-eval task YAML files (e.g. ``["eval_tasks"]``; relative to the working folder)."""
    freq: int = 1000
    """An evaluation every this many steps (and at the last step)."""
    limit: Optional[int] = None
    """Examples per task (lm-eval's ``limit``); None scores every example."""
    num_fewshot: Optional[int] = None
    local_batch_size: int = 8
    """Sequences per forward on each rank (memory only: it does not change the numbers beyond float rounding)."""
    time_budget_s: Optional[float] = None
    """Seconds one evaluation may take (None: no limit). Before every forward the ranks agree, on
    rank 0's clock, whether time is left: once it is spent, the task being scored stops (its partial
    numbers are not logged) and the remaining tasks are skipped; the overrun is at most one forward."""

    def validate(self) -> None:
        if not self.enable:
            return
        if not self.tasks:
            raise ValueError("'eval.tasks' names no task; list lm-eval task names or set eval.enable = false")
        if self.freq < 1 or self.local_batch_size < 1:
            raise ValueError(f"'eval.freq' and 'eval.local_batch_size' must be >= 1, got {self.freq} and "
                             f"{self.local_batch_size}")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"'eval.limit' must be >= 1 (or unset for every example), got {self.limit}")
        if self.time_budget_s is not None and not self.time_budget_s >= 0:
            raise ValueError(f"'eval.time_budget_s' must be >= 0 seconds (or unset for no limit), got {self.time_budget_s}")


@dataclass
class Profiling:
    """``[profiling]``: torch.profiler traces and CUDA memory snapshots."""

    enable_profiling: bool = False
    save_traces_folder: str = "profile_traces"
    profile_freq: int = 10
    """A trace of one step is written every this many steps."""
    enable_memory_snapshot: bool = False
    save_memory_snapshot_folder: str = "memory_snapshot"


@dataclass
class Debug:
    """``[debug]``: seeds, determinism and fault injection for tests."""

    seed: int = 42
    deterministic: bool = False
    force_nonfinite_loss_steps: list[int] = field(default_factory=list)
    """Steps (1-based) whose loss is replaced by NaN, to exercise the non-finite guard."""


@dataclass
class JobConfig:
    """The whole job: one attribute per TOML section."""

    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: Metrics = field(default_factory=Metrics)
    validation: Validation = field(default_factory=Validation)
    eval: Eval = field(default_factory=Eval)
    profiling: Profiling = field(default_factory=Profiling)
    debug: Debug = field(default_factory=Debug)

    def to_dict(self) -> dict:
        """Nested plain dict; ``[model]`` overrides are flattened back into the section; a data
        mixture's ``[data]`` leaves out the top-level source keys (unset: its sources hold them)."""
        out = dataclasses.asdict(self)
        overrides = out["model"].pop("overrides")
        out["model"].update(overrides)
        if self.data.sources:
            for key in SOURCE_KEYS:
                out["data"].pop(key)
        return out


SECTIONS = [f.name for f in dataclasses.fields(JobConfig)]
"""TOML section names, in ``JobConfig`` order."""
