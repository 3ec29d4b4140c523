"""``python -m mhar_titan.analysis {heatmap,probe,compare}``: figures and reports for runs.

heatmap RUN   routing heatmaps (the mean over heads, and the heads one by one when they
              differ), per-site entropy / effective sources (Markdown, JSON) on validation
              batches of the run's newest (or --step) checkpoint; for the other depth connections
              their mixing weights instead (mixing_stepN.*: DenseFormer's alpha, MUDDFormer's mean
              dynamic weights per stream, Hyper-Connections' alpha and beta and mHC's pre, post
              and comb per site); --vmax fixes the colour range
probe RUN     the query probe of a single-head AttnRes model (Markdown, and a per-site figure);
              other models are refused before they are loaded
compare RUN RUN ...  loss against tokens and the difference to the baseline (--ylim,
              --diff-ylim fix the y ranges) and a tail-mean validation-loss table naming each
              run's arm (Markdown, in the figure's loss unit); --pair A B (repeatable): the
              difference B - A instead, tabulated; runs that learn their routing temperature: its
              trajectory (routing_temperature) and its value per routing site at the newest
              checkpoint (temperature_sites)

Outputs go to --out (default: <run>/analysis, or <parent of the first run>/comparison/<the runs'
names>: a folder per comparison); figures as --format png (default), pdf or svg, one colour per
arm in every figure (analysis.colors). A command never replaces the outputs of an earlier run of
it: it refuses, naming --overwrite (replace them) and --out (write elsewhere). Every flag and
output path is checked before anything is loaded. Bad input: a message on stderr and exit status 2.
"""
from __future__ import annotations

import json
import pathlib
import sys

from mhar_titan.analysis.compare import add_ylim_arguments
from mhar_titan.analysis.plots import FORMATS, add_format_argument
from mhar_titan.cli_args import ArgumentParser, device, non_negative_int, positive_float, positive_int, run_command
from mhar_titan.checkpoint.find import find_checkpoint
from mhar_titan.eval.load import USER_ERRORS, LoadedModel, load_run
from mhar_titan.files import OVERWRITE_FLAG, check_new_outputs, check_output_folder, remove_stale_outputs, write_text


def _validation_tokens(loaded: LoadedModel, args) -> list:
    """Input token batches (B, T) from the run's validation files."""
    return [x for x, _ in loaded.validation_batches(None, args.batch_size, args.seq_len, args.batches)]


def _check_out(args, names: list[str]) -> pathlib.Path:
    """The output folder (``--out``, default ``<run>/analysis``): it can be written, and holds
    none of ``names`` (the files the command writes there) unless ``--overwrite``; checked before
    the model loads. Returns the folder."""
    out = pathlib.Path(args.out) if args.out else find_checkpoint(args.run, args.step)[0] / "analysis"
    check_output_folder(out, "--out")
    check_new_outputs([out / name for name in names], args.overwrite)
    return out


def _step_of(args) -> int:
    """The checkpoint step the command reads (``--step``, else the newest complete one), as
    ``load_run`` reports it: its marker's step (0 for a converted model)."""
    from mhar_titan.checkpoint import MARKER, read_marker

    checkpoint = find_checkpoint(args.run, args.step)[1]
    return int(read_marker(checkpoint).get("step", 0)) if (checkpoint / MARKER).is_file() else 0


def _saved_model_args(args):
    """The `ModelArgs` of the checkpoint `args.run` / `args.step` names, read from its marker (no
    weight is read): what the commands check before anything is loaded."""
    from mhar_titan.convert.dcp_io import dcp_model_args

    return dcp_model_args(find_checkpoint(args.run, args.step)[1])


def _heatmap(args) -> list[pathlib.Path]:
    from mhar_titan.analysis.heatmap import (check_vmax, heads_path_for, plot_routing_heatmaps, routing_report,
                                             temperature_label)
    from mhar_titan.analysis.routing import routing_summary

    try:
        check_vmax(args.vmax)
    except ValueError as e:
        raise ValueError(f"--vmax: {e}") from None
    residual = _saved_model_args(args).residual
    if residual == "standard":
        raise ValueError(f"{args.run} is a baseline model (residual = 'standard'): it has no routing or mixing weights")
    stem = f"{'routing' if residual == 'attn_res' else 'mixing'}_step{_step_of(args)}"
    figure = pathlib.Path(f"{stem}.{args.format}")
    candidates = [pathlib.Path(f"{stem}.md"), pathlib.Path(f"{stem}.json"),
                  *(name for fmt in FORMATS for name in (pathlib.Path(f"{stem}.{fmt}"),
                                                         heads_path_for(pathlib.Path(f"{stem}.{fmt}"))))]
    out = _check_out(args, [str(c) for c in candidates])
    loaded = load_run(args.run, args.step, args.device)
    if residual != "attn_res":  # a connection with mixing weights, no routing sites
        written = _mixing(loaded, args, out / figure)
        remove_stale_outputs([out / c for c in candidates], written)
        return written
    summary = routing_summary(loaded.model, _validation_tokens(loaded, args))
    title = f"{loaded.run_dir.name}, step {loaded.step}: routing weight vs uniform"
    heat = plot_routing_heatmaps(summary, out / figure, title=title, dpi=args.dpi, vmax=args.vmax,
                                 temperature=temperature_label(loaded.model))
    heat.close()
    figures = [heat.path] + ([heat.heads_path] if heat.heads_path is not None else [])
    md = out / f"{stem}.md"
    write_text(md, routing_report(summary, f"Routing of {loaded.run_dir.name} at step {loaded.step}"))
    js = out / f"{stem}.json"
    write_text(js, json.dumps(summary.to_dict(), indent=1))
    remove_stale_outputs([out / c for c in candidates], [*figures, md, js])
    print(md.read_text())
    return [*figures, md, js]


def _mixing(loaded: LoadedModel, args, figure: pathlib.Path) -> list[pathlib.Path]:
    """The heatmap command for a depth connection other than depth routing: its mixing weights
    (`analysis.mixing`: DenseFormer's alpha, MUDDFormer's mean dynamic weights per stream, the
    n-stream connections' mean weights per site) drawn
    as `figure`, with a Markdown and a JSON report beside it."""
    from mhar_titan.analysis.mixing import mixing_report, mixing_summary, plot_mixing
    from mhar_titan.analysis.plots import pyplot

    static = hasattr(loaded.model.routing, "matrix")
    summary = mixing_summary(loaded.model, [] if static else _validation_tokens(loaded, args))
    png = figure
    what = "weights" if static else "mean weights over tokens"
    pyplot().close(plot_mixing(summary, png, title=f"{loaded.run_dir.name}, step {loaded.step}: "
                               f"{loaded.model.args.residual} mixing {what}", dpi=args.dpi, vmax=args.vmax))
    md = figure.with_suffix(".md")
    write_text(md, mixing_report(summary, f"Mixing weights of {loaded.run_dir.name} at step {loaded.step}"))
    js = figure.with_suffix(".json")
    write_text(js, json.dumps(summary.to_dict(), indent=1))
    print(md.read_text())
    return [png, md, js]


def _probe(args) -> list[pathlib.Path]:
    from mhar_titan.analysis.plots import pyplot
    from mhar_titan.analysis.probe import check_probe, plot_probe, query_probe

    stem = f"probe_step{_step_of(args)}"
    candidates = [f"{stem}.md", *(f"{stem}.{fmt}" for fmt in FORMATS)]
    out = _check_out(args, candidates)
    check_probe(_saved_model_args(args))  # one line, before the model is loaded
    loaded = load_run(args.run, args.step, args.device)
    result = query_probe(loaded.model, _validation_tokens(loaded, args),
                         slices=args.slices, draws=args.draws, seed=args.seed)
    out.mkdir(parents=True, exist_ok=True)
    md = out / f"{stem}.md"
    write_text(md, result.report(f"Query probe of {loaded.run_dir.name} at step {loaded.step}"))
    figure = out / f"{stem}.{args.format}"
    pyplot().close(plot_probe(result, loaded.model.args.n_routing_sites, figure,
                              title=f"{loaded.run_dir.name}, step {loaded.step}: query probe, S = {result.slices}"))
    remove_stale_outputs([out / c for c in candidates], [md, figure])
    print(md.read_text())
    return [md, figure]


_PROG = "python -m mhar_titan.analysis"


COMPARISON_NAME_MAX = 80
"""Longest default comparison folder name made of the runs' names; longer: the first name, the count
of the others and a hash of all their paths."""


def comparison_folder(paths: list[pathlib.Path]) -> pathlib.Path:
    """The default output folder of ``compare``: ``<parent of the first run>/comparison/<the runs'
    folder names joined by _vs_>`` (a folder per comparison, so one never replaces another's
    figures); for many runs, or runs of the same name in other parents, ``<first>_and_<n>_more_<hash>``."""
    names = [p.resolve().name for p in paths]
    label = "_vs_".join(names)
    if len(label) > COMPARISON_NAME_MAX or len(set(names)) < len(names):
        import hashlib

        digest = hashlib.sha1("\0".join(str(p.resolve()) for p in paths).encode()).hexdigest()[:8]
        label = f"{names[0]}_and_{len(names) - 1}_more_{digest}"
    return paths[0].resolve().parent / "comparison" / label


def _compare(args) -> list[pathlib.Path]:
    from mhar_titan.analysis.compare import (check_pairs, check_ylim, comparison_table, loss_unit, pair_rows,
                                             pairs_markdown, plot_comparison, plot_temperatures, read_run,
                                             short_tails, table_markdown)
    from mhar_titan.analysis.plots import pyplot
    from mhar_titan.analysis.temperature import plot_site_temperatures, site_temperatures

    check_ylim(args.ylim, "--ylim")
    check_ylim(args.diff_ylim, "--diff-ylim")
    paths = [pathlib.Path(p) for p in args.runs]
    out = pathlib.Path(args.out) if args.out else comparison_folder(paths)
    check_output_folder(out, "--out")
    fmt = args.format
    candidates = [out / "comparison.md", *(out / f"{name}.{f}" for f in FORMATS
                                            for name in ("loss_vs_tokens", "routing_temperature", "temperature_sites"))]
    check_new_outputs(candidates, args.overwrite)
    names = [p.name for p in paths]
    if len(set(names)) < len(names):  # same folder names in different parents: use the paths
        names = [str(p) for p in paths]
    pairs = check_pairs(args.pair or [], names, "--pair")
    runs = [read_run(p, n) for p, n in zip(paths, names)]
    rows = comparison_table(runs, args.baseline, args.k)
    for note in short_tails(rows) + [f"{r.name} is not paired with the baseline: {r.unpaired}" for r in rows
                                     if r.paired is False]:
        print(f"{_PROG} compare: warning: {note}", file=sys.stderr)
    figure = out / f"loss_vs_tokens.{fmt}"
    pyplot().close(plot_comparison(runs, rows, figure, dpi=args.dpi, ylim=args.ylim, diff_ylim=args.diff_ylim,
                                   pairs=pairs))
    md = out / "comparison.md"
    unit = loss_unit(runs)
    tables = table_markdown(rows, args.k, unit) + ("\n" + pairs_markdown(pair_rows(runs, pairs, args.k), args.k, unit)
                                                   if pairs else "")
    written, figures = [figure], f"![loss against tokens]({figure.name})\n\n"
    if any(r.temperature for r in runs):
        written.append(out / f"routing_temperature.{fmt}")
        pyplot().close(plot_temperatures(runs, written[-1], dpi=args.dpi))
        figures += f"![learned routing temperature against tokens]({written[-1].name})\n\n"
        sites = site_temperatures(runs)
        if sites:
            written.append(out / f"temperature_sites.{fmt}")
            pyplot().close(plot_site_temperatures(sites, runs, written[-1], dpi=args.dpi))
            figures += f"![learned routing temperature per routing site]({written[-1].name})\n\n"
    write_text(md, "# Run comparison\n\n" + figures + tables)
    remove_stale_outputs(candidates, [*written, md])
    print(tables)
    return [*written, md]


def add_output_arguments(parser) -> None:
    """--format (``plots.add_format_argument``) and --overwrite, which every command that writes
    results takes (``files.check_new_outputs``)."""
    add_format_argument(parser)
    parser.add_argument(OVERWRITE_FLAG, action="store_true",
                        help="replace the outputs of an earlier run of the command (refused without it)")


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
        add_output_arguments(p)
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
    p.add_argument("--out", default=None,
                   help="output folder (default: <parent of the first run>/comparison/<the runs' names>)")
    p.add_argument("--dpi", type=positive_int, default=200, help="pixels per inch of a png")
    add_output_arguments(p)
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
