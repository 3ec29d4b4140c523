"""lm-eval tasks by name: finding them (local YAML folders first) and running them on an ``MharLM``.

The one place that turns task names into lm-eval's ``TaskManager`` and calls
``lm_eval.simple_evaluate``: the ``lm-eval`` and ``paired`` commands and the trainer's
in-training evaluation (``components/downstream.py``) all run tasks through ``run_tasks``, so
their numbers are computed by the same code. lm-eval is optional (the ``lm-eval`` extra);
``require_lm_eval`` says how to install it.
"""
from __future__ import annotations

import pathlib
from typing import Optional, Sequence

from mhar_titan.errors import missing_path

LM_EVAL_MISSING = "needs lm-eval: pip install 'mhar-titan[lm-eval]'"


def require_lm_eval(what: str):
    """The ``lm_eval`` module; ValueError naming ``what`` and the install command when it is missing."""
    try:
        import lm_eval
        import lm_eval.tasks  # noqa: F401
    except ImportError:
        raise ValueError(f"{what} {LM_EVAL_MISSING}") from None
    return lm_eval


def check_include_paths(include_path: Optional[Sequence[str]], setting: str = "--include-path") -> None:
    """Each folder exists (FileNotFoundError naming ``setting`` otherwise); nothing is imported."""
    for folder in include_path or ():
        if not pathlib.Path(folder).is_dir():
            raise FileNotFoundError(f"{setting} {missing_path(folder, 'folder')}: pass a folder of lm-eval task YAML "
                                    "files (e.g. eval_tasks)")


def task_manager(tasks: Sequence[str], include_path: Optional[Sequence[str]] = None,
                 setting: str = "--include-path"):
    """A ``TaskManager`` that knows every name in ``tasks``.

    Indexing lm-eval's thousands of built-in task files takes a while, so the local folders
    (``include_path``) are indexed alone first and the built-in tasks only when a name is not
    found there.

    Raises:
        FileNotFoundError: a folder of ``include_path`` does not exist.
        ValueError: lm-eval is not installed, or knows no task of that name (the message names it).
    """
    require_lm_eval("lm-eval tasks")
    from lm_eval.tasks import TaskManager

    check_include_paths(include_path, setting)
    include = list(include_path) if include_path else None
    manager = TaskManager(include_path=include, include_defaults=False) if include else None
    if manager is None or not all(manager.match_tasks([t]) for t in tasks):
        manager = TaskManager(include_path=include)
    unknown = [t for t in tasks if not manager.match_tasks([t])]
    if unknown:
        where = f" (nor in {', '.join(include)})" if include else f" (local tasks: {setting} FOLDER)"
        raise ValueError(f"lm-eval knows no task {', '.join(unknown)}{where}")
    return manager


MIN_EXAMPLES = 100
"""Examples a task must score to say anything about one model against another: below it, an accuracy
near 0.5 is uncertain by more than +/-0.1 (95%: 1.96 x sqrt(0.25 / n)), and lm-eval's standard error
is 0 whenever every example agrees (0 +/- 0 from 8 examples)."""


def few_examples(results: dict, minimum: int = MIN_EXAMPLES) -> list[str]:
    """One warning per task of lm-eval's ``results`` (its ``n-samples``) that scored fewer than
    ``minimum`` examples: how many, how uncertain that leaves an accuracy, and the way out."""
    out = []
    for task, counts in (results.get("n-samples") or {}).items():
        n = counts.get("effective", counts.get("original")) if isinstance(counts, dict) else None
        if isinstance(n, int) and 0 < n < minimum:
            out.append(f"{task} scored {n} examples, too few to tell models apart: an accuracy from {n} examples is "
                       f"uncertain by up to +/-{1.96 * (0.25 / n) ** 0.5:.2f} (95%), and its stderr is 0 whenever every "
                       f"example agrees; score at least {minimum} (a larger limit, or a larger task such as "
                       "shakespeare_next_line, 400 examples)")
    return out


def run_tasks(lm, tasks: Sequence[str], manager, *, model_args=None, limit: Optional[int] = None,
              num_fewshot: Optional[int] = None, log_samples: bool = False, evaluation_tracker=None,
              bootstrap_iters: int = 100_000, seeded: bool = True) -> dict:
    """``lm_eval.simple_evaluate`` of ``tasks`` on ``lm`` (an ``MharLM``); returns lm-eval's results dict
    (``results``, ``configs``, ``higher_is_better``, ``n-samples``, and ``samples`` with ``log_samples``).

    ``seeded=False`` leaves the process's random generators alone (lm-eval seeds Python's,
    NumPy's and torch's global generators by default; few-shot sampling keeps its own seed).
    ``bootstrap_iters``: lm-eval's resamples for its standard errors (0: none, faster).
    ``model_args``: what lm-eval records as the model's arguments in its results.

    Raises:
        ValueError: a task's data could not be downloaded (no hub access); the message says how
            to run it from local files.
    """
    import lm_eval

    seeds = {} if seeded else dict(random_seed=None, numpy_random_seed=None, torch_random_seed=None)
    try:
        return lm_eval.simple_evaluate(model=lm, model_args=model_args, tasks=list(tasks), limit=limit,
                                       num_fewshot=num_fewshot,
                                       log_samples=log_samples, evaluation_tracker=evaluation_tracker,
                                       task_manager=manager, bootstrap_iters=bootstrap_iters, **seeds)
    except ConnectionError as e:  # datasets / huggingface_hub without hub access (offline mode, no network)
        raise ValueError(
            f"lm-eval could not download the data of task(s) {', '.join(tasks)} ({str(e).rstrip('.')}). Without "
            "hub access, describe each task in a local YAML file whose dataset_path and dataset_kwargs point at "
            "local files (as eval_tasks/shakespeare/ does) and pass its folder with --include-path DIR, or fill "
            "the datasets cache (HF_HOME) where the hub is reachable") from None
