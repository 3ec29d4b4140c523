"""``python -m mhar_titan.experiments {list,run,slurm,results} SWEEP.toml``: paired experiments;
``python -m mhar_titan.experiments compare --check-schedule A B``: two arms schedule-matched.

list SWEEP      the runs the sweep expands to, with their state and training command; with
                --gpu-hours, each run's estimated GPU-hours at --mfu and --peak-tflops instead
run SWEEP       train them one after another here (done runs skipped, stopped ones resumed);
                --dry-run prints what would run; --only NAME... restricts to some runs
slurm SWEEP     write a bash script with one `sbatch slurm/train.sbatch ...` per run (--out FILE,
                default stdout); --check runs the trainer's dry run of every run at the job's
                world size first (with --memory-gib G also the memory fit in G GiB per rank);
                extra sbatch options after `--`
results SWEEP   RESULTS.md (its tables also printed) and loss_vs_tokens.png from the run
                folders (--out DIR, default <dump_folder>/results; --format pdf or svg for
                vector figures; --ylim, --diff-ylim fix the plot's y ranges; --pair A B,
                repeatable: report and plot family B minus family A, paired by seed, instead of
                the sweep's [sweep] pairs); with a learned routing temperature also
                routing_temperature.png, its trajectory, and temperature_sites.png, its value per
                routing site; temperature arms: the share of the MHAR gap they recover. Earlier
                results in --out are not replaced without --overwrite
compare A B     --check-schedule: A and B (each a job config or a run folder) are schedule-matched:
                the same LR at every step (planned or logged), tokens per step and data order
                (mhar_titan.experiments.schedule); --world-size N for configs (default 1). Prints
                what they share and exits 0, or names the first difference and exits 1

The sweep commands take --set section.key=value (repeatable; added to the sweep's [sweep.set]) and
--dump-folder DIR (instead of the sweep's), e.g. for a 2-step smoke run of a sweep's commands.
Commands run from the repository root (the sweep's paths are relative to it). Bad input: a
message on stderr and exit status 2.
"""
from __future__ import annotations

import pathlib
import sys

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from mhar_titan.analysis.compare import add_ylim_arguments
from mhar_titan.analysis.plots import add_format_argument
from mhar_titan.cli_args import ArgumentParser, positive_float, positive_int, probability, run_command
from mhar_titan.config import ConfigError
from mhar_titan.errors import UserError
from mhar_titan.experiments.launch import (check_runs, gpu_hours, run_local, run_state, slurm_script, train_command,
                                          world_size_of)
from mhar_titan.experiments.sweep import load_sweep
from mhar_titan.files import OVERWRITE_FLAG, OutputFolderError, check_new_outputs, check_output_folder, write_text


def _select(sweep, only):
    if not only:
        return sweep.runs
    unknown = sorted(set(only) - {r.name for r in sweep.runs})
    if unknown:
        raise ConfigError(f"--only names runs the sweep does not have: {unknown}")
    return tuple(r for r in sweep.runs if r.name in only)


def _settings(pairs) -> dict:
    """--set section.key=value pairs; values parse as TOML literals, else stay strings."""
    out = {}
    for pair in pairs or ():
        key, eq, raw = pair.partition("=")
        if not eq:
            raise ConfigError(f"--set {pair!r}: expected section.key=value")
        try:
            out[key] = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            out[key] = raw
    return out


def main(argv=None) -> int:
    parser = ArgumentParser(prog="python -m mhar_titan.experiments",
                            description=" ".join(__doc__.split("\n\n")[0].split()))
    sub = parser.add_subparsers(dest="command", required=True)
    helps = dict(list="the runs a sweep expands to, their state and command (or GPU-hours)",
                 run="train a sweep's runs one after another here (done skipped, stopped resumed)",
                 slurm="write one sbatch line per run of a sweep", results="RESULTS.md and plots from the run folders")
    for name in ("list", "run", "slurm", "results"):
        p = sub.add_parser(name, help=helps[name])
        p.add_argument("sweep", help="sweep TOML file (train_configs/sweeps/*.toml)")
        p.add_argument("--set", action="append", default=None, metavar="KEY=VALUE",
                       help="extra override of every run (repeatable)")
        p.add_argument("--dump-folder", default=None, help="parent folder of the run folders instead of the sweep's")
    p = sub.choices["list"]
    p.add_argument("--gpu-hours", action="store_true", help="estimated GPU-hours per run and in all")
    p.add_argument("--mfu", type=probability, default=0.35, help="assumed model FLOPs utilisation, in (0, 1] (default 0.35)")
    p.add_argument("--peak-tflops", type=positive_float, default=989.0, help="bf16 dense peak per GPU (default 989, H100)")
    sub.choices["run"].add_argument("--dry-run", action="store_true", help="print what would run, start nothing")
    for name in ("run", "slurm"):
        sub.choices[name].add_argument("--only", nargs="+", default=None, help="run names to restrict to")
    p = sub.choices["slurm"]
    p.add_argument("--out", default=None, help="script file (default: stdout)")
    p.add_argument("--check", action="store_true", help="dry-run every run's config at the job's world size first")
    p.add_argument("--memory-gib", type=positive_float, default=None,
                   help="with --check: GPU memory per rank of the cluster in GiB, checked against each run's "
                        "estimate (default: the fit is not checked, and each line says so)")
    p.add_argument("sbatch_args", nargs="*", help="extra sbatch options, after --")
    p = sub.choices["results"]
    p.add_argument("--out", default=None, help="output folder (default: <dump_folder>/results)")
    p.add_argument("--dpi", type=positive_int, default=200, help="pixels per inch of a png")
    add_format_argument(p)
    p.add_argument(OVERWRITE_FLAG, action="store_true",
                   help="replace the results an earlier run of the command wrote in the output folder")
    add_ylim_arguments(p)
    p.add_argument("--pair", nargs=2, action="append", default=None, metavar=("A", "B"),
                   help="families whose paired difference B - A is tabulated and plotted (repeatable; "
                        "default: the sweep's [sweep] pairs, else each family minus the baseline)")
    p = sub.add_parser("compare", help="check that two arms are schedule-matched")
    p.add_argument("arms", nargs=2, metavar="CONFIG_OR_RUN", help="a job config (TOML) or a run folder, twice")
    p.add_argument("--check-schedule", action="store_true",
                   help="same LR at every step, tokens per step and data order (the check compare makes)")
    p.add_argument("--world-size", type=positive_int, default=1, help="data-parallel ranks a config's plan is for")
    args = parser.parse_args(argv)
    if args.command == "compare":
        return _compare(args, parser.prog)
    try:
        sweep = load_sweep(args.sweep, _settings(args.set), args.dump_folder)
        if args.command == "list" and args.gpu_hours:
            world = world_size_of(sweep.slurm_args)
            hours = [gpu_hours(run, world, args.mfu, args.peak_tflops * 1e12) for run in sweep.runs]
            for run, h in zip(sweep.runs, hours):
                print(f"{run.name}\t{h:.1f}")
            print(f"estimate: {sum(hours):.0f} GPU-hours for {len(hours)} runs at MFU {args.mfu} of "
                  f"{args.peak_tflops:g} TFLOP/s ({world} GPUs per run: {sum(hours) / world:.0f} h of wall time "
                  "one run after another)")
            return 0
        if args.command == "list":
            for run in sweep.runs:
                print(f"{run.name}\t{run_state(run)}\t{' '.join(train_command(run, 'python'))}")
            print(f"{len(sweep.runs)} runs: {len(sweep.families)} families x {len(sweep.runs) // len(sweep.families)}"
                  f" (grid points x seeds {list(sweep.seeds)})")
            return 0
        if args.command == "run":
            check_output_folder(sweep.dump_folder, "--dump-folder (the sweep's dump_folder)")
            report = run_local(sweep, _select(sweep, args.only), dry_run=args.dry_run)
            print(f"sweep {sweep.name}: {len(report.completed)} completed, {len(report.skipped)} already done, "
                  f"{len(report.failed)} failed {report.failed}, {len(report.unsaved)} unsaved {report.unsaved}"
                  + (f", stopped at {report.stopped}" if report.stopped else ""))
            return 0 if report.ok else 1
        if args.command == "slurm":
            if args.out:
                check_output_folder(pathlib.Path(args.out).parent, "--out's folder")
                if pathlib.Path(args.out).is_dir():
                    raise OutputFolderError(f"--out {args.out} is a folder; name the script file to write, e.g. "
                                            f"{pathlib.Path(args.out) / 'submit.sh'}")
            runs = _select(sweep, args.only)
            if args.check:
                world = world_size_of([*sweep.slurm_args, *args.sbatch_args])
                available = None if args.memory_gib is None else (int(args.memory_gib * 2**30), "--memory-gib")
                for line in check_runs(runs, world, available):
                    print(line, file=sys.stderr)
            text = slurm_script(sweep, runs, args.sbatch_args)
            if args.out:
                write_text(args.out, text)
                print(f"wrote {args.out}", file=sys.stderr)
            else:
                print(text, end="")
            return 0
        from mhar_titan.analysis.compare import check_pairs, check_ylim
        from mhar_titan.experiments.results import results_outputs, write_results

        try:
            check_ylim(args.ylim, "--ylim")
            check_ylim(args.diff_ylim, "--diff-ylim")
        except ValueError as e:
            raise ConfigError(str(e)) from None
        pairs = None if args.pair is None else check_pairs(args.pair, list(sweep.families), "--pair")
        out = args.out or sweep.dump_folder / "results"
        check_output_folder(out, "--out")
        check_new_outputs(results_outputs(out), args.overwrite)
        for path in write_results(sweep, out, dpi=args.dpi, ylim=args.ylim, diff_ylim=args.diff_ylim, pairs=pairs,
                                  echo=print, fmt=args.format):
            print(f"wrote {path}")
        return 0
    except (UserError, FileNotFoundError, ImportError) as e:  # ConfigError, an unwritable folder, a full disk
        print(f"{parser.prog} {args.command}: error: {e}", file=sys.stderr)
        return 2


def _compare(args, prog: str) -> int:
    from mhar_titan.experiments.schedule import check_schedule, load_schedule

    try:
        if args.world_size < 1:
            raise ConfigError(f"--world-size must be >= 1, got {args.world_size}")
        a, b = (load_schedule(arm, args.world_size) for arm in args.arms)
    except (UserError, FileNotFoundError, ValueError) as e:
        print(f"{prog} compare: error: {e}", file=sys.stderr)
        return 2
    try:
        print(check_schedule(a, b))
    except ConfigError as e:
        print(f"{prog} compare: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    run_command(main)
