"""``python -m mhar_titan.generate RUN [--prompt TEXT] [--tokens N] [--temperature T] [--top-k K] [--top-p P]``.

Prints a continuation of the prompt from a run folder's newest checkpoint (or ``--step``, or a
``step-N`` folder). Instead of RUN, ``--config FILE [--section.key=value ...]`` (the training
command line) names the run folder ``<job.dump_folder>/<job.name>`` that training wrote. Temperature 0 (the default) is greedy and deterministic; otherwise tokens are
sampled (``--seed`` fixes the draw). Generation stops early at the tokenizer's end-of-text token
or a ``--stop`` string (cut from the output). ``--prompt`` and ``--stop`` read backslash escapes
(``\\n`` newline, ``\\t`` tab, ``\\r``, ``\\\\`` one backslash, ``\\xHH``, ``\\uHHHH``;
``mhar_titan.cli_args.escaped_text``), so ``--stop "\\n\\n"`` stops at a blank line. Decoding uses a KV
cache (``--no-cache``: re-run the prefix at every step, the slow reference). A prompt longer than
the model's ``max_seq_len`` is kept to its last ``max_seq_len`` tokens, with a warning on stderr
(the model reads no more); as generation goes on, the window slides the same way. The last line
gives the new tokens per second (decoding alone, the prompt's pass included). Bad input (any flag,
checked before the model is loaded; a ``--device`` this machine has not): a message on stderr and
exit status 2.
"""
from __future__ import annotations

import pathlib
import sys
import time

from mhar_titan.cli_args import (ArgumentParser, device, escaped_text, non_negative_float, non_negative_int,
                                 positive_int, probability, run_command)
from mhar_titan.eval.generation import generate_batch
from mhar_titan.eval.load import USER_ERRORS, load_run

DEFAULT_PROMPT = "ROMEO:"


def run_folder(config: str, overrides: list[str]) -> str:
    """``<job.dump_folder>/<job.name>`` of a training command line."""
    from mhar_titan.config import load_config

    cfg = load_config(config, overrides)
    return str(pathlib.Path(cfg.job.dump_folder) / cfg.job.name)


def parse_args(argv=None) -> tuple[ArgumentParser, object, list[str]]:
    """(parser, parsed flags, training overrides) of a command line; every flag is checked here
    (exit status 2 with one line naming it), before anything is loaded."""
    argv = sys.argv[1:] if argv is None else list(argv)
    by_config = any(a == "--config" or a.startswith("--config=") for a in argv)
    parser = ArgumentParser(prog="python -m mhar_titan.generate", description=__doc__.splitlines()[0])
    if not by_config:  # with --config, the rest are training overrides (--optimizer.lr 1e-3 included)
        parser.add_argument("run", help="run folder (newest checkpoint) or a checkpoints/step-N folder")
    parser.add_argument("--config", default=None, help="training config whose run folder to read (instead of RUN); "
                        "further --section.key=value arguments override it as in training")
    parser.add_argument("--step", type=non_negative_int, default=None, help="checkpoint step of the run folder")
    parser.add_argument("--prompt", type=escaped_text, default=DEFAULT_PROMPT,
                        help=f"text to continue (default {DEFAULT_PROMPT!r}; backslash escapes such as \\n are read)")
    parser.add_argument("--tokens", type=positive_int, default=40, help="new tokens to generate (1 or more)")
    parser.add_argument("--temperature", type=non_negative_float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-k", type=positive_int, default=None, help="sample among the k most likely tokens")
    parser.add_argument("--top-p", type=probability, default=None, help="sample among the most likely tokens whose "
                        "probability reaches p, in (0, 1] (nucleus)")
    parser.add_argument("--stop", type=escaped_text, action="append", default=[],
                        help="stop at this text (repeatable; not printed); backslash escapes are read: "
                             "--stop '\\n\\n' stops at a blank line")
    parser.add_argument("--no-cache", action="store_true", help="re-run the prefix at every step (no KV cache)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--device", type=device, default="cpu", help="cpu, cuda, cuda:N or mps")
    args, overrides = parser.parse_known_args(argv) if by_config else (parser.parse_args(argv), [])
    return parser, args, overrides


def main(argv=None) -> int:
    parser, args, overrides = parse_args(argv)
    try:
        run = run_folder(args.config, overrides) if args.config else args.run
        loaded = load_run(run, args.step, args.device, routing_kernel="auto")
        tok = loaded.tokenizer
        prompt = tok.encode(args.prompt) or [tok.eos_id]
        window = loaded.args.max_seq_len
        if len(prompt) > window:
            print(f"{parser.prog}: warning: --prompt is {len(prompt):,} tokens, more than the model's max_seq_len "
                  f"{window:,}: it reads the last {window:,} of them", file=sys.stderr)
        start = time.perf_counter()
        new = generate_batch(loaded.model, [prompt], args.tokens, temperature=args.temperature, top_k=args.top_k,
                             top_p=args.top_p, n_vocab=tok.n_vocab, stop_ids=[tok.eos_id], stop_strings=args.stop,
                             decode=tok.decode, seed=args.seed, use_cache=not args.no_cache)[0]
        seconds = time.perf_counter() - start
    except USER_ERRORS as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    how = "greedy" if args.temperature == 0 else \
        f"temperature {args.temperature}, top-k {args.top_k}, top-p {args.top_p}"
    text = tok.decode([t for t in new if t != tok.eos_id])
    cuts = [text.index(s) for s in args.stop if s and s in text]
    print(f"--- sample from {loaded.checkpoint} (step {loaded.step}, {how}) ---")
    print(args.prompt + (text[:min(cuts)] if cuts else text))
    print(f"--- {len(new)} new tokens in {seconds:.2f} s: {len(new) / max(seconds, 1e-9):.1f} tokens/s "
          f"({'KV cache' if not args.no_cache else 'no cache'}, {args.device}) ---")
    return 0


if __name__ == "__main__":
    run_command(main)
