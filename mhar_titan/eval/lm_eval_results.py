"""Where ``python -m mhar_titan.eval lm-eval --output-path`` puts lm-eval's results, and what they say.

lm-eval's own ``EvaluationTracker`` writes the files (its results JSON: scores, task configs,
versions, hashes, timing; with ``--log-samples`` one ``samples_<task>_<date>.jsonl`` per task).
Around it:

- ``--output-path x.json``: the results file is exactly ``x.json`` (lm-eval itself would write
  ``x_<date>.json``); samples go beside it;
- ``--output-path FOLDER``: lm-eval's layout, ``FOLDER/<run>_step-<N>/results_<date>.json`` (the
  subfolder named after the run and step, where lm-eval would use a random name for a model
  passed as an object);
- the results' ``config`` records ``model = "mhar_titan"`` (the name the adapter is registered
  under), ``model_args`` (run folder, checkpoint, step, device, batch size: what
  ``model_args="run=...,step=..."`` of the registered model would take) and, from
  ``MharLM.get_model_info``, the family, tokenizer and model arguments;
- ``save_results`` returns the paths written, which the command prints.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from mhar_titan.errors import UserError
from mhar_titan.files import check_output_folder


class ResultsWriteError(UserError):
    """lm-eval wrote no results file where it was asked to (it logs write errors and goes on)."""


def check_output_path(output_path: str | os.PathLike) -> None:
    """Refuse, before anything is loaded, an ``--output-path`` that cannot be written: a ``.json``
    path that is a folder, or a folder (or the ``.json`` file's folder) that is a file or read-only.

    Raises:
        OutputFolderError / ResultsWriteError: the message names the path and the fix.
    """
    path = Path(output_path)
    if path.suffix == ".json":
        if path.is_dir():
            raise ResultsWriteError(f"--output-path {path} is a folder; name a new .json file, or pass the folder "
                                    "without the .json suffix")
        check_output_folder(path.parent, "--output-path")
    else:
        check_output_folder(path, "--output-path")


def tracker(output_path: str | os.PathLike):
    """lm-eval's ``EvaluationTracker`` for ``output_path`` (pass it to ``simple_evaluate``)."""
    from lm_eval.loggers import EvaluationTracker

    return EvaluationTracker(output_path=str(output_path))


def attribute(results: dict, model_args: dict) -> None:
    """Name the model in lm-eval's ``results["config"]``: ``model = "mhar_titan"`` and ``model_args``
    (module docstring)."""
    results.setdefault("config", {}).update(model="mhar_titan", model_args=model_args)


def save_results(evaluation_tracker, results: dict, samples: Optional[dict], *, output_path: str | os.PathLike,
                 model_name: str, folder_name: str, log_samples: bool) -> tuple[Path, list[Path]]:
    """Write ``results`` (and ``samples`` with ``log_samples``) through ``evaluation_tracker``;
    returns (the results file, the samples files) where they ended up (module docstring).

    Args:
        model_name: lm-eval's ``model_name`` in the results file (the checkpoint folder).
        folder_name: the subfolder of a folder ``output_path`` (``<run>_step-<N>``).

    Raises:
        ResultsWriteError: lm-eval wrote no results file (a full disk, a permission change).
    """
    path = Path(output_path)
    general = evaluation_tracker.general_config_tracker
    general.model_name, general.model_name_sanitized = model_name, folder_name
    where = path.parent if path.suffix == ".json" else path / folder_name
    before = set(where.glob("*")) if where.is_dir() else set()
    evaluation_tracker.save_results_aggregated(results=results, samples=samples if log_samples else None)
    if log_samples:
        for task in results["configs"]:
            evaluation_tracker.save_results_samples(task_name=task, samples=samples[task])
    new = sorted(set(where.glob("*")) - before) if where.is_dir() else []
    written = [p for p in new if p.suffix == ".json"]
    if len(written) != 1:
        raise ResultsWriteError(f"lm-eval wrote no results file in {where} (see its log above); the scores are in "
                                "the table printed")
    result_file = written[0]
    if path.suffix == ".json":
        os.replace(result_file, path)
        result_file = path
    return result_file, [p for p in new if p.suffix == ".jsonl"]
