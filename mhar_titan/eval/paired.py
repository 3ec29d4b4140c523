"""``python -m mhar_titan.eval paired RUN_A RUN_B --tasks ...``: two checkpoints on the same examples.

Each of RUN_A and RUN_B is a run folder (its newest checkpoint), a ``step-N`` checkpoint folder,
a pretrained folder the export command wrote (``config.json`` beside the weights), or a folder
of results already scored (lm-eval's ``results_*.json`` and ``samples_*.jsonl`` files, as
``eval lm-eval --output-path DIR --log-samples`` and this command write them). The command runs
lm-eval on both (per-example logging on), pairs the examples by lm-eval's document id and filter,
and prints for every task and metric: both scores, the difference B - A, and:

* a metric with one number per example (``acc``, ``acc_norm``, ``exact_match``, ...): paired.
  Its difference's 95% interval is a percentile bootstrap over examples (the same resampled
  examples for both runs; ``--bootstrap-resamples``, seeded by ``--seed``). When every
  per-example value is 0 or 1 the table also gives the discordant counts (examples only A got
  right, only B got right) and the exact McNemar test: the two-sided binomial test of the
  discordant pairs against p = 1/2 (McNemar 1947; the exact form as in the MHAR paper's
  Table 3 significance column, docs/MHAR_SPEC.md section 3.4).
* a corpus-level metric (perplexities, bits per byte, BLEU, F1, MCC: lm-eval aggregates
  per-example pieces, not a mean): reported unpaired (both values and the difference, no test),
  and the table says so.

Pairing needs the same examples: the two runs must have scored the same documents (lm-eval's
``doc_hash``) with the same prompts (``prompt_hash``: the same template and few-shot examples)
and targets; otherwise the command refuses, naming the task and the first difference.

The table goes to stdout and the same rows as JSON to ``OUTPUT/paired.json``; the two runs' lm-eval
results and samples go to ``OUTPUT/a`` and ``OUTPUT/b`` (reusable as RUN_A / RUN_B later). An
OUTPUT that already holds an earlier comparison (its ``paired.json``, or results in the ``a/`` or
``b/`` the command would score into) is refused before anything is loaded, unless ``--overwrite``:
then those are replaced (a scored folder given as RUN_A or RUN_B is read, never cleared).
"""
from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import sys
from typing import Optional, Sequence

import numpy as np

from mhar_titan.files import OVERWRITE_FLAG, OutputFolderError, check_new_outputs, check_output_folder, write_text

SAMPLE_KEYS = ("doc_id", "doc_hash", "prompt_hash", "target_hash", "filter", "metrics")
"""What a per-example log must hold to be paired (lm-eval >= 0.4.2 writes them)."""


class ExampleSetError(ValueError):
    """The two runs were not scored on the same examples (documents, prompts or targets differ)."""


# --------------------------------------------------------------------------- statistics


def mcnemar_p(a_only: int, b_only: int) -> float:
    """Exact two-sided McNemar p-value: the binomial test of ``b_only`` successes in
    ``a_only + b_only`` discordant pairs against p = 1/2 (``scipy.stats.binomtest``); 1.0 when
    there is no discordant pair.

    Raises:
        ValueError: a negative count.
    """
    if a_only < 0 or b_only < 0:
        raise ValueError(f"discordant counts must be >= 0, got {a_only} and {b_only}")
    n = a_only + b_only
    if n == 0:
        return 1.0
    from scipy.stats import binomtest

    return float(binomtest(b_only, n, 0.5, alternative="two-sided").pvalue)


def bootstrap_interval(diffs: Sequence[float], resamples: int = 10_000, seed: int = 0,
                       level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of the paired differences ``diffs`` (one per
    example, B - A): ``resamples`` draws of n examples with replacement from a NumPy generator
    seeded with ``seed`` (``scipy.stats.bootstrap``, method "percentile"). One example gives
    the degenerate interval (d, d).

    Raises:
        ValueError: no example, or ``level`` outside (0, 1), or ``resamples`` < 1.
    """
    d = np.asarray(diffs, dtype=np.float64)
    if d.size == 0:
        raise ValueError("no paired example to bootstrap")
    if not 0 < level < 1 or resamples < 1:
        raise ValueError(f"need 0 < level < 1 and resamples >= 1, got {level} and {resamples}")
    if d.size == 1 or np.all(d == d[0]):
        return float(d[0]), float(d[0])
    from scipy.stats import bootstrap

    res = bootstrap((d,), np.mean, n_resamples=resamples, confidence_level=level, method="percentile",
                    rng=np.random.default_rng(seed), vectorized=True, batch=max(1, 2**24 // d.size))
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


# --------------------------------------------------------------------------- pairing


@dataclasses.dataclass(frozen=True)
class PairedRow:
    """One task's metric for runs A and B (``diff`` = B - A)."""

    task: str
    metric: str
    filter: str
    n: int
    """Examples (0 for an unpaired row: the metric is not per example)."""
    a: float
    b: float
    diff: float
    paired: bool
    """The examples were paired (the metric has one number per example)."""
    a_only: Optional[int] = None
    """Examples where A scored 1 and B 0 (binary metrics only)."""
    b_only: Optional[int] = None
    p_value: Optional[float] = None
    """Exact McNemar p-value (binary metrics only)."""
    ci_low: Optional[float] = None
    ci_high: Optional[float] = None
    note: str = ""


def _number(v) -> Optional[float]:
    """A per-example metric value as a float; None for a piece of a corpus-level metric (a list)."""
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)):
        return float(v)
    return None


def _index(task: str, samples: list[dict], which: str) -> dict[tuple, dict]:
    missing = [k for k in SAMPLE_KEYS if samples and k not in samples[0]]
    if missing:
        raise ValueError(f"the samples of task {task} of run {which} lack {', '.join(missing)} (an older lm-eval "
                         "wrote them?); score the run again with this command")
    out = {}
    for s in samples:
        out[(int(s["doc_id"]), str(s["filter"]))] = s
    return out


def check_same_examples(task: str, a: dict[tuple, dict], b: dict[tuple, dict]) -> None:
    """The two runs' samples of ``task`` cover the same (document, filter) keys with the same
    document, prompt and target hashes.

    Raises:
        ExampleSetError: the first difference, named.
    """
    only_a, only_b = sorted(set(a) - set(b)), sorted(set(b) - set(a))
    if only_a or only_b:
        first = (only_a or only_b)[0]
        raise ExampleSetError(
            f"task {task}: the runs were scored on different example sets ({len(a)} examples in A, {len(b)} in B; "
            f"{len(only_a)} only in A, {len(only_b)} only in B, e.g. doc_id {first[0]} filter {first[1]!r} only in "
            f"{'A' if only_a else 'B'}); score both with the same tasks, --limit and task files")
    for key in sorted(a):
        for field, what in (("doc_hash", "documents"), ("prompt_hash", "prompts (template or few-shot examples)"),
                            ("target_hash", "targets")):
            if a[key][field] != b[key][field]:
                raise ExampleSetError(
                    f"task {task}: the runs were scored on different example sets: doc_id {key[0]} has different "
                    f"{what} in A and B ({field} {a[key][field][:12]} vs {b[key][field][:12]}); score both with the "
                    "same task files and --num-fewshot")


def pair_task(task: str, samples_a: list[dict], samples_b: list[dict], aggregated_a: dict, aggregated_b: dict,
              resamples: int = 10_000, seed: int = 0) -> list[PairedRow]:
    """The rows of one task: every metric of every filter, paired where the metric is per example.

    ``samples_*``: lm-eval's per-example logs of the task (``results["samples"][task]``);
    ``aggregated_*``: its aggregated results (``results["results"][task]``, keys ``"metric,filter"``).

    Raises:
        ExampleSetError: the runs scored different examples (``check_same_examples``).
    """
    a, b = _index(task, samples_a, "A"), _index(task, samples_b, "B")
    check_same_examples(task, a, b)
    rows = []
    filters = sorted({key[1] for key in a})
    for flt in filters:
        keys = sorted(k for k in a if k[1] == flt)
        metrics = list(a[keys[0]]["metrics"])
        for metric in metrics:
            va = [_number(a[k].get(metric)) for k in keys]
            vb = [_number(b[k].get(metric)) for k in keys]
            if any(v is None for v in va + vb):  # corpus-level: aggregated over per-example pieces
                agg_a, agg_b = aggregated_a.get(f"{metric},{flt}"), aggregated_b.get(f"{metric},{flt}")
                if not isinstance(agg_a, (int, float)) or not isinstance(agg_b, (int, float)):
                    continue
                rows.append(PairedRow(task, metric, flt, 0, float(agg_a), float(agg_b), float(agg_b) - float(agg_a),
                                      paired=False, note="unpaired: a corpus-level metric, not a mean over examples"))
                continue
            xa, xb = np.array(va), np.array(vb)
            diffs = xb - xa
            low, high = bootstrap_interval(diffs, resamples, seed)
            binary = bool(np.isin(xa, (0.0, 1.0)).all() and np.isin(xb, (0.0, 1.0)).all())
            extra = {}
            if binary:
                a_only, b_only = int(((xa == 1) & (xb == 0)).sum()), int(((xa == 0) & (xb == 1)).sum())
                extra = dict(a_only=a_only, b_only=b_only, p_value=mcnemar_p(a_only, b_only))
            rows.append(PairedRow(task, metric, flt, len(keys), float(xa.mean()), float(xb.mean()),
                                  float(diffs.mean()), paired=True, ci_low=low, ci_high=high,
                                  note="" if binary else "paired, not 0/1 per example: no McNemar test", **extra))
    return rows


def pair_results(results_a: dict, results_b: dict, tasks: Optional[Sequence[str]] = None,
                 resamples: int = 10_000, seed: int = 0) -> list[PairedRow]:
    """Rows for every task both results hold (or ``tasks``), in task order.

    ``results_*``: lm-eval results dicts with ``samples`` (``simple_evaluate(..., log_samples=True)``,
    or ``read_scored`` of a saved folder).

    Raises:
        ValueError: a task is missing from one side, or has no samples. ExampleSetError: see ``pair_task``.
    """
    names = list(tasks) if tasks else sorted(results_a.get("samples", {}))
    rows = []
    for task in names:
        for which, res in (("A", results_a), ("B", results_b)):
            if task not in res.get("samples", {}):
                raise ValueError(f"run {which} has no per-example results of task {task}; score it with this command "
                                 f"(or eval lm-eval --log-samples) on that task")
        rows += pair_task(task, results_a["samples"][task], results_b["samples"][task],
                          results_a["results"].get(task, {}), results_b["results"].get(task, {}), resamples, seed)
    return rows


# --------------------------------------------------------------------------- reading and scoring


def is_scored_folder(path: str | pathlib.Path) -> bool:
    """A folder holding lm-eval results files (``results_*.json``, at any depth)."""
    path = pathlib.Path(path)
    return path.is_dir() and any(path.rglob("results_*.json"))


def read_scored(path: str | pathlib.Path) -> dict:
    """lm-eval's results and samples saved under ``path`` (the newest results file of each task;
    ``samples_<task>_<time>.jsonl`` beside it) as a results dict with ``samples``.

    Raises:
        ValueError: no results file, or a task without its samples file (scored without --log-samples).
    """
    path = pathlib.Path(path)
    files = sorted(path.rglob("results_*.json"), key=lambda p: p.name)
    if not files:
        raise ValueError(f"{path} holds no lm-eval results file (results_*.json)")
    merged = {"results": {}, "samples": {}}
    for f in files:  # in time order: a later file's task replaces an earlier one's
        data = json.loads(f.read_text())
        stamp = f.stem[len("results_"):]
        for task in data.get("results", {}):
            samples = f.parent / f"samples_{task}_{stamp}.jsonl"
            if not samples.is_file():
                raise ValueError(f"{f} has no per-example file {samples.name} for task {task}: score with "
                                 "--log-samples (this command does)")
            merged["results"][task] = data["results"][task]
            merged["samples"][task] = [json.loads(line) for line in samples.read_text().splitlines() if line.strip()]
    return merged


def score(path: str, tasks: Sequence[str], manager, out: pathlib.Path, *, step: Optional[int] = None,
          device: str = "cpu", batch_size: int = 8, limit: Optional[int] = None,
          num_fewshot: Optional[int] = None) -> tuple[dict, str]:
    """lm-eval results (with samples) of a checkpoint or pretrained folder on ``tasks``, saved under
    ``out`` in lm-eval's layout; a scored folder is read instead. Returns (results, description)."""
    if is_scored_folder(path):
        return read_scored(path), f"{path} (scored earlier)"
    from mhar_titan.eval import lm_eval_results
    from mhar_titan.eval.lm_eval_adapter import MharLM
    from mhar_titan.eval.load import load_model
    from mhar_titan.eval.tasks import run_tasks

    loaded = load_model(path, step, device, routing_kernel="auto")
    lm = MharLM(loaded.model, loaded.tokenizer, batch_size=batch_size, source=loaded.source())
    model_args = {**loaded.source(), "device": device, "batch_size": batch_size}
    tracker = lm_eval_results.tracker(out)
    results = run_tasks(lm, tasks, manager, model_args=model_args, limit=limit, num_fewshot=num_fewshot,
                        log_samples=True, evaluation_tracker=tracker, bootstrap_iters=0)
    # the files go through lm-eval's tracker (lm_eval_results: the results' layout and attribution);
    # pairing reads them back, so a rerun from the folder gives the same table
    samples = results.pop("samples")
    lm_eval_results.attribute(results, model_args)
    lm_eval_results.save_results(tracker, results, samples, output_path=out, model_name=str(loaded.checkpoint),
                                 folder_name=f"{loaded.run_dir.name}_step-{loaded.step}", log_samples=True)
    return read_scored(out), f"{loaded.checkpoint} (step {loaded.step})"


# --------------------------------------------------------------------------- output


def _pct(v: Optional[float], signed: bool = False) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return f"{100 * v:+.2f}" if signed else f"{100 * v:.2f}"


def _value(row: PairedRow, v: float, signed: bool = False) -> str:
    if row.paired and row.metric.startswith(("acc", "exact_match", "em")):
        return _pct(v, signed)
    return f"{v:+.4g}" if signed else f"{v:.4g}"


def format_table(rows: Sequence[PairedRow], name_a: str, name_b: str, resamples: int, seed: int) -> str:
    """The rows as a markdown table (accuracy-like metrics in percent, difference B - A)."""
    head = ["task", "metric", "filter", "n", "A", "B", "B-A", "95% CI of B-A", "A only", "B only", "McNemar p", "note"]
    lines = [f"A: {name_a}", f"B: {name_b}",
             f"difference B - A; interval: percentile bootstrap over examples ({resamples} resamples, seed {seed}); "
             "p: exact McNemar (two-sided binomial test of the discordant examples)",
             "| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        ci = f"[{_value(r, r.ci_low, True)}, {_value(r, r.ci_high, True)}]" if r.ci_low is not None else "-"
        p = "-" if r.p_value is None else f"{r.p_value:.4g}"
        cells = [r.task, r.metric, r.filter, str(r.n) if r.paired else "-", _value(r, r.a), _value(r, r.b),
                 _value(r, r.diff, True), ci, "-" if r.a_only is None else str(r.a_only),
                 "-" if r.b_only is None else str(r.b_only), p, r.note]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def add_arguments(parser) -> None:
    """The ``paired`` subcommand's arguments."""
    parser.add_argument("run_a", help="run A: run folder, step-N folder, exported folder or scored results folder")
    parser.add_argument("run_b", help="run B (the difference is B - A)")
    parser.add_argument("--tasks", required=True, help="comma-separated lm-eval task names")
    parser.add_argument("--include-path", action="append", default=None,
                        help="a folder of local lm-eval task YAML files (repeatable), e.g. eval_tasks")
    from mhar_titan.cli_args import device, non_negative_int, positive_int

    parser.add_argument("--step-a", type=non_negative_int, default=None, help="checkpoint step of run A's run folder")
    parser.add_argument("--step-b", type=non_negative_int, default=None, help="checkpoint step of run B's run folder")
    parser.add_argument("--limit", type=positive_int, default=None, help="examples per task (the same for both)")
    parser.add_argument("--num-fewshot", type=non_negative_int, default=None)
    parser.add_argument("--device", type=device, default="cpu", help="cpu, cuda, cuda:N or mps")
    parser.add_argument("--batch-size", type=positive_int, default=8, help="sequences per forward")
    parser.add_argument("--output-path", default="paired_eval",
                        help="folder for paired.json and both runs' lm-eval results and samples (a/, b/)")
    parser.add_argument(OVERWRITE_FLAG, action="store_true",
                        help="replace an earlier comparison in --output-path (refused without it)")
    parser.add_argument("--bootstrap-resamples", type=positive_int, default=10_000)
    parser.add_argument("--seed", type=int, default=0, help="seed of the bootstrap's resampling")


def check_outputs(out: pathlib.Path, scored: Sequence[bool], overwrite: bool = False) -> None:
    """Refuse, before anything is loaded or scored, output paths the command could not write:
    ``out`` (``--output-path``) a file, read-only or under a file; ``out/a`` or ``out/b`` (where
    a run that is not a scored folder writes its results) a file; ``out/paired.json`` a folder;
    and, unless ``overwrite``, an earlier comparison there: ``out/paired.json``, or a non-empty
    ``out/a`` or ``out/b`` that would be scored into.

    Raises:
        OutputFolderError: naming the path and the fix.
        OutputExistsError: an earlier comparison, naming --overwrite and --output-path.
    """
    check_output_folder(out, "--output-path")
    for which, done in zip(("a", "b"), scored):
        if not done:
            check_output_folder(out / which, f"--output-path's {which}/ (run {which.upper()}'s lm-eval results)")
    if (out / "paired.json").is_dir():
        raise OutputFolderError(f"--output-path: {out / 'paired.json'} is a folder, where the command writes its "
                                "table as a file; remove it or choose another --output-path")
    earlier = [out / which for which, done in zip(("a", "b"), scored)
               if not done and (out / which).is_dir() and any((out / which).iterdir())]
    check_new_outputs([out / "paired.json", *earlier], overwrite, elsewhere="--output-path DIR")


def clear_scoring_folders(out: pathlib.Path, scored: Sequence[bool], runs: Sequence[str]) -> None:
    """Remove ``out/a`` and ``out/b`` where the command scores a run into them (``scored`` False
    for that side), so that an overwritten comparison's results do not pair with the new ones; a
    folder holding one of ``runs`` (RUN_A, RUN_B: read, not scored) is kept."""
    import shutil

    inputs = [pathlib.Path(r).resolve() for r in runs]
    for which, done in zip(("a", "b"), scored):
        folder = (out / which).resolve()
        if not done and folder.is_dir() and not any(r == folder or r.is_relative_to(folder) for r in inputs):
            shutil.rmtree(folder)


def run(args) -> str:
    """The command: score both runs, pair, write paired.json; returns the table."""
    from mhar_titan.eval.tasks import check_include_paths, require_lm_eval, task_manager

    tasks = [t for t in args.tasks.split(",") if t]
    if not tasks:
        raise ValueError("--tasks names no task")
    if args.bootstrap_resamples < 1:
        raise ValueError(f"--bootstrap-resamples must be >= 1, got {args.bootstrap_resamples}")
    for which, path in (("RUN_A", args.run_a), ("RUN_B", args.run_b)):
        if not pathlib.Path(path).exists():
            raise FileNotFoundError(f"{which} {path} does not exist; pass a run folder, a checkpoints/step-N folder, "
                                    "an exported model folder or a folder of scored results")
    check_include_paths(args.include_path)
    out = pathlib.Path(args.output_path)
    scored = [is_scored_folder(p) for p in (args.run_a, args.run_b)]
    check_outputs(out, scored, args.overwrite)
    if args.overwrite:
        clear_scoring_folders(out, scored, [args.run_a, args.run_b])
    manager = None
    if not all(scored):
        require_lm_eval("the paired command")
        manager = task_manager(tasks, args.include_path)
    results, names = [], []
    for which, path, step in (("a", args.run_a, args.step_a), ("b", args.run_b, args.step_b)):
        # what runs now (the scoring then shows its own progress: mhar_titan.progress)
        print(f"paired: run {which.upper()}: {'reading' if is_scored_folder(path) else 'scoring'} {path} on "
              f"{', '.join(tasks)}", file=sys.stderr, flush=True)
        res, name = score(path, tasks, manager, out / which, step=step, device=args.device,
                          batch_size=args.batch_size, limit=args.limit, num_fewshot=args.num_fewshot)
        results.append(res)
        names.append(name)
    print(f"paired: pairing the examples, {args.bootstrap_resamples} bootstrap resamples per metric", file=sys.stderr,
          flush=True)
    rows = pair_results(results[0], results[1], tasks, args.bootstrap_resamples, args.seed)
    from mhar_titan.eval.tasks import few_examples

    paired_n = {r.task: {"effective": r.n} for r in rows if r.paired}
    for warning in few_examples({"n-samples": paired_n}):
        print(f"paired: warning: {warning}", file=sys.stderr)
    out.mkdir(parents=True, exist_ok=True)
    write_text(out / "paired.json", json.dumps({
        "a": names[0], "b": names[1], "difference": "b - a", "bootstrap_resamples": args.bootstrap_resamples,
        "seed": args.seed, "rows": [dataclasses.asdict(r) for r in rows]}, indent=1) + "\n")
    return format_table(rows, names[0], names[1], args.bootstrap_resamples, args.seed) + \
        f"\n(json: {out / 'paired.json'})"
