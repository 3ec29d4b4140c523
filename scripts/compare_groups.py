"""Loss curves of groups of runs (e.g. one setting over several seeds), averaged with a band over
the seeds, and the paired differences of the final validation loss between two groups.

    python scripts/compare_groups.py --group AdamW RUN_s1 RUN_s2 --group Muon RUN_s1 RUN_s2 \\
        --out docs/study/muon_vs_adamw.png

Runs of a group are averaged at the steps they all logged (band: mean -/+ one standard error over
the seeds, which for 2 seeds is their min-max range), drawn with ``analysis.compare.plot_comparison``.
The i-th runs of the groups are taken as paired (same seed: same initialisation and data order);
the table gives per group the final validation loss of each run and their mean, and the paired
difference of every later group from the first (mean -/+ SE over the pairs).
"""
from __future__ import annotations

import argparse
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mhar_titan.analysis.compare import RunCurves, comparison_table, plot_comparison, read_run  # noqa: E402
from mhar_titan.experiments.results import mean_and_se  # noqa: E402


def mean_curve(points: list[list[tuple[int, float]]]) -> tuple[list, list]:
    common = sorted(set.intersection(*(set(s for s, _ in p) for p in points)))
    values = [dict(p) for p in points]
    stats = [(s, *mean_and_se([v[s] for v in values])) for s in common]
    return [(s, m) for s, m, _ in stats], [(s, m - se, m + se) for s, m, se in stats]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--group", nargs="+", action="append", required=True, metavar=("NAME", "RUN"),
                        help="a group's name and its run folders (repeat for each group)")
    parser.add_argument("--out", required=True, help="PNG of the curves")
    parser.add_argument("--dpi", type=int, default=200)
    a = parser.parse_args(argv)
    groups = {g[0]: [read_run(p) for p in g[1:]] for g in a.group}
    curves = []
    for name, runs in groups.items():
        train, train_band = mean_curve([r.train for r in runs])
        val, val_band = mean_curve([r.val for r in runs])
        curves.append(RunCurves(name=name, path=runs[0].path, train=train, val=val,
                                tokens_per_step=runs[0].tokens_per_step, data_order=None,
                                tokenizer=runs[0].tokenizer, seeds=len(runs), train_band=train_band, val_band=val_band))
    plot_comparison(curves, comparison_table(curves), a.out, dpi=a.dpi)
    first = next(iter(groups))
    every = [r for runs in groups.values() for r in runs]
    step = max(set.intersection(*(set(s for s, _ in r.val) for r in every)))  # the last validation all ran
    final = {id(r): dict(r.val)[step] for r in every}
    print(f"validation loss at step {step} ({every[0].tokens(step):,.0f} tokens), the last step every run evaluated")
    print("| group | runs | val loss per run | mean | last logged train loss (mean) |")
    print("|---|---|---|---|---|")
    for name, runs in groups.items():
        finals = [final[id(r)] for r in runs]
        train = mean_and_se([r.train[-1][1] for r in runs])[0]
        print(f"| {name} | {', '.join(r.name for r in runs)} | "
              f"{', '.join(f'{v:.4f}' for v in finals)} | {mean_and_se(finals)[0]:.4f} | {train:.4f} |")
    for name, runs in list(groups.items())[1:]:
        deltas = [final[id(r)] - final[id(b)] for r, b in zip(runs, groups[first])]
        m, se = mean_and_se(deltas)
        print(f"\npaired val loss at step {step}, {name} - {first}: {', '.join(f'{d:+.4f}' for d in deltas)}; "
              f"mean {m:+.4f} +/- {se:.4f} (SE over {len(deltas)} pairs)")
    print(f"\nwrote {a.out}")
    return 0


if __name__ == "__main__":
    from mhar_titan.cli_args import run_command

    run_command(main)
