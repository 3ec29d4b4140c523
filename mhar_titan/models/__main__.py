"""`python -m mhar_titan.models`: flavors x families with parameter counts at the default vocabulary."""
from __future__ import annotations

from .args import FAMILIES, FLAVORS, ModelArgs, count_parameters


def listing_rows() -> list[tuple[str, str, int, int, int]]:
    """(flavor, family, total, non-embedding, routing extra) for every flavor and family."""
    rows = []
    for flavor in FLAVORS:
        for family, overrides in FAMILIES.items():
            counts = count_parameters(ModelArgs.from_flavor(flavor, **overrides))
            rows.append((flavor, family, counts.total, counts.non_embedding, counts.routing))
    return rows


def main(argv=None) -> int:
    """``python -m mhar_titan.models [-h]``: print the table (``argv``: the command's arguments; none from
    Python); returns the exit code. Any other argument: one line, exit 2."""
    from mhar_titan.cli_args import ArgumentParser

    ArgumentParser(prog="python -m mhar_titan.models",
                   description="Every flavor x family with its parameter counts at the flavor's default "
                               "vocabulary: total, non-embedding, and the routing parameters MHAR adds. Pick one in "
                               "a job config with [model] flavor = NAME and the family's keys (python train.py "
                               "--help model).").parse_args([] if argv is None else argv)
    header = f"{'flavor':<10} {'family':<22} {'vocab':>8} {'total':>15} {'non-embedding':>15} {'routing extra':>14}"
    print(header)
    print("-" * len(header))
    for flavor, family, total, non_embedding, routing in listing_rows():
        vocab = FLAVORS[flavor]["vocab_size"]
        print(f"{flavor:<10} {family:<22} {vocab:>8,} {total:>15,} {non_embedding:>15,} {routing:>14,}")
    return 0


if __name__ == "__main__":
    import sys

    from mhar_titan.cli_args import run_command

    run_command(main, sys.argv[1:])
