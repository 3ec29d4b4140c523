"""``python -m mhar_titan.eval {perplexity,lm-eval} RUN ...``: evaluate a run's checkpoint.

perplexity: validation loss and perplexity on held-out files (default: the run's
``data.validation_files``, at its ``training.seq_len``, its ``validation.sequences``).
lm-eval: run lm-eval tasks through ``MharLM`` (needs ``pip install lm-eval`` and its task data).
Bad input: a message on stderr and exit status 2.
"""
from __future__ import annotations

import argparse
import json
import sys

from mhar_titan.eval.load import USER_ERRORS, load_run
from mhar_titan.eval.perplexity import evaluate_perplexity


def _perplexity(args) -> dict:
    loaded = load_run(args.run, args.step, args.device)
    batches = loaded.validation_batches(args.files, args.batch_size, args.seq_len, args.batches)
    result = evaluate_perplexity(loaded.model, batches)
    return {"run": str(loaded.run_dir), "checkpoint": str(loaded.checkpoint), "step": loaded.step,
            "files": args.files or loaded.data_config.validation_files, "seq_len": batches.seq_len,
            "tokens": result.tokens, "loss": result.loss, "perplexity": result.perplexity}


def _lm_eval(args) -> dict:
    try:
        import lm_eval
    except ImportError:
        raise ValueError("the lm-eval command needs lm-eval: pip install lm-eval") from None
    from mhar_titan.eval.lm_eval_adapter import MharLM

    loaded = load_run(args.run, args.step, args.device, routing_kernel="auto")
    lm = MharLM(loaded.model, loaded.tokenizer, batch_size=args.batch_size or 8)
    results = lm_eval.simple_evaluate(model=lm, tasks=args.tasks.split(","), limit=args.limit,
                                      num_fewshot=args.num_fewshot)
    return {"run": str(loaded.run_dir), "step": loaded.step, "results": results["results"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mhar_titan.eval", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_ in (("perplexity", "validation loss and perplexity"), ("lm-eval", "lm-eval tasks")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("run", help="run folder (newest checkpoint) or a checkpoints/step-N folder")
        p.add_argument("--step", type=int, default=None, help="checkpoint step of the run folder")
        p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1 ...")
        p.add_argument("--batch-size", type=int, default=None, help="sequences per forward")
    p = sub.choices["perplexity"]
    p.add_argument("--files", nargs="+", default=None, help="held-out parquet/jsonl files or globs")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the run's)")
    p.add_argument("--batches", type=int, default=None, help="batches to score (default: the run's validation.sequences)")
    p = sub.choices["lm-eval"]
    p.add_argument("--tasks", required=True, help="comma-separated lm-eval task names")
    p.add_argument("--limit", type=int, default=None, help="examples per task")
    p.add_argument("--num-fewshot", type=int, default=None)
    args = parser.parse_args(argv)
    try:
        out = _perplexity(args) if args.command == "perplexity" else _lm_eval(args)
    except USER_ERRORS as e:
        print(f"{parser.prog} {args.command}: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
