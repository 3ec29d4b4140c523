"""``python -m mhar_titan.eval {perplexity,lm-eval,paired} RUN ...``: evaluate a run's checkpoint.

perplexity: validation loss and perplexity on held-out files (default: the run's
``data.validation_files``, at its ``training.seq_len``, its ``validation.sequences``).
lm-eval: run lm-eval tasks through ``MharLM`` (needs ``pip install 'mhar-titan[lm-eval]'``; stock
tasks download their data from the hub, local YAML tasks in an ``--include-path`` folder run
offline) and print lm-eval's results table; ``--output-path`` saves lm-eval's results file (and,
with ``--log-samples``, every sample's requests and answers): exactly there for a ``.json`` path,
else in ``FOLDER/<run>_step-<N>/``; the command prints the paths, and the results record the run
folder, checkpoint, step and family (``eval/lm_eval_results.py``).
paired: both of two checkpoints on the same lm-eval examples, the paired differences with their
exact McNemar p-values and bootstrap intervals (``mhar_titan.eval.paired``).
Every flag is checked before anything is loaded (``--device cuda`` on a CPU-only torch, a batch
size below 1, ...). Bad input: one line on stderr naming it, exit status 2; a full disk while
lm-eval writes its results too (``lm_eval_results.save_results``).
"""
from __future__ import annotations

import json
import sys

from mhar_titan.cli_args import ArgumentParser, device, non_negative_int, positive_int, run_command
from mhar_titan.eval import paired
from mhar_titan.eval.load import USER_ERRORS, load_run
from mhar_titan.eval.perplexity import evaluate_perplexity
from mhar_titan.eval.tasks import few_examples, require_lm_eval, run_tasks, task_manager


DEFAULT_LM_EVAL_BATCH_SIZE = 8
"""Requests per forward of ``lm-eval`` without ``--batch-size``."""


def _perplexity(args) -> dict:
    loaded = load_run(args.run, args.step, args.device)
    batches = loaded.validation_batches(args.files, args.batch_size, args.seq_len, args.batches)
    result = evaluate_perplexity(loaded.model, batches)
    return {"run": str(loaded.run_dir), "checkpoint": str(loaded.checkpoint), "step": loaded.step,
            "files": args.files or loaded.validation_data_config.validation_files, "seq_len": batches.seq_len,
            "tokens": result.tokens, "loss": result.loss, "perplexity": result.perplexity}


def _lm_eval(args) -> str:
    """Run the tasks; returns lm-eval's results table (and its groups table when there are groups)."""
    require_lm_eval("the lm-eval command")
    from lm_eval.utils import make_table

    from mhar_titan.eval import lm_eval_results
    from mhar_titan.eval.lm_eval_adapter import MharLM

    if args.log_samples and not args.output_path:
        raise ValueError("--log-samples writes the samples under --output-path; pass one")
    if args.output_path:
        lm_eval_results.check_output_path(args.output_path)
    tasks = args.tasks.split(",")
    manager = task_manager(tasks, args.include_path)
    loaded = load_run(args.run, args.step, args.device, routing_kernel="auto")
    lm = MharLM(loaded.model, loaded.tokenizer, batch_size=args.batch_size or DEFAULT_LM_EVAL_BATCH_SIZE,
                source=loaded.source())
    tracker = lm_eval_results.tracker(args.output_path) if args.output_path else None
    model_args = {**loaded.source(), "device": args.device, "batch_size": lm.batch_size}
    results = run_tasks(lm, tasks, manager, model_args=model_args, limit=args.limit, num_fewshot=args.num_fewshot,
                        log_samples=args.log_samples, evaluation_tracker=tracker)
    for warning in few_examples(results):
        print(f"python -m mhar_titan.eval lm-eval: warning: {warning}", file=sys.stderr)
    samples = results.pop("samples", None)
    lm_eval_results.attribute(results, model_args)
    written = []
    if tracker is not None:
        results_file, samples_files = lm_eval_results.save_results(
            tracker, results, samples, output_path=args.output_path, model_name=str(loaded.checkpoint),
            folder_name=f"{loaded.run_dir.name}_step-{loaded.step}", log_samples=args.log_samples)
        written = [f"results: {results_file}"] + [f"samples: {p}" for p in samples_files]
    header = f"mhar_titan ({loaded.checkpoint}, step {loaded.step}), limit: {args.limit}, " \
             f"num_fewshot: {args.num_fewshot}, batch_size: {lm.batch_size}"
    tables = [make_table(results)] + ([make_table(results, "groups")] if "groups" in results else [])
    return "\n".join([header, *tables, *written])


def main(argv=None) -> int:
    from mhar_titan.say_once import one_line_hub_retries

    one_line_hub_retries()  # lm-eval's task data may come from the hub: its retries as one line
    parser = ArgumentParser(prog="python -m mhar_titan.eval", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_ in (("perplexity", "validation loss and perplexity"), ("lm-eval", "lm-eval tasks")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("run", help="run folder (newest checkpoint) or a checkpoints/step-N folder")
        p.add_argument("--step", type=non_negative_int, default=None, help="checkpoint step of the run folder")
        p.add_argument("--device", type=device, default="cpu", help="cpu, cuda, cuda:N or mps")
        p.add_argument("--batch-size", type=positive_int, default=None,
                       help="sequences per forward (perplexity: default the run's; lm-eval: default "
                            f"{DEFAULT_LM_EVAL_BATCH_SIZE})")
    p = sub.choices["perplexity"]
    p.add_argument("--files", nargs="+", default=None, help="held-out parquet/jsonl files or globs")
    p.add_argument("--seq-len", type=positive_int, default=None, help="tokens per sequence (default: the run's)")
    p.add_argument("--batches", type=positive_int, default=None,
                   help="batches to score (default: the run's validation.sequences)")
    p = sub.choices["lm-eval"]
    p.add_argument("--tasks", required=True, help="comma-separated lm-eval task names")
    p.add_argument("--limit", type=positive_int, default=None, help="examples per task")
    p.add_argument("--num-fewshot", type=non_negative_int, default=None, help="few-shot examples per prompt")
    p.add_argument("--output-path", default=None,
                   help="results file (a .json path: written exactly there) or folder (FOLDER/<run>_step-<N>/"
                        "results_<date>.json); samples beside it; the paths are printed")
    p.add_argument("--log-samples", action="store_true", help="also save every sample (needs --output-path)")
    p.add_argument("--include-path", action="append", default=None,
                   help="a folder of local lm-eval task YAML files (repeatable), e.g. eval_tasks")
    paired.add_arguments(sub.add_parser("paired", help="two checkpoints on the same examples: paired differences"))
    args = parser.parse_args(argv)
    try:
        if args.command == "paired":
            out = paired.run(args)
        else:
            out = json.dumps(_perplexity(args), indent=1, default=str) if args.command == "perplexity" else _lm_eval(args)
    except USER_ERRORS as e:
        print(f"{parser.prog} {args.command}: error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    run_command(main)
