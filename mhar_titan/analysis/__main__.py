"""``python -m mhar_titan.analysis {heatmap,probe,compare}``: figures and reports for runs.

heatmap RUN   routing heatmaps (PNG: the mean over heads, and the heads one by one when they
              differ), per-site entropy / effective sources (Markdown, JSON) on validation
              batches of the run's newest (or --step) checkpoint; --vmax fixes the colour range
probe RUN     the query probe of a single-head model (Markdown, and a per-site PNG)
compare RUN RUN ...  loss against tokens and the difference to the baseline (PNG; --ylim,
              --diff-ylim fix the y ranges) and a tail-mean validation-loss table naming each
              run's arm (Markdown); --pair A B (repeatable): the difference B - A instead, tabulated;
              runs that learn their routing temperature: its trajectory (routing_temperature.png)

Outputs go to --out (default: <run>/analysis, or <parent of the first run>/comparison).
Every flag is checked before anything is loaded. Bad input: a message on stderr and exit status 2.
"""
from __future__ import annotations

import json
import pathlib
import sys

from mhar_titan.analysis.compare import add_ylim_arguments
from mhar_titan.cli_args import ArgumentParser, device, non_negative_int, positive_float, positive_int, run_command
from mhar_titan.checkpoint.find import find_checkpoint
from mhar_titan.eval.load import USER_ERRORS, LoadedModel, load_run
from mhar_titan.files import check_output_folder, write_text


def _validation_tokens(loaded: LoadedModel, args) -> list:
    """Input token batches (B, T) from the run's validation files."""
    return [x for x, _ in loaded.validation_batches(None, args.batch_size, args.seq_len, args.batches)]


def _check_out(args) -> None:
    """The output folder (``--out``, default ``<run>/analysis``) can be written: checked before the model loads."""
    out = args.out or find_checkpoint(args.run, args.step)[0] / "analysis"
    check_output_folder(out, "--out")


def _heatmap(args) -> list[pathlib.Path]:
    from mhar_titan.analysis.heatmap import check_vmax, plot_routing_heatmaps, routing_report, temperature_label
    from mhar_titan.analysis.routing import routing_summary

    try:
        check_vmax(args.vmax)
    except ValueError as e:
        raise ValueError(f"--vmax: {e}") from None
    _check_out(args)
    loaded = load_run(args.run, args.step, args.device)
    if loaded.model.routing is None:
        raise ValueError(f"{loaded.run_dir} is a baseline model (residual = 'standard'): it has no routing")
    summary = routing_summary(loaded.model, _validation_tokens(loaded, args))
    out = pathlib.Path(args.out or loaded.run_dir / "analysis")
    title = f"{loaded.run_dir.name}, step {loaded.step}: routing weight vs uniform"
    heat = plot_routing_heatmaps(summary, out / f"routing_step{loaded.step}.png", title=title, dpi=args.dpi,
                                 vmax=args.vmax, temperature=temperature_label(loaded.model))
    heat.close()
    pngs = [heat.path] + ([heat.heads_path] if heat.heads_path is not None else [])
    md = out / f"routing_step{loaded.step}.md"
    write_text(md, routing_report(summary, f"Routing of {loaded.run_dir.name} at step {loaded.step}"))
    js = out / f"routing_step{loaded.step}.json"
    write_text(js, json.dumps(summary.to_dict(), indent=1))
    print(md.read_text())
    return [*pngs, md, js]


def _probe(args) -> list[pathlib.Path]:
    from mhar_titan.analysis.plots import pyplot
    from mhar_titan.analysis.probe import plot_probe, query_probe

    _check_out(args)
    loaded = load_run(args.run, args.step, args.device)
    result = query_probe(loaded.model, _validation_tokens(loaded, args),
                         slices=args.slices, draws=args.draws, seed=args.seed)
    out = pathlib.Path(args.out or loaded.run_dir / "analysis")
    out.mkdir(parents=True, exist_ok=True)
    md = out / f"probe_step{loaded.step}.md"
    write_text(md, result.report(f"Query probe of {loaded.run_dir.name} at step {loaded.step}"))
    png = out / f"probe_step{loaded.step}.png"
    pyplot().close(plot_probe(result, loaded.model.args.n_routing_sites, png,
                              title=f"{loaded.run_dir.name}, step {loaded.step}: query probe, S = {result.slices}"))
    print(md.read_text())
    return [md, png]


_PROG = "python -m mhar_titan.analysis"


def _compare(args) -> list[pathlib.Path]:
    from mhar_titan.analysis.plots import pyplot
    from mhar_titan.analysis.compare import (check_pairs, check_ylim, comparison_table, pair_rows, pairs_markdown,
                                             plot_comparison, plot_temperatures, read_run, short_tails,
                                             table_markdown)

    check_ylim(args.ylim, "--ylim")
    check_ylim(args.diff_ylim, "--diff-ylim")
    paths = [pathlib.Path(p) for p in args.runs]
    out = pathlib.Path(args.out or paths[0].resolve().parent / "comparison")
    check_output_folder(out, "--out")
    names = [p.name for p in paths]
    if len(set(names)) < len(names):  # same folder names in different parents: use the paths
        names = [str(p) for p in paths]
    pairs = check_pairs(args.pair or [], names, "--pair")
    runs = [read_run(p, n) for p, n in zip(paths, names)]
    rows = comparison_table(runs, args.baseline, args.k)
    for note in short_tails(rows) + [f"{r.name} is not paired with the baseline: {r.unpaired}" for r in rows
                                     if r.paired is False]:
        print(f"{_PROG} compare: warning: {note}", file=sys.stderr)
    png = out / "loss_vs_tokens.png"
    pyplot().close(plot_comparison(runs, rows, png, dpi=args.dpi, ylim=args.ylim, diff_ylim=args.diff_ylim,
                                   pairs=pairs))
    md = out / "comparison.md"
    tables = table_markdown(rows, args.k) + ("\n" + pairs_markdown(pair_rows(runs, pairs, args.k), args.k)
                                             if pairs else "")
    written, figures = [png], f"![loss against tokens]({png.name})\n\n"
    if any(r.temperature for r in runs):
        written.append(out / "routing_temperature.png")
        pyplot().close(plot_temperatures(runs, written[-1], dpi=args.dpi))
        figures += f"![learned routing temperature against tokens]({written[-1].name})\n\n"
    write_text(md, "# Run comparison\n\n" + figures + tables)
    print(tables)
    return [*written, md]


def main(argv=None) -> int:
    parser = ArgumentParser(prog=_PROG, description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("heatmap", "probe"):
        p = sub.add_parser(name)
        p.add_argument("run", help="run folder (newest checkpoint) or a checkpoints/step-N folder")
        p.add_argument("--step", type=non_negative_int, default=None, help="checkpoint step of the run folder")
        p.add_argument("--batches", type=positive_int, default=2, help="validation batches to read")
        p.add_argument("--batch-size", type=positive_int, default=None, help="sequences per batch (default: the run's)")
        p.add_argument("--seq-len", type=positive_int, default=None, help="tokens per sequence (default: the run's)")
        p.add_argument("--device", type=device, default="cpu", help="cpu, cuda, cuda:N or mps")
        p.add_argument("--out", default=None, help="output folder (default: <run>/analysis)")
    p = sub.choices["heatmap"]
    p.add_argument("--dpi", type=positive_int, default=200, help="pixels per inch (3.5 in wide)")
    p.add_argument("--vmax", type=positive_float, default=None,
                   help="fixed colour range -VMAX..+VMAX of log2(weight x N), the same for every run drawn with it "
                        "(default: the 95th percentile of the run's own values)")
    p = sub.choices["probe"]
    p.add_argument("--slices", type=positive_int, default=4, help="contiguous query slices S")
    p.add_argument("--draws", type=positive_int, default=4, help="random-query draws in the reference")
    p.add_argument("--seed", type=int, default=0, help="seed of the random queries")
    p = sub.add_parser("compare")
    p.add_argument("runs", nargs="+", help="run folders")
    p.add_argument("--baseline", default=None, help="name (folder name) of the baseline run; default: the first")
    p.add_argument("-k", type=positive_int, default=11, help="evaluations in the tail mean")
    p.add_argument("--out", default=None, help="output folder (default: <parent of the first run>/comparison)")
    p.add_argument("--dpi", type=positive_int, default=200, help="pixels per inch")
    add_ylim_arguments(p)
    p.add_argument("--pair", nargs=2, action="append", default=None, metavar=("A", "B"),
                   help="runs (folder names) whose difference B - A is plotted and tabulated instead of each run "
                        "minus the baseline (repeatable)")
    args = parser.parse_args(argv)
    command = {"heatmap": _heatmap, "probe": _probe, "compare": _compare}[args.command]
    try:
        written = command(args)
    except (*USER_ERRORS, ImportError) as e:
        print(f"{parser.prog} {args.command}: error: {e}", file=sys.stderr)
        return 2
    for path in written:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    run_command(main)
