"""Sweep files: one TOML description -> the list of training runs it stands for.

A sweep names a base job config and what varies around it::

    [sweep]
    name = "study_bytes"                     # run folders go to <dump_folder>/<run name>
    base = "train_configs/study_bytes.toml"  # the job every run starts from (path from the repo root)
    dump_folder = "outputs/sweeps/study_bytes"   # optional; default <base's job.dump_folder>/<name>
    seeds = [1, 2, 3]
    seed_keys = ["debug.seed", "data.seed"]  # optional (this default): keys set to the seed
    baseline = "baseline"                    # family the paired differences are taken against
    tail_evals = 11                          # validation evaluations in the tail mean (results)
    pairs = [["attnres", "mhar_h8"]]         # optional: (A, B) families whose paired difference
                                             # B - A the results report and plot (default: each
                                             # family minus the baseline)

    [sweep.set]                              # overrides of every run
    "training.steps" = 300

    [sweep.grid]                             # cartesian product: one run per combination
    "optimizer.lr" = [5e-4, 1e-3]

    [families]                               # the model families compared
    baseline = "baseline"                    # a row of mhar_titan.models.args.FAMILIES
    attnres = "attn_res H=1"
    mhar = { residual = "attn_res", routing_heads = [2, 4, 8] }   # a list expands: mhar_h2, mhar_h4, mhar_h8
    attnres_tau = { family = "attn_res H=1", routing_logit_scale = "match_heads:8" }   # a row plus keys

A family is a row of ``FAMILIES`` by name, or a table of keys, optionally starting from a row
(``family = "<row>"``; its other keys are added to the row's or replace them). A family's keys
without a dot are ``[model]`` fields (``ModelArgs``), keys with a dot any config key
(``optimizer.lr``). Each family's *arm* (``Sweep.arms``) says what it is in those terms: the row
and the keys added (``attn_res H=1 + routing_logit_scale=match_heads:8``), or the keys alone.
Runs are named ``<family>[_<grid tag>...]_s<seed>`` (``mhar_h8_lr0.001_s1``) and are the base
config plus ``--section.key=value`` overrides, in this order: ``[sweep.set]``, the family, the
grid point, ``job.dump_folder`` / ``job.name``, the seed keys.

Paired runs: every run of one seed sets ``debug.seed`` and ``data.seed`` to that seed, and families
change only ``[model]`` keys (or what they name), so the runs of one seed and grid point read the
same tokens in the same order (the data order depends on ``[data]``, the batch geometry and the
seed only; see ``mhar_titan.analysis.compare``). Model initialisation also follows ``debug.seed``.

Every run's config is loaded and validated by ``expand_sweep`` before anything is launched
(``ConfigError`` names the run and the bad key).
"""
from __future__ import annotations

import dataclasses
import itertools
import pathlib
from typing import Any, Optional

from mhar_titan.analysis.compare import check_pairs
from mhar_titan.config import ConfigError, JobConfig, load_config
from mhar_titan.config.parser import read_toml
from mhar_titan.errors import missing_path

SWEEP_KEYS = ("name", "base", "dump_folder", "seeds", "seed_keys", "baseline", "tail_evals", "pairs", "set",
              "grid", "slurm")
DEFAULT_SEED_KEYS = ("debug.seed", "data.seed")
# Short tags of run names for common keys (others use the key's last part).
SHORT_NAMES = {"routing_heads": "h", "optimizer.lr": "lr", "routing_head_layout": "", "training.steps": "steps"}
FAMILY_ROW_KEY = "family"
"""Key of a ``[families]`` table that names the ``FAMILIES`` row it starts from."""
_RESERVED = ("job.name", "job.dump_folder")


@dataclasses.dataclass(frozen=True)
class Run:
    """One training run of a sweep.

    name: run folder name. family: family name (after list expansion, e.g. ``mhar_h8``).
    point: the grid values of this run ((key, value), ...). seed: the seed.
    overrides: ``--section.key=value`` tokens applied to ``base``. run_dir: the run folder.
    config: the validated ``JobConfig``.
    """

    name: str
    family: str
    point: tuple[tuple[str, Any], ...]
    seed: int
    base: str
    overrides: tuple[str, ...]
    run_dir: pathlib.Path
    config: JobConfig = dataclasses.field(compare=False, repr=False)

    @property
    def group(self) -> str:
        """The run name without the seed: runs of one group differ only in their seed."""
        return self.name.rsplit("_s", 1)[0]

    @property
    def point_tag(self) -> str:
        """The grid point as the name part after the family ('' without a grid)."""
        return "".join(f"_{_tag(k, v)}" for k, v in self.point)

    def train_args(self) -> list[str]:
        """Arguments of ``train.py`` (and of ``slurm/train.sbatch``): ``--config BASE`` and the overrides."""
        return ["--config", self.base, *self.overrides]


@dataclasses.dataclass(frozen=True)
class Sweep:
    """A parsed sweep file: its settings and its runs in launch order (seed-major, so a partly
    finished sweep already holds complete paired comparisons)."""

    path: pathlib.Path
    name: str
    base: str
    dump_folder: pathlib.Path
    seeds: tuple[int, ...]
    baseline: str
    tail_evals: int
    families: tuple[str, ...]
    slurm_args: tuple[str, ...]
    runs: tuple[Run, ...]
    arms: dict[str, str] = dataclasses.field(default_factory=dict)
    """Family -> what the family is (module docstring: "arm"), e.g. ``"attn_res H=1 +
    routing_logit_scale=match_heads:8"``."""
    pairs: tuple[tuple[str, str], ...] = ()
    """(A, B) families whose paired difference B - A the results report (``[sweep] pairs``);
    empty: each family against the baseline."""


def _tag(key: str, value: Any) -> str:
    short = SHORT_NAMES.get(key, SHORT_NAMES.get(key.rpartition(".")[2], key.rpartition(".")[2]))
    text = f"{value:g}" if isinstance(value, float) else str(value)
    return f"{short}{text}"


def _cli_value(value: Any) -> str:
    """A TOML value as the command line writes it (strings raw, the rest as TOML literals)."""
    from mhar_titan.config.parser import toml_value

    return value if isinstance(value, str) else toml_value(value)


def _override(key: str, value: Any) -> str:
    return f"--{key}={_cli_value(value)}"


def _family_variants(name: str, spec: Any, where: str) -> list[tuple[str, dict, str]]:
    """(family name, {config key: value}, arm) for one ``[families]`` entry; list values expand.
    The arm names the ``FAMILIES`` row the family starts from and the keys it adds (module docstring)."""
    from mhar_titan.models.args import FAMILIES

    def row_of(row: Any, what: str) -> dict:
        if not isinstance(row, str) or row not in FAMILIES:
            raise ConfigError(f"{where}: family {name}{what} = {row!r} is not a row of mhar_titan.models.args.FAMILIES "
                              f"({', '.join(map(repr, FAMILIES))}); or give a table of [model] fields")
        return FAMILIES[row]

    if isinstance(spec, str):
        row_name, row, spec = spec, row_of(spec, ""), {}
    elif isinstance(spec, dict) and FAMILY_ROW_KEY in spec:
        row_name = spec[FAMILY_ROW_KEY]
        row = row_of(row_name, f".{FAMILY_ROW_KEY}")
        spec = {k: v for k, v in spec.items() if k != FAMILY_ROW_KEY}
    else:
        row_name, row = None, {}
    if not isinstance(spec, dict) or not (spec or row):
        raise ConfigError(f"{where}: family {name} must be a FAMILIES row name or a non-empty table of keys, "
                          f"got {spec!r}")
    added = {k if "." in k else f"model.{k}": v for k, v in spec.items()}
    settings = {**{f"model.{k}": v for k, v in row.items()}, **added}
    for key in settings:
        if key in _RESERVED:
            raise ConfigError(f"{where}: family {name} sets {key}, which the sweep sets itself")
    lists = [(k, v) for k, v in settings.items() if isinstance(v, list)]
    fixed = {k: v for k, v in settings.items() if not isinstance(v, list)}
    if any(not values for _, values in lists):
        raise ConfigError(f"{where}: family {name} has an empty list of values")
    variants = []
    for combo in itertools.product(*(values for _, values in lists)):
        chosen = dict(zip((k for k, _ in lists), combo))
        tag = "".join(f"_{_tag(k.removeprefix('model.'), v)}" for k, v in chosen.items())
        values = {**fixed, **chosen}
        keys = [f"{k.removeprefix('model.')}={_cli_value(values[k])}" for k in added]
        arm = " + ".join([row_name, *keys]) if row_name else ", ".join(keys)
        variants.append((name + tag, {k: values[k] for k in settings}, arm))
    return variants


def _table(raw: dict, key: str, where: str) -> dict:
    value = raw.get(key, {})
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: [sweep.{key}] must be a table of config keys, got {value!r}")
    for k in value:
        if "." not in k:
            raise ConfigError(f"{where}: [sweep.{key}] key {k!r} must be section.key (e.g. \"optimizer.lr\")")
        if k in _RESERVED:
            raise ConfigError(f"{where}: [sweep.{key}] sets {k}, which the sweep sets itself")
    return value


def load_sweep(path: str | pathlib.Path, extra_set: Optional[dict] = None,
               dump_folder: Optional[str | pathlib.Path] = None) -> Sweep:
    """Parse and expand a sweep file; every run's config is loaded and validated.

    extra_set: more ``[sweep.set]`` overrides ({"training.steps": 2}, e.g. for a smoke run);
    dump_folder: replaces ``sweep.dump_folder`` (keep smoke runs away from the real ones).

    Raises:
        FileNotFoundError: the sweep file or its base config does not exist.
        ConfigError: an unknown ``[sweep]`` key, a bad family or grid, a baseline that is no
            family, or a run whose config is invalid (the message names the run).
    """
    path = pathlib.Path(path)
    data = read_toml(path, "sweep file")
    where = str(path)
    unknown = sorted(set(data) - {"sweep", "families"})
    if unknown:
        raise ConfigError(f"{where}: unknown table(s) {unknown}; a sweep file has [sweep] and [families]")
    raw = data.get("sweep", {})
    bad = sorted(set(raw) - set(SWEEP_KEYS))
    if bad:
        raise ConfigError(f"{where}: unknown [sweep] key(s) {bad}; valid: {', '.join(SWEEP_KEYS)}")
    for key in ("name", "base", "seeds"):
        if key not in raw:
            raise ConfigError(f"{where}: [sweep] needs '{key}'")
    seeds = raw["seeds"]
    if not isinstance(seeds, list) or not seeds or not all(isinstance(s, int) and not isinstance(s, bool)
                                                             for s in seeds) or len(set(seeds)) < len(seeds):
        raise ConfigError(f"{where}: sweep.seeds must be a non-empty list of distinct integers, got {seeds!r}")
    seed_keys = raw.get("seed_keys", list(DEFAULT_SEED_KEYS))
    families_raw = data.get("families", {})
    if not isinstance(families_raw, dict) or not families_raw:
        raise ConfigError(f"{where}: [families] must name at least one family")
    variants = [v for name, spec in families_raw.items() for v in _family_variants(name, spec, where)]
    families = [(n, settings) for n, settings, _ in variants]
    names = [n for n, _ in families]
    if len(set(names)) < len(names):
        raise ConfigError(f"{where}: family names repeat after list expansion: {names}")
    baseline = raw.get("baseline", names[0])
    if baseline not in names:
        raise ConfigError(f"{where}: sweep.baseline {baseline!r} is none of the families {names}")
    pairs = check_pairs(raw.get("pairs", []), names, f"{where}: sweep.pairs")
    tail_evals = raw.get("tail_evals", 11)
    if not isinstance(tail_evals, int) or tail_evals < 1:
        raise ConfigError(f"{where}: sweep.tail_evals must be an integer >= 1, got {tail_evals!r}")
    common = {**_table(raw, "set", where), **_table({"set": extra_set or {}}, "set", "--set")}
    grid = _table(raw, "grid", where)
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise ConfigError(f"{where}: [sweep.grid] {key} must be a non-empty list of values, got {values!r}")
    slurm_args = raw.get("slurm", {}).get("args", []) if isinstance(raw.get("slurm", {}), dict) else None
    if not isinstance(slurm_args, list) or not all(isinstance(a, str) for a in slurm_args):
        raise ConfigError(f"{where}: [sweep.slurm] args must be a list of sbatch options (strings)")
    base = str(raw["base"])
    if not pathlib.Path(base).is_file():
        raise FileNotFoundError(f"{where}: base config {missing_path(base)} (paths are relative to the repository "
                                "root)")
    base_cfg = load_config(base)
    dump = pathlib.Path(dump_folder or raw.get("dump_folder", pathlib.Path(base_cfg.job.dump_folder) / str(raw["name"])))

    runs = []
    for seed in seeds:
        for point in itertools.product(*([(k, v) for v in values] for k, values in grid.items())):
            for family, settings in families:
                run = Run(name="", family=family, point=tuple(point), seed=seed, base=base, overrides=(),
                          run_dir=dump, config=base_cfg)
                name = f"{family}{run.point_tag}_s{seed}"
                overrides = [_override(k, v) for k, v in {**common, **settings, **dict(point)}.items()]
                overrides += [f"--job.dump_folder={dump}", f"--job.name={name}"]
                overrides += [_override(k, seed) for k in seed_keys]
                try:
                    cfg = load_config(base, overrides)
                except ConfigError as e:
                    raise ConfigError(f"{where}: run {name}: {e}") from e
                runs.append(dataclasses.replace(run, name=name, overrides=tuple(overrides), run_dir=dump / name,
                                                config=cfg))
    return Sweep(path=path, name=str(raw["name"]), base=base, dump_folder=dump, seeds=tuple(seeds),
                 baseline=baseline, tail_evals=tail_evals, families=tuple(names), slurm_args=tuple(slurm_args),
                 runs=tuple(runs), arms={n: arm for n, _, arm in variants}, pairs=pairs)


def paired_baseline(sweep: Sweep, run: Run) -> Optional[Run]:
    """The baseline-family run of the same seed and grid point (None for a baseline run itself)."""
    if run.family == sweep.baseline:
        return None
    return paired_run(sweep, run, sweep.baseline)


def paired_run(sweep: Sweep, run: Run, family: str) -> Run:
    """The run of ``family`` with the same seed and grid point as ``run`` (same tokens in the same order)."""
    return next(r for r in sweep.runs if r.family == family and r.seed == run.seed and r.point == run.point)
