"""Tables and summary of the GPU suite (bench/gpu_suite.sh); imports torch only where needed.

    python bench/suite_report.py env OUT/env.md          # versions and device
    python bench/suite_report.py summary OUT TINY         # OUT/summary.json from OUT/rows.tsv
    pytest -p bench.suite_report ...                      # with MHAR_SUITE_TESTS_TABLE=OUT/tests.md:
                                                          # the test table, rewritten after every test
"""
from __future__ import annotations

import datetime
import json
import os
import pathlib
import platform
import sys

TIMEOUT_CODES = (124, 137)  # `timeout` killed the section (TERM, then KILL)


def versions() -> dict:
    import numpy
    import torch
    import triton

    info = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                python=platform.python_version(), torch=torch.__version__, triton=triton.__version__,
                numpy=numpy.__version__, cuda=torch.version.cuda, device="cpu")
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name()
        info["capability"] = "sm_%d%d" % torch.cuda.get_device_capability()
    info["triton_interpret"] = os.environ.get("TRITON_INTERPRET", "0")
    return info


def markdown(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]) + "\n"


def write_env(path: pathlib.Path) -> None:
    info = versions()
    path.write_text(markdown(["what", "value"], [[k, v] for k, v in info.items()]))
    print(path.read_text())


# ---------------------------------------------------------------------------- pytest plugin
_results: list[list] = []


def _write_tests_table() -> None:
    path = os.environ.get("MHAR_SUITE_TESTS_TABLE")
    if path:
        pathlib.Path(path).write_text(markdown(["test", "outcome", "seconds"], _results))


def pytest_collectreport(report):
    if report.failed:
        _results.append([report.nodeid or "collection", "collection error", "-"])
        _write_tests_table()


def pytest_runtest_logreport(report):
    """One row per test: its call outcome, or the setup/teardown outcome when that failed or skipped."""
    if report.when == "call" or report.outcome != "passed":
        _results.append([report.nodeid, f"{report.outcome} ({report.when})" if report.when != "call"
                         else report.outcome, f"{report.duration:.2f}"])
        _write_tests_table()


def pytest_sessionstart(session):
    _write_tests_table()  # an empty table exists even if nothing gets collected


# ---------------------------------------------------------------------------- summary
def summary(out: pathlib.Path, tiny: bool) -> dict:
    """OUT/summary.json from OUT/rows.tsv (one line per row the suite ran: id, section, scale,
    family, impl, AC, exit code, seconds, budget in seconds, tab-separated)."""
    rows = []
    for line in (out / "rows.tsv").read_text().splitlines():
        name, section, scale, family, impl, ac, rc, seconds, budget = line.split("\t")
        rc = int(rc)
        status = "ok" if rc == 0 else "timeout" if rc in TIMEOUT_CODES else "failed"
        table = out / f"{name}.md"
        rows.append(dict(name=name, section=section, scale=scale, family=family, impl=impl, ac=ac, status=status,
                         exit_code=rc, seconds=int(seconds), budget_s=int(budget),
                         table=table.name if table.exists() else None, log=f"{name}.log"))
    result = dict(tiny=tiny, versions=versions(), rows=rows,
                  total_seconds=sum(r["seconds"] for r in rows),
                  all_ok=all(r["status"] == "ok" for r in rows))
    (out / "summary.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def main(argv: list[str]) -> None:
    if argv[:1] == ["env"] and len(argv) == 2:
        write_env(pathlib.Path(argv[1]))
    elif argv[:1] == ["summary"] and len(argv) == 3:
        result = summary(pathlib.Path(argv[1]), argv[2] == "1")
        for r in result["rows"]:
            print(f"{r['name']:<44} {r['status']:<8} {r['seconds']:>4} s of {r['budget_s']:>3} s  table: {r['table']}")
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # the checkout's package, installed or not
    from mhar_titan.cli_args import run_command

    run_command(main, sys.argv[1:])
