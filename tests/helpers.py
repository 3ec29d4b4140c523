"""Helpers shared by the tests and their worker scripts: the repository root and run-folder readers.

Import with ``from helpers import ...`` (pytest puts tests/ on ``sys.path``; worker
scripts run from tests/ have it as their script folder).
"""
import json
import math
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
"""The repository root."""


def read_metrics(run_dir, name: str = "metrics.jsonl") -> list[dict]:
    """The rows of a run folder's JSONL metrics file, in file order; [] when it does not exist."""
    path = pathlib.Path(run_dir) / name
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def metric_losses(run_dir) -> list[float]:
    """The training loss of every logged step, in step order (the sinks write a NaN as "nan")."""
    rows = sorted((r for r in read_metrics(run_dir) if "loss" in r), key=lambda r: r["step"])
    return [math.nan if r["loss"] == "nan" else float(r["loss"]) for r in rows]
