"""Job configuration: TOML file + ``--section.key=value`` overrides -> a validated ``JobConfig``.

Precedence: command line > TOML > dataclass defaults (``mhar_titan.config.sections``).
Everything is validated before anything is built: an unknown section or key, or a
value of the wrong type, raises ``ConfigError`` naming the key and listing the valid
ones. ``to_toml`` writes a resolved config back with ``tomli_w`` (read again by ``load_config`` to an
equal config, whatever its strings hold).

``[model]`` holds ``flavor`` plus any field of ``mhar_titan.models.ModelArgs`` as an
override of the flavor (for example ``routing_heads = 8``); those keys are checked
against ``ModelArgs`` itself, and the resulting arguments by
``mhar_titan.models.args.resolve_model_args`` (the model's argument leaf: no torch, no
builder); both are imported when a config is loaded, not when this module is.
"""
from __future__ import annotations

import dataclasses
import math
import pathlib
import re
import sys
import types
import typing
from typing import Any, Literal, Optional, Union

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from mhar_titan.config.sections import MUON_GROUPS, NO_DECAY_GROUPS, SECTIONS, JobConfig
from mhar_titan.errors import ConfigError, missing_path


class ConfigFileNotFoundError(ConfigError, FileNotFoundError):
    """The TOML job file does not exist."""


# Allowed values of string keys (checked in ``validate``).
_CHOICES = {
    ("optimizer", "name"): ("AdamW", "Muon"),
    ("optimizer", "muon_lr_scale"): ("match_rms_adamw", "original"),
    ("optimizer", "muon_ns_dtype"): ("auto", "bfloat16", "float32"),
    ("optimizer", "implementation"): ("foreach", "fused", "for-loop"),
    ("lr_scheduler", "decay_type"): ("linear", "sqrt", "cosine"),
    ("parallelism", "fsdp_reshard_after_forward"): ("default", "always", "never"),
    ("activation_checkpoint", "mode"): ("none", "full", "selective"),
    ("training", "mixed_precision_param"): ("bfloat16", "float32"),
    ("training", "mixed_precision_reduce"): ("bfloat16", "float32"),
    ("compile", "backend"): ("inductor", "aot_eager", "eager"),
    ("training", "loss_path"): ("chunked", "plain"),
}


# --------------------------------------------------------------------------- type checks


def _type_name(tp: Any) -> str:
    """The annotation in words: ``int | Literal["auto"]`` -> "int or 'auto'" (the valid values listed)."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return " or ".join(" or ".join(map(repr, typing.get_args(a))) if typing.get_origin(a) is Literal
                           else _type_name(a) for a in typing.get_args(tp))
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "unset"
    if _table_class(tp) is not None:
        return f"a list of tables (one [[...]] table or {{key = value, ...}} per {_table_class(tp).__name__})"
    if origin in (list, tuple) and typing.get_args(tp):
        return f"list of {_type_name(typing.get_args(tp)[0])}"
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
    if dataclasses.is_dataclass(tp):
        return isinstance(value, (dict, tp))  # a table; its keys are checked by _tables_as
    if isinstance(tp, type):
        return isinstance(value, tp)
    return True  # an annotation we cannot check (forward reference etc.)


def _coerce(value: Any, tp: Any) -> Any:
    """int -> float where a float is expected (also an optional float and the items of a ``list[float]``);
    tuples -> lists."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        options = [a for a in typing.get_args(tp) if a is not type(None)]
        tp = options[0] if len(options) == 1 else tp
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, (list, tuple)):
        item = typing.get_args(tp)[0] if typing.get_origin(tp) in (list, tuple) and typing.get_args(tp) else Any
        return [_coerce(v, item) for v in value]
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


def _non_finite(value: Any, where: str = "") -> Optional[tuple[str, float]]:
    """(where inside the value, the value) of the first NaN or infinity in a value (a float, or one
    inside a list or table: ``where`` is then e.g. "[1].weight"), else None."""
    if isinstance(value, float) and not math.isfinite(value):
        return where, value
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > sys.float_info.max:
        return where, float("inf") if value > 0 else float("-inf")  # a float setting would read it as infinity
    items = (((f".{k}", v) for k, v in value.items()) if isinstance(value, dict)
             else ((f"[{i}]", v) for i, v in enumerate(value)) if isinstance(value, (list, tuple)) else ())
    for sub, item in items:
        found = _non_finite(item, where + sub)
        if found is not None:
            return found
    return None


def _table_class(tp: Any) -> Optional[type]:
    """The dataclass of a ``list[SomeDataclass]`` annotation (a list of TOML tables), else None."""
    if typing.get_origin(tp) in (list, tuple):
        args = typing.get_args(tp)
        if args and dataclasses.is_dataclass(args[0]):
            return args[0]
    return None


def _tables_as(cls: type, name: str, value: list, where: str) -> list:
    """A list of TOML tables as ``cls`` instances, every key checked like a section's (unknown key,
    type, NaN / infinity), named ``name[i].key``."""
    out = []
    types_ = _field_types(cls)
    for i, table in enumerate(value):
        if isinstance(table, cls):
            out.append(table)
            continue
        obj = cls()
        for key, item in table.items():
            setattr(obj, key, _check_key(f"{name}[{i}]", key, item, types_, where, table_of=name))
        out.append(obj)
    return out


def _check_key(section: str, key: str, value: Any, types_: dict, where: str, table_of: Optional[str] = None) -> Any:
    """The value of ``section.key`` coerced to its annotation.

    Raises:
        ConfigError: unknown key, a value of the wrong type, or a NaN / infinity anywhere in the
            value (no float setting of the schema gives infinity a meaning: a non-finite lr,
            max_norm, eps... would train on garbage or silently disable a guard).
    """
    if key not in types_:
        valid = ", ".join(sorted(types_))
        raise ConfigError(f"{where}: unknown key '{section}.{key}'. Valid keys of [{table_of or section}]: {valid}")
    tp = types_[key]
    if not _matches(value, tp):
        raise ConfigError(
            f"{where}: '{section}.{key}' must be {_type_name(tp)}, got {type(value).__name__} {value!r}"
        )
    bad = _non_finite(value)
    if bad is not None:
        inner, number = bad
        raise ConfigError(f"{where}: '{section}.{key}{inner}' must be a finite number, got {number!r} (NaN and "
                          f"infinity are not valid settings; a number above 1.8e308 reads as infinity); set a "
                          f"finite value")
    cls = _table_class(tp)
    if cls is not None:
        return _tables_as(cls, f"{section}.{key}", list(value), where)
    if isinstance(value, str) and not value:
        return _empty(section, key, value, tp, where)
    return _coerce(value, tp)


EMPTY_MEANS = {"job.name": "the config file's stem (else 'run')", "job.description": "no description"}
"""The string keys for which an empty value means something of its own (``--help`` says what)."""


def _empty(section: str, key: str, value: str, tp: Any, where: str) -> Optional[str]:
    """An empty string given for ``section.key``: what ``EMPTY_MEANS`` says for its keys,
    unset (None, the default's meaning) for an optional key, else refused: an empty name, path or
    choice means nothing the trainer could do.

    Raises:
        ConfigError: naming the key and the two ways on.
    """
    if f"{section}.{key}" in EMPTY_MEANS:
        return ""
    if typing.get_origin(tp) in (Union, types.UnionType) and type(None) in typing.get_args(tp):
        return None
    raise ConfigError(f"{where}: '{section}.{key}' is empty ({value!r}); give a value, or leave the key out for its "
                      f"default (python train.py --help {section.split('[')[0]} lists it)")


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
            obj.overrides[key] = _check_key("model", key, value, {**arg_types, **types_}, where)
            continue
        setattr(obj, key, _check_key(section, key, value, types_, where))


def list_item_type(tp: Any) -> Optional[Any]:
    """The item type of a list key's annotation, which the comma form parses each item as: ``list[int]`` ->
    int (also inside Optional); a ``Literal`` of strings, or a bare ``list`` / ``tuple`` (which the schema
    never uses: every list key names its item type, tests/test_config_cli.py checks), -> str. None for
    anything else: not a list, or a list of tables (``list[MixtureSource]``)."""
    if tp is list or tp is tuple:
        return str
    if typing.get_origin(tp) in (Union, types.UnionType):
        found = [list_item_type(a) for a in typing.get_args(tp) if a is not type(None)]
        return next((f for f in found if f is not None), None)
    if typing.get_origin(tp) not in (list, tuple) or _table_class(tp) is not None:
        return None
    item = typing.get_args(tp)[0]
    if typing.get_origin(item) is Literal and all(isinstance(a, str) for a in typing.get_args(item)):
        return str
    return item


_PYTHON_NUMBER = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")  # ASCII digits only


def _scalar(text: str) -> Any:
    """A command-line value that is not a string: ``true`` / ``false`` in any case, a TOML value, or a number
    as Python spells it where TOML does not (``.5``, ``5.``, ``05``); else the text itself (the type check
    then names the key)."""
    bare = text.strip()
    if bare.lower() in ("true", "false"):
        return bare.lower() == "true"
    try:
        parsed = tomllib.loads(f"v = {bare}")
    except tomllib.TOMLDecodeError:
        parsed = None
    if parsed is not None and len(parsed) == 1:  # one value (a newline and a second key is not one)
        return parsed["v"]
    if _PYTHON_NUMBER.fullmatch(bare):
        return int(bare) if bare.lstrip("+-").isdigit() else float(bare)
    return text


def _parse_cli_value(raw: str, tp: Any, name: str = "") -> Any:
    """A command-line string (``--NAME=RAW``) as the field's type ``tp``.

    Strings stay raw. A list key (``list_item_type``) takes a TOML array (``--data.files='["a", "b"]'``,
    quoted for the shell) or its items comma-separated (``--data.files=a.parquet,b/*.parquet``,
    ``--compile.components=whole_model``, ``--debug.force_nonfinite_loss_steps=3,5``; an empty value is the
    empty list); a value in brackets is read as the array. The rest parse as TOML values, or as Python
    spells a number (``--optimizer.lr=.5``).

    Raises:
        ConfigError: a bracketed value for a list of strings that is not a TOML array, e.g. ``[whole_model]``
            (what ``--compile.components=["whole_model"]`` becomes when the shell removes the quotes; not read
            as the items, since a file pattern such as ``[ab]`` is itself bracketed): the message shows the
            value quoted for the shell and the comma form.
    """
    if tp is str or tp == Optional[str]:
        return raw
    item = list_item_type(tp)
    if item is not None:
        text = raw.strip()
        array = text.startswith("[") and text.endswith("]")
        if array or text.startswith(('["', "['")):
            try:
                return tomllib.loads(f"v = {text}")["v"]
            except tomllib.TOMLDecodeError:
                if item is not str and array:  # numbers or booleans in brackets: read as the comma form
                    return [_scalar(part) for part in _top_level_items(text[1:-1])]
                raise ConfigError(_not_an_array(name, raw, text)) from None
        return [part if item is str else _scalar(part) for part in _top_level_items(raw)]
    return _scalar(raw)


def _top_level_items(text: str) -> list[str]:
    """The comma form's items: `text` split at the commas outside brackets (a file pattern such as
    ``shard[0,1].parquet`` is one item), each stripped; empty items dropped."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]" and depth:
            depth -= 1
        elif ch == "," and not depth:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [item.strip() for item in items if item.strip()]


def _not_an_array(name: str, raw: str, text: str) -> str:
    """The message for a bracketed list-of-strings value that is not a TOML array. It may be an array whose
    quotes the shell removed (``[whole_model]``: its items have no brackets) or values that start with a
    bracket (a file pattern such as ``[ab].parquet``); the forms to type for each keep every item as
    written, each shown only where it reads the value so."""
    inner = _top_level_items(text[1:-1]) if text.endswith("]") else []
    as_items = [p.strip("\"'") for p in inner] if inner and not any(c in p for p in inner for c in "[]") else []
    as_written = _top_level_items(raw)
    quoted = lambda items: "'[" + ", ".join(f'"{p}"' for p in items) + "]'"  # noqa: E731
    forms = [f"for the items {as_items} write --{name}={quoted(as_items)} or --{name}={','.join(as_items)}"
             ] if as_items else []
    if not any('"' in p for p in as_written):
        forms.append(f"to keep {as_written} as written, --{name}={quoted(as_written)}")
    return (f"--{name}={raw}: not a TOML array (did the shell remove its quotes?); "
            + ("; ".join(forms) + " (quoted for the shell)" if forms else
               f"write it as one, quoted for the shell: --{name}='[\"a\", \"b\"]'"))


def _split_cli(argv: list[str]) -> tuple[Optional[str], list[tuple[str, str]]]:
    """``--config F`` / ``--job.config_file F`` and ``--section.key[=| ]value`` pairs."""
    config_file, pairs, i = None, [], 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}: expected --section.key=value or --config FILE "
                              "(python train.py --help lists the keys)")
        name, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                raise ConfigError(f"--{name} needs a value: write --{name}=VALUE (or --{name} VALUE)")
            value, i = argv[i + 1], i + 1
        i += 1
        if name in ("config", "job.config_file"):
            config_file = value
        elif "." not in name:
            raise ConfigError(f"--{name}: expected --section.key (sections: {', '.join(SECTIONS)}; python train.py "
                              f"--help SECTION lists a section's keys)")
        else:
            pairs.append((name, value))
    return config_file, pairs


def read_toml(path: pathlib.Path, what: str = "config file") -> dict:
    """The tables of the TOML file ``path`` (``what`` names it in the errors).

    Raises:
        ConfigFileNotFoundError: ``path`` is not a file.
        ConfigError: it is not valid TOML (the message has the parser's line and column).
    """
    if path.is_dir():
        toml = sorted(path.glob("*.toml"))
        example = f" such as {toml[0]}" if toml else ""
        raise ConfigError(f"{what} {missing_path(path)}; name a TOML file{example}")
    if not path.is_file():
        raise ConfigFileNotFoundError(f"{what} not found: {path}")
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from e


def load_config(config_file: Optional[str] = None, overrides: Optional[list[str]] = None) -> JobConfig:
    """Build and validate a ``JobConfig`` from an optional TOML file and CLI overrides.

    Args:
        config_file: path of a TOML job file, or None for defaults only.
        overrides: command-line tokens such as ``["--training.steps=5", "--optimizer.lr", "1e-3"]``;
            may also carry ``--config FILE`` (or TorchTitan's ``--job.config_file FILE``).

    Raises:
        ConfigError: unknown section or key, a value of the wrong type or outside its
            allowed values, or an inconsistent combination (see ``validate``).
        ConfigFileNotFoundError: the TOML file does not exist (also a ``FileNotFoundError``).
    """
    cli_file, pairs = _split_cli(list(overrides or []))
    config_file = cli_file or config_file
    cfg = JobConfig()
    if config_file is not None:
        path = pathlib.Path(config_file)
        data = read_toml(path)
        for section, values in data.items():
            _apply_section(cfg, section, values, str(config_file))
    for name, raw in pairs:
        section, _, key = name.partition(".")
        if section not in SECTIONS:
            raise ConfigError(f"--{name}: unknown section [{section}]. Valid sections: {', '.join(SECTIONS)}")
        types_ = _field_types(type(getattr(cfg, section)))
        if section == "model" and key not in types_:
            types_ = _model_arg_types() or {}
        tp = types_.get(key, str)
        _apply_section(cfg, section, {key: _parse_cli_value(raw, tp, name)}, f"--{name}")
    if not cfg.job.name:  # unset or empty, in the file or on the command line: EMPTY_MEANS
        cfg.job.name = pathlib.Path(config_file).stem if config_file is not None else "run"
    validate(cfg)
    return cfg


# Names of files and folders the trainer writes inside the run folder.
_INSIDE_RUN_FOLDER = (("job", "save_config_file"), ("checkpoint", "folder"), ("metrics", "jsonl_file"),
                      ("metrics", "save_tb_folder"), ("profiling", "save_traces_folder"),
                      ("profiling", "save_memory_snapshot_folder"))


def _check_run_folder_names(cfg: JobConfig) -> None:
    """``job.name`` is one path component (the run folder sits directly in ``job.dump_folder``), and
    the names written inside the run folder are relative paths that stay inside it.

    Raises:
        ConfigError: naming the key, its value and the fix.
    """
    name = cfg.job.name
    separators = [sep for sep in ("/", "\\") if sep in name]
    if name in ("", ".", "..") or separators or "\0" in name:
        why = (f"it contains {' and '.join(map(repr, separators))}" if separators
               else "it contains a NUL character" if "\0" in name else "it names no folder of its own")
        raise ConfigError(
            f"'job.name' = {name!r} must be one folder name (the run folder is job.dump_folder/job.name and "
            f"{why}); use a plain name such as 'mhar_1b', and put the parent folder in job.dump_folder")
    for section, key in _INSIDE_RUN_FOLDER:
        value = getattr(getattr(cfg, section), key)
        path = pathlib.PurePosixPath(value.replace("\\", "/"))
        if not value or value == "." or path.is_absolute() or ".." in path.parts or "\0" in value:
            raise ConfigError(
                f"'{section}.{key}' = {value!r} must be a relative path inside the run folder (not empty, not "
                f"absolute, no '..'); use a plain name such as {getattr(type(getattr(cfg, section))(), key)!r}")


def _check_muon(o) -> None:
    """The Muon settings of ``[optimizer]`` (checked whatever ``name`` is, so a config that switches
    to Muon later holds no bad value). Raises ConfigError naming the key and what it may be."""
    for key in ("lr", "eps", "weight_decay"):
        if not math.isfinite(getattr(o, key)):
            raise ConfigError(f"'optimizer.{key}' must be finite, got {getattr(o, key)}")
    groups = o.muon_groups
    if not isinstance(groups, list) or not groups:
        raise ConfigError(f"'optimizer.muon_groups' must list at least one of {', '.join(MUON_GROUPS)}, got {groups!r}")
    if "routing" in groups:
        raise ConfigError("'optimizer.muon_groups' names \"routing\": routing parameters (pseudo-queries, key norms, "
                          f"null sources, delta gates) are never orthogonalised; use any of {', '.join(MUON_GROUPS)}")
    bad = [g for g in groups if g not in MUON_GROUPS]
    if bad:
        raise ConfigError(f"'optimizer.muon_groups' has unknown or non-matrix groups {bad}; valid: "
                          f"{', '.join(MUON_GROUPS)} (norms and biases are vectors and stay with AdamW)")
    if o.muon_lr is not None and not (math.isfinite(o.muon_lr) and o.muon_lr > 0):
        raise ConfigError(f"'optimizer.muon_lr' must be a finite number > 0 (or unset: optimizer.lr), got {o.muon_lr}")
    if o.muon_weight_decay is not None and not (math.isfinite(o.muon_weight_decay) and o.muon_weight_decay >= 0):
        raise ConfigError("'optimizer.muon_weight_decay' must be a finite number >= 0 (or unset: "
                          f"optimizer.weight_decay), got {o.muon_weight_decay}")
    if not 0.0 <= o.muon_momentum < 1.0:
        raise ConfigError(f"'optimizer.muon_momentum' must be in [0, 1), got {o.muon_momentum}")
    coefficients = o.muon_ns_coefficients
    if (not isinstance(coefficients, list) or len(coefficients) != 3
            or not all(isinstance(c, (int, float)) and not isinstance(c, bool) and math.isfinite(c)
                       for c in coefficients)):
        raise ConfigError("'optimizer.muon_ns_coefficients' must be three finite numbers (a, b, c), e.g. "
                          f"[3.4445, -4.775, 2.0315], got {coefficients!r}")
    if not 1 <= o.muon_ns_steps <= 99:
        raise ConfigError(f"'optimizer.muon_ns_steps' must be 1 to 99 Newton-Schulz iterations, got {o.muon_ns_steps}")
    if not (math.isfinite(o.muon_eps) and o.muon_eps > 0):
        raise ConfigError(f"'optimizer.muon_eps' must be a finite number > 0, got {o.muon_eps}")


def job_model_args(cfg: JobConfig):
    """The ``ModelArgs`` of ``cfg``'s ``[model]`` at ``training.seq_len`` without a tokenizer
    (``models.args.resolve_model_args``): resolved once, by ``validate``, and kept on ``cfg`` while
    ``[model]`` and ``training.seq_len`` stay as they are (a changed config is resolved again). The
    trainer and the dry run size them for the tokenizer (``models.args.sized_for_tokenizer``).

    Raises:
        ConfigError: unknown flavor or field, arguments ``ModelArgs`` rejects, or ``seq_len``
            above an explicit max_seq_len.
    """
    from mhar_titan.models.args import resolve_model_args

    key = (cfg.model.flavor, repr(cfg.model.overrides), cfg.training.seq_len)
    kept = cfg.__dict__.get("_model_args")
    if kept is None or kept[0] != key:
        kept = cfg.__dict__["_model_args"] = (key, resolve_model_args(cfg.model, cfg.training.seq_len))
    return kept[1]


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
    bad = [g for g in cfg.optimizer.no_decay if g not in NO_DECAY_GROUPS]
    if bad:
        raise ConfigError(f"'optimizer.no_decay' has unknown groups {bad}; valid: {', '.join(NO_DECAY_GROUPS)}")
    _check_run_folder_names(cfg)
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
    _check_muon(o)
    job_model_args(cfg)  # resolved here, kept for the trainer and the dry run; the tokenizer's vocabulary at build
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
    if not t.z_loss >= 0:
        raise ConfigError(f"'training.z_loss' must be >= 0 (0 disables it), got {t.z_loss}")
    if not 0 <= t.ema_decay < 1:
        raise ConfigError(f"'training.ema_decay' must be in [0, 1) (0 disables the weight EMA), got {t.ema_decay}")
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
    if not (math.isfinite(cfg.parallelism.timeout_s) and cfg.parallelism.timeout_s > 0):
        raise ConfigError(f"'parallelism.timeout_s' must be a finite number of seconds > 0 (the process group's "
                          f"collective timeout, default 600), got {cfg.parallelism.timeout_s}")
    if t.loss_chunk_tokens < 1:
        raise ConfigError(f"'training.loss_chunk_tokens' must be >= 1 (tokens per chunk of the chunked loss), "
                          f"got {t.loss_chunk_tokens}")
    bad = [c for c in cfg.compile.components if c not in ("model", "loss", "whole_model")]
    if bad:
        raise ConfigError(f"'compile.components' has unknown entries {bad}; valid: 'model', 'loss', 'whole_model'")
    if "whole_model" in cfg.compile.components and len(set(cfg.compile.components)) > 1:
        raise ConfigError(
            f"'compile.components' = {cfg.compile.components}: 'whole_model' compiles the blocks and the loss "
            "with the rest of the model; list it alone (components = [\"whole_model\"])"
        )
    if cfg.metrics.log_freq < 1:
        raise ConfigError("'metrics.log_freq' must be >= 1")
    v = cfg.validation
    if v.steps is not None:
        rows = v.local_batch_size if v.local_batch_size > 0 else t.local_batch_size
        raise ConfigError(
            f"'validation.steps' counted micro-batches, so the validation set changed with the batch layout; "
            f"it is replaced by 'validation.sequences', a fixed number of sequences. For the set {v.steps} steps "
            f"gave on one rank, set validation.sequences = {v.steps * rows} (steps x {rows} sequences per "
            f"micro-batch, times the number of ranks for a multi-rank run) and remove validation.steps"
        )
    if v.enable and (v.freq < 1 or v.sequences < 1):
        raise ConfigError("'validation.freq' and 'validation.sequences' must be >= 1 when validation is enabled")
    if v.enable and v.tokens is not None and v.tokens < t.seq_len:
        raise ConfigError(f"'validation.tokens' = {v.tokens} is less than one sequence of training.seq_len = "
                          f"{t.seq_len} tokens; set it to a multiple of {t.seq_len} (it counts whole sequences)")
    if cfg.profiling.profile_freq < 1:
        raise ConfigError("'profiling.profile_freq' must be >= 1")


# --------------------------------------------------------------------------- writing


def toml_value(v: Any) -> str:
    """One value as a one-line TOML literal: scalars (bool, int, float, str) written by ``tomli_w``
    (strings with every control character, newline and quote escaped), lists and tuples as arrays,
    dicts as inline tables of such values.

    Raises:
        TypeError: a value TOML cannot hold (None, an object).
    """
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):  # None (unset) entries are left out, as unset keys are commented out
        return "{" + ", ".join(f"{_toml_key(str(k))} = {toml_value(x)}" for k, x in v.items() if x is not None) + "}"
    if not isinstance(v, (bool, int, float, str)):
        raise TypeError(f"cannot write {type(v).__name__} to TOML")
    import tomli_w

    return tomli_w.dumps({"v": v})[len("v = "):-1]


def to_toml(cfg: JobConfig) -> str:
    """The resolved config as TOML text (``tomli_w``), read back by ``load_config`` to an equal
    config; keys that are unset (None) are written as comments."""
    lines = ["# Resolved configuration (defaults < TOML < command line), written by mhar_titan"]
    for section, values in cfg.to_dict().items():
        lines.append(f"\n[{section}]")
        for key, value in values.items():
            lines.append(f"# {key} = (unset)" if value is None else f"{_toml_key(key)} = {toml_value(value)}")
    return "\n".join(lines) + "\n"


def _toml_key(key: str) -> str:
    import tomli_w

    return tomli_w.dumps({key: 0})[: -len(" = 0\n")]
