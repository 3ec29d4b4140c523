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


def main() -> None:
    header = f"{'flavor':<10} {'family':<22} {'vocab':>8} {'total':>15} {'non-embedding':>15} {'routing extra':>14}"
    print(header)
    print("-" * len(header))
    for flavor, family, total, non_embedding, routing in listing_rows():
        vocab = FLAVORS[flavor]["vocab_size"]
        print(f"{flavor:<10} {family:<22} {vocab:>8,} {total:>15,} {non_embedding:>15,} {routing:>14,}")


if __name__ == "__main__":
    main()
