"""Which checkpoint a path names, and the run folder's resolved config.

``find_checkpoint`` turns what a user passes to ``generate``, ``eval``, ``analysis`` and
``convert export`` (a run folder, or one of its ``checkpoints/step-N`` folders) into the run
folder and the ``step-N`` folder to read; ``read_run_config`` reads the run's ``config.toml``
(where its checkpoints go, its data and metrics settings). Neither imports torch.
"""
from __future__ import annotations

import pathlib
from typing import Optional

from mhar_titan.checkpoint.layout import is_complete, step_folders
from mhar_titan.config import ConfigError, JobConfig, load_config
from mhar_titan.config.parser import read_toml
from mhar_titan.errors import missing_path


def _is_checkpoint(path: pathlib.Path) -> bool:
    return (path / ".metadata").is_file()


def read_run_config(run_dir: pathlib.Path) -> Optional[JobConfig]:
    """The resolved ``config.toml`` of a run folder, or None when it has none.

    Raises:
        ConfigError: the file exists but is empty, cannot be read, is not valid TOML or holds no
            ``[training]`` table: never replaced by defaults (they would evaluate at another
            sequence length, on other files).
    """
    path = pathlib.Path(run_dir) / "config.toml"
    if not path.is_file():
        return None
    fix = (f"restore it (an earlier version may be in {path.with_name('config.prev.toml').name}), or move it "
           "away to use the checkpoint's model with default data settings")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"run config {path} cannot be read ({e}); {fix}") from None
    if not text.strip():
        raise ConfigError(f"run config {path} is empty ({path.stat().st_size} bytes; a full disk while it was "
                          f"written?); {fix}")
    try:
        tables = read_toml(path, "run config")
    except ConfigError as e:
        raise ConfigError(f"run config {e}; {fix}") from None
    if "training" not in tables:
        raise ConfigError(f"run config {path} is not a resolved config (no [training] table); {fix}")
    return load_config(str(path))


def find_checkpoint(path: str | pathlib.Path, step: Optional[int] = None) -> tuple[pathlib.Path, pathlib.Path]:
    """(run folder, ``step-N`` folder) for a run folder (newest complete checkpoint, or ``step``)
    or for a checkpoint folder itself.

    Raises:
        FileNotFoundError: the path does not exist, or holds no complete checkpoint (or not ``step``);
            the message lists the complete steps there.
    """
    path = pathlib.Path(path)
    if not path.exists():
        parent = path.parent
        runs = sorted(p.name for p in parent.iterdir() if (p / "config.toml").is_file()) if parent.is_dir() else []
        there = f"; run folders in {parent}: {', '.join(runs[:10])}{', ...' if len(runs) > 10 else ''}" if runs else ""
        raise FileNotFoundError(f"{path} does not exist; pass a run folder (<dump_folder>/<job.name>) "
                                f"or one of its checkpoints/step-N folders{there}")
    if path.is_file():
        raise FileNotFoundError(f"{missing_path(path, 'folder')}; pass a run folder (<dump_folder>/<job.name>) or one "
                                "of its checkpoints/step-N folders")
    if _is_checkpoint(path):
        if step is not None:
            raise ValueError(f"{path} is a checkpoint folder already; drop the step ({step}) or pass the run folder")
        return path.parent.parent, path
    cfg = read_run_config(path)
    folder = path / (cfg.checkpoint.folder if cfg is not None else "checkpoints")
    complete = {s: p for s, p in step_folders(folder).items() if is_complete(p)}
    if not complete:
        raise FileNotFoundError(f"{path} holds no complete checkpoint (looked in {folder}); train with "
                                "checkpoint.enable = true, or pass a step-N folder")
    if step is None:
        step = max(complete)
    if step not in complete:
        raise FileNotFoundError(f"{folder} has no complete checkpoint step-{step}; complete steps: {sorted(complete)}")
    return path, complete[step]
