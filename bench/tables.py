"""Where the kernel benchmarks' tables go: a table file (the GPU suite's OUT_DIR) or the kernels
section of the lab notebook, docs/benchmarks-log.md (`bench/routing.py`, `bench/throughput.py`,
`bench/step_host.py`)."""
from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from mhar_titan.files import write_text  # noqa: E402

SECTION = "## Kernels: depth routing"


def write_table(path: pathlib.Path, text: str) -> None:
    """Write a table file (the GPU suite's OUT_DIR), replacing an earlier version."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path, text + "\n")


def append_section(path: pathlib.Path, text: str, title: str) -> None:
    """Append `text` under `title` inside the kernels section of the lab notebook (docs/benchmarks-log.md;
    other sections untouched)."""
    content = path.read_text() if path.exists() else "# Benchmarks\n"
    block = f"\n### {title}\n\n{text}\n"
    if SECTION not in content:
        content = content.rstrip("\n") + f"\n\n{SECTION}\n\nWritten by `bench/routing.py` and `bench/throughput.py`.\n"
    start = content.index(SECTION)
    nxt = content.find("\n## ", start + len(SECTION))
    end = len(content) if nxt == -1 else nxt
    content = content[:end].rstrip("\n") + "\n" + block + content[end:]
    write_text(path, content)
