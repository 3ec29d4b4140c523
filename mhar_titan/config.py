"""Job configuration: TOML file + ``--section.key=value`` overrides -> ``JobConfig``.

Section and key names follow TorchTitan v0.2.2 where they overlap (``job``,
``model``, ``optimizer``, ``lr_scheduler``, ``training``, ``parallelism``,
``activation_checkpoint``, ``compile``, ``checkpoint``, ``metrics``,
``validation``, ``profiling``, ``debug``). ``[data]`` is owned by
``mhar_titan.data`` (``DataConfig``) and ``[checkpoint]`` by
``mhar_titan.checkpoint`` (``CheckpointConfig``); they are imported, not redefined.

Precedence: command line > TOML > dataclass defaults. Everything is validated
before anything is built: an unknown section or key, or a value of the wrong
type, raises ``ConfigError`` naming the key and listing the valid ones.

``[model]`` holds ``name`` and ``flavor`` plus any field of
``mhar_titan.models.ModelArgs`` as an override of the flavor (for example
``routing_heads = 8``); those keys are checked against ``ModelArgs`` itself.
"""
from __future__ import annotations

import dataclasses
import pathlib
import sys
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from mhar_titan.checkpoint import CheckpointConfig
from mhar_titan.data import DataConfig


class ConfigError(ValueError):
    """A configuration file or command-line override is invalid."""


# --------------------------------------------------------------------------- sections


@dataclass
class Job:
    """``[job]``: where the run folder goes and what it is called."""

    dump_folder: str = "./outputs"
    """Parent folder of run folders."""
    name: str = ""
    """Run folder name under ``dump_folder``; empty means the config file's stem."""
    description: str = ""
    print_config: bool = False
    """Print the resolved config at start (rank 0)."""
    save_config_file: str = "config.toml"
    """Name of the resolved config written into the run folder."""


@dataclass
class Model:
    """``[model]``: the model family flavor plus per-field ``ModelArgs`` overrides.

    Any extra key must be a ``ModelArgs`` field; it replaces that field of the
    flavor (``ModelArgs.from_flavor(flavor, **overrides)``).
    """

    name: str = "transformer"
    """Model family name (one decoder; ``residual`` picks baseline/AttnRes/MHAR)."""
    flavor: str = "debug"
    """Row of ``mhar_titan.models.FLAVORS``."""
    overrides: dict = field(default_factory=dict)
    """``ModelArgs`` fields set in the TOML/CLI (collected from the other keys of ``[model]``)."""


@dataclass
class Optimizer:
    """``[optimizer]``: AdamW (the only optimizer)."""

    name: str = "AdamW"
    lr: float = 8e-4
    """Peak learning rate."""
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    no_decay: list = field(default_factory=list)
    """Parameter groups excluded from weight decay: any of "norms", "embeddings", "routing", "biases"."""
    implementation: str = "foreach"
    """"foreach", "fused" or "for-loop"."""


@dataclass
class LRScheduler:
    """``[lr_scheduler]``: linear warmup, optional stable phase, decay to a floor.

    ``decay_ratio`` unset: decay starts right after warmup (warmup + cosine, the
    paper's schedule with ``decay_type="cosine"``). ``decay_ratio = r``: the last
    ``r * steps`` steps decay and the ones before are stable (WSD).
    """

    warmup_steps: int = 200
    decay_ratio: Optional[float] = None
    decay_type: str = "cosine"
    """"linear", "sqrt" or "cosine"."""
    min_lr_factor: float = 0.0
    """Floor as a fraction of the peak LR."""


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
    """``[compile]``: per-block ``torch.compile``."""

    enable: bool = False
    components: list = field(default_factory=lambda: ["model"])
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
    """``[validation]``: periodic loss on the held-out set."""

    enable: bool = False
    freq: int = 500
    steps: int = 20
    """Micro-batches per evaluation (the same batches every time)."""
    local_batch_size: int = -1
    """-1 means training.local_batch_size."""


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
    force_nonfinite_loss_steps: list = field(default_factory=list)
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
    profiling: Profiling = field(default_factory=Profiling)
    debug: Debug = field(default_factory=Debug)

    def to_dict(self) -> dict:
        """Nested plain dict; ``[model]`` overrides are flattened back into the section."""
        out = dataclasses.asdict(self)
        overrides = out["model"].pop("overrides")
        out["model"].update(overrides)
        return out


SECTIONS = [f.name for f in dataclasses.fields(JobConfig)]

# Allowed values of string keys (checked in ``validate``).
_CHOICES = {
    ("optimizer", "name"): ("AdamW",),
    ("optimizer", "implementation"): ("foreach", "fused", "for-loop"),
    ("lr_scheduler", "decay_type"): ("linear", "sqrt", "cosine"),
    ("parallelism", "fsdp_reshard_after_forward"): ("default", "always", "never"),
    ("activation_checkpoint", "mode"): ("none", "full", "selective"),
    ("training", "mixed_precision_param"): ("bfloat16", "float32"),
    ("training", "mixed_precision_reduce"): ("bfloat16", "float32"),
    ("compile", "backend"): ("inductor", "aot_eager", "eager"),
}
_NO_DECAY_GROUPS = ("norms", "embeddings", "routing", "biases")


# --------------------------------------------------------------------------- type checks


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "unset"
    return getattr(tp, "__name__", str(tp))


def _matches(value: Any, tp: Any) -> bool:
    """Whether a TOML value fits a dataclass field annotation (int is accepted for float)."""
    if tp is Any:
        return True
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return any(_matches(value, a) for a in typing.get_args(tp))
    if origin is Literal:
        return value in typing.get_args(tp)
    if origin in (list, tuple):
        args = typing.get_args(tp)
        return isinstance(value, (list, tuple)) and (not args or all(_matches(v, args[0]) for v in value))
    if origin is dict or tp is dict:
        return isinstance(value, dict)
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is list:
        return isinstance(value, (list, tuple))
    if isinstance(tp, type):
        return isinstance(value, tp)
    return True  # an annotation we cannot check (forward reference etc.)


def _coerce(value: Any, tp: Any) -> Any:
    """int -> float where a float is expected; tuples -> lists."""
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, tuple):
        return list(value)
    return value


def _field_types(cls) -> dict:
    try:
        return typing.get_type_hints(cls)
    except Exception:  # unresolved forward references: fall back to raw annotations
        return {f.name: f.type for f in dataclasses.fields(cls)}


def _model_arg_types() -> dict:
    """Field name -> annotation of ``ModelArgs``."""
    from mhar_titan.models.args import ModelArgs

    return _field_types(ModelArgs)


def _check_key(section: str, key: str, value: Any, types_: dict, where: str) -> Any:
    if key not in types_:
        valid = ", ".join(sorted(types_))
        raise ConfigError(f"{where}: unknown key '{section}.{key}'. Valid keys of [{section}]: {valid}")
    tp = types_[key]
    if not _matches(value, tp):
        raise ConfigError(
            f"{where}: '{section}.{key}' must be {_type_name(tp)}, got {type(value).__name__} {value!r}"
        )
    return _coerce(value, tp)


# --------------------------------------------------------------------------- loading


def _apply_section(cfg: JobConfig, section: str, values: dict, where: str) -> None:
    if section not in SECTIONS:
        raise ConfigError(f"{where}: unknown section [{section}]. Valid sections: {', '.join(SECTIONS)}")
    if not isinstance(values, dict):
        raise ConfigError(f"{where}: [{section}] must be a table of keys, got {values!r}")
    obj = getattr(cfg, section)
    types_ = {k: v for k, v in _field_types(type(obj)).items()}
    if section == "model":
        types_.pop("overrides")
        arg_types = _model_arg_types()
    for key, value in values.items():
        if section == "model" and key not in types_:
            obj.overrides[key] = _check_key("model", key, value, arg_types, where)
            continue
        setattr(obj, key, _check_key(section, key, value, types_, where))


def _parse_cli_value(raw: str, tp: Any) -> Any:
    """A command-line string as the field's type: strings stay raw, the rest parse as TOML values."""
    if tp is str or tp == Optional[str]:
        return raw
    if raw.lower() in ("true", "false"):
        return raw.lower() == "true"
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw  # the type check then reports it with the key's name


def _split_cli(argv: list[str]) -> tuple[Optional[str], list[tuple[str, str]]]:
    """``--config F`` / ``--job.config_file F`` and ``--section.key[=| ]value`` pairs."""
    config_file, pairs, i = None, [], 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}: expected --section.key=value or --config FILE")
        name, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(argv):
                raise ConfigError(f"--{name} needs a value")
            value, i = argv[i + 1], i + 1
        i += 1
        if name in ("config", "job.config_file"):
            config_file = value
        elif "." not in name:
            raise ConfigError(f"--{name}: expected --section.key (sections: {', '.join(SECTIONS)})")
        else:
            pairs.append((name, value))
    return config_file, pairs


def load_config(config_file: Optional[str] = None, overrides: Optional[list[str]] = None) -> JobConfig:
    """Build and validate a ``JobConfig`` from an optional TOML file and CLI overrides.

    Args:
        config_file: path of a TOML job file, or None for defaults only.
        overrides: command-line tokens such as ``["--training.steps=5", "--optimizer.lr", "1e-3"]``;
            may also carry ``--config FILE`` (or TorchTitan's ``--job.config_file FILE``).

    Raises:
        ConfigError: unknown section or key, a value of the wrong type or outside its
            allowed values, or an inconsistent combination (see ``validate``).
        FileNotFoundError: the TOML file does not exist.
    """
    cli_file, pairs = _split_cli(list(overrides or []))
    config_file = cli_file or config_file
    cfg = JobConfig()
    if config_file is not None:
        path = pathlib.Path(config_file)
        if not path.is_file():
            raise FileNotFoundError(f"config file not found: {config_file}")
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{config_file}: not valid TOML: {e}") from e
        for section, values in data.items():
            _apply_section(cfg, section, values, str(config_file))
        if not cfg.job.name:
            cfg.job.name = path.stem
    for name, raw in pairs:
        section, _, key = name.partition(".")
        if section not in SECTIONS:
            raise ConfigError(f"--{name}: unknown section [{section}]. Valid sections: {', '.join(SECTIONS)}")
        types_ = _field_types(type(getattr(cfg, section)))
        if section == "model" and key not in types_:
            types_ = _model_arg_types() or {}
        tp = types_.get(key, str)
        _apply_section(cfg, section, {key: _parse_cli_value(raw, tp)}, f"--{name}")
    if not cfg.job.name:
        cfg.job.name = "run"
    validate(cfg)
    return cfg


def validate(cfg: JobConfig) -> None:
    """Cross-field and value checks that need no model, data or process group.

    Raises:
        ConfigError: naming the offending key and its allowed values.
    """
    # Sections owned by other modules carry their own value checks.
    for section in SECTIONS:
        obj = getattr(cfg, section)
        for check in ("__post_init__", "validate"):
            if hasattr(obj, check):
                try:
                    getattr(obj, check)()
                except (ValueError, RuntimeError) as e:
                    raise ConfigError(f"[{section}]: {e}") from e
    for (section, key), allowed in _CHOICES.items():
        value = getattr(getattr(cfg, section), key)
        if value not in allowed:
            raise ConfigError(f"'{section}.{key}' = {value!r} is not one of {', '.join(map(repr, allowed))}")
    bad = [g for g in cfg.optimizer.no_decay if g not in _NO_DECAY_GROUPS]
    if bad:
        raise ConfigError(f"'optimizer.no_decay' has unknown groups {bad}; valid: {', '.join(_NO_DECAY_GROUPS)}")
    o = cfg.optimizer
    if not o.lr > 0:
        raise ConfigError(f"'optimizer.lr' must be > 0, got {o.lr}")
    for key in ("beta1", "beta2"):
        if not 0.0 <= getattr(o, key) < 1.0:
            raise ConfigError(f"'optimizer.{key}' must be in [0, 1), got {getattr(o, key)}")
    if not o.eps > 0:
        raise ConfigError(f"'optimizer.eps' must be > 0, got {o.eps}")
    if not o.weight_decay >= 0:
        raise ConfigError(f"'optimizer.weight_decay' must be >= 0, got {o.weight_decay}")
    if cfg.data.tokenizer in TOKENIZER_N_VOCAB:  # an unknown tokenizer is reported by the data checks
        resolve_model_args(cfg, TOKENIZER_N_VOCAB[cfg.data.tokenizer])
    t = cfg.training
    for key in ("local_batch_size", "seq_len", "steps"):
        if getattr(t, key) < 1:
            raise ConfigError(f"'training.{key}' must be >= 1, got {getattr(t, key)}")
    if t.global_batch_size != -1 and t.global_batch_size < t.local_batch_size:
        raise ConfigError(
            f"'training.global_batch_size' ({t.global_batch_size}) must be -1 or >= "
            f"'training.local_batch_size' ({t.local_batch_size})"
        )
    if t.max_consecutive_nonfinite < 1:
        raise ConfigError("'training.max_consecutive_nonfinite' must be >= 1")
    s = cfg.lr_scheduler
    if s.warmup_steps < 0:
        raise ConfigError(f"'lr_scheduler.warmup_steps' must be >= 0, got {s.warmup_steps}")
    if s.decay_ratio is not None and not 0.0 <= s.decay_ratio <= 1.0:
        raise ConfigError(f"'lr_scheduler.decay_ratio' must be in [0, 1], got {s.decay_ratio}")
    if not 0.0 <= s.min_lr_factor <= 1.0:
        raise ConfigError(f"'lr_scheduler.min_lr_factor' must be in [0, 1], got {s.min_lr_factor}")
    ac = cfg.activation_checkpoint
    if ac.mode == "selective" and not (ac.selective_ac_option.isdigit() and int(ac.selective_ac_option) >= 1):
        raise ConfigError(
            f"'activation_checkpoint.selective_ac_option' must be a positive integer string such as \"2\" "
            f"(checkpoint every k-th block), got {ac.selective_ac_option!r}"
        )
    if cfg.parallelism.data_parallel_replicate_degree != 1:
        raise ConfigError("'parallelism.data_parallel_replicate_degree' must be 1 (HSDP is not implemented)")
    bad = [c for c in cfg.compile.components if c not in ("model", "loss")]
    if bad:
        raise ConfigError(f"'compile.components' has unknown entries {bad}; valid: 'model', 'loss'")
    if cfg.metrics.log_freq < 1:
        raise ConfigError("'metrics.log_freq' must be >= 1")
    if cfg.validation.enable and (cfg.validation.freq < 1 or cfg.validation.steps < 1):
        raise ConfigError("'validation.freq' and 'validation.steps' must be >= 1 when validation is enabled")
    if cfg.profiling.profile_freq < 1:
        raise ConfigError("'profiling.profile_freq' must be >= 1")


# --------------------------------------------------------------------------- derived job values
# One place for what the trainer and the dry run both derive from a config.

TOKENIZER_N_VOCAB = {"gpt2": 50_257, "cl100k_base": 100_277, "o200k_base": 200_019, "bytes": 257}
"""Vocabulary size (``n_vocab``, special tokens included) of each encoding
``data.tokenizer`` accepts (tiktoken's, and the byte-level 256 bytes + EOS), so the model can be sized without loading the encoding files."""


def tokenizer_n_vocab(name: str) -> int:
    """``n_vocab`` of the tiktoken encoding ``name`` (no file or network access).

    Raises:
        ConfigError: ``name`` is not a supported encoding.
    """
    if name not in TOKENIZER_N_VOCAB:
        raise ConfigError(f"'data.tokenizer' = {name!r} is unknown; valid: {', '.join(TOKENIZER_N_VOCAB)}")
    return TOKENIZER_N_VOCAB[name]


def _blamed_model_key(m: Model, overrides: dict) -> str:
    """Which ``[model]`` key makes ``ModelArgs`` fail: the first override (in config order)
    whose addition to the flavor breaks it; the flavor itself if nothing does alone."""
    from mhar_titan.models.args import ModelArgs

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


def resolve_model_args(cfg: JobConfig, n_vocab: int):
    """The ``ModelArgs`` a job trains: flavor + ``[model]`` overrides, with the defaults
    ``vocab_size = pad_vocab(n_vocab)`` (a multiple of 128) and
    ``max_seq_len = max(flavor's, training.seq_len)`` unless the config sets them.

    Raises:
        ConfigError: unknown flavor or field, arguments ``ModelArgs`` rejects, a vocab_size
            below ``n_vocab``, or training.seq_len above an explicit max_seq_len.
    """
    from mhar_titan.models.args import ModelArgs, pad_vocab

    m = cfg.model
    try:
        overrides = dict(m.overrides)
        overrides.setdefault("vocab_size", pad_vocab(n_vocab))
        overrides.setdefault("max_seq_len", max(ModelArgs.from_flavor(m.flavor).max_seq_len, cfg.training.seq_len))
        args = ModelArgs.from_flavor(m.flavor, **overrides)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{_blamed_model_key(m, overrides)}: {e}") from e
    if args.vocab_size < n_vocab:
        raise ConfigError(
            f"'model.vocab_size' ({args.vocab_size}) is smaller than tokenizer {cfg.data.tokenizer!r} "
            f"({n_vocab} tokens); set --model.vocab_size to at least {n_vocab} (a multiple of 128 is faster) "
            "or leave it unset"
        )
    if cfg.training.seq_len > args.max_seq_len:
        raise ConfigError(
            f"'training.seq_len' ({cfg.training.seq_len}) exceeds 'model.max_seq_len' ({args.max_seq_len}); "
            f"lower it or set --model.max_seq_len={cfg.training.seq_len}"
        )
    return args


def batch_geometry(cfg: JobConfig, world_size: int) -> tuple[int, int]:
    """(global batch in sequences, gradient-accumulation steps) for ``world_size`` data-parallel ranks.

    ``training.global_batch_size = -1`` means local_batch_size x world_size (no accumulation).

    Raises:
        ConfigError: the global batch is not a multiple of local_batch_size x world_size.
    """
    t = cfg.training
    per_micro = t.local_batch_size * world_size
    global_batch = per_micro if t.global_batch_size == -1 else t.global_batch_size
    if global_batch % per_micro:
        raise ConfigError(
            f"'training.global_batch_size' ({global_batch}) must be a multiple of "
            f"local_batch_size x ranks = {t.local_batch_size} x {world_size} = {per_micro}; change one of them "
            f"(for example --training.global_batch_size={max(per_micro, global_batch // per_micro * per_micro)})"
        )
    return global_batch, global_batch // per_micro


# --------------------------------------------------------------------------- writing


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def to_toml(cfg: JobConfig) -> str:
    """The resolved config as TOML text; keys that are unset (None) are written as comments."""
    lines = ["# Resolved configuration (defaults < TOML < command line), written by mhar_titan"]
    for section, values in cfg.to_dict().items():
        lines.append(f"\n[{section}]")
        for key, value in values.items():
            lines.append(f"# {key} = (unset)" if value is None else f"{key} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"
