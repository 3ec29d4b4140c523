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
        WriteError: lm-eval could not write (a full disk): it logged that and went on; the files it
            left are removed and the failure is the one-line error of every writer (``_lm_eval_writes``).
        ResultsWriteError: lm-eval wrote no results file (and logged nothing).
    """
    path = Path(output_path)
    general = evaluation_tracker.general_config_tracker
    general.model_name, general.model_name_sanitized = model_name, folder_name
    where = path.parent if path.suffix == ".json" else path / folder_name
    before = set(where.glob("*")) if where.is_dir() else set()

    def save():
        evaluation_tracker.save_results_aggregated(results=results, samples=samples if log_samples else None)
        if log_samples:
            for task in results["configs"]:
                evaluation_tracker.save_results_samples(task_name=task, samples=samples[task])

    _lm_eval_writes(where, save)
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


def _lm_eval_writes(folder: Path, save) -> None:
    """Run lm-eval's own writer ``save()``. lm-eval catches a failed write (a full disk) and only
    logs it, leaving a partial file: its log is read here instead; then what it wrote under
    ``folder`` in this call is removed and the failure raised, in one line, through the project's
    full-disk handling (``mhar_titan.files.swallowed_write_error``). What lm-eval logs on success
    is printed on stderr as before.

    Raises:
        WriteError: lm-eval logged that it could not save (the message names the folder and the disk).
    """
    import logging
    import sys

    from mhar_titan.files import swallowed_write_error

    class Log(logging.Handler):
        def __init__(self):
            super().__init__(logging.INFO)
            self.lines: list[str] = []

        def emit(self, record):
            self.lines.append(record.getMessage())

    before = set(folder.rglob("*")) if folder.is_dir() else set()
    created = [p for p in (folder, *folder.parents) if not p.exists()]  # folders lm-eval may create
    logger, handler = logging.getLogger("lm_eval"), Log()  # its modules log under lm_eval.*
    logger.addHandler(handler)
    try:
        save()
    finally:
        logger.removeHandler(handler)
    if any(line.startswith("Could not save") for line in handler.lines):
        for p in sorted(set(folder.rglob("*")) - before, reverse=True) if folder.is_dir() else ():
            p.unlink() if p.is_file() else p.rmdir()  # files first, then the folders they were in
        for p in created:  # innermost first
            if p.is_dir() and not any(p.iterdir()):
                p.rmdir()
        raise swallowed_write_error(folder, "; ".join(handler.lines))
    for line in handler.lines:
        print(f"lm-eval: {line}", file=sys.stderr)
