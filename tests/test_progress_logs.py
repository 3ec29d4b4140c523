"""Long work shows progress also when its output goes to a log file, not a terminal.

Each command runs in a subprocess with stdout and stderr redirected to a file (as in a batch job);
the test waits (a bounded poll on the file's content, no fixed sleep) for the first progress line,
checks that it came while the work was still going (the process alive, the count below the total),
and stops the command. The work is long by construction: thousands of scoring batches, the 24
compiles of the default kernel report, a minute of sleeps.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

from helpers import ROOT, wait_for

pytestmark = pytest.mark.processes  # each waits on a command in a process of its own for its first progress line


def start_logged(args: list[str], log, env: dict | None = None) -> subprocess.Popen:
    """Run ``python ARGS`` with stdout and stderr into the file ``log`` (not a terminal)."""
    out = open(log, "w")
    return subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, env=env or dict(os.environ))


def first_match(proc: subprocess.Popen, log, pattern: str) -> re.Match:
    """Wait until ``log`` holds a line matching ``pattern`` while ``proc`` still runs; stop ``proc``."""
    found = {}

    def seen() -> bool:
        found["m"] = re.search(pattern, log.read_text(), re.M)
        if found["m"] is None and proc.poll() is not None:
            raise AssertionError(f"the command ended (exit {proc.returncode}) without a progress line:\n"
                                 f"{log.read_text()[-3000:]}")
        return found["m"] is not None

    try:
        wait_for(seen, f"a progress line matching {pattern!r} in {log}", context=lambda: log.read_text()[-2000:])
        assert proc.poll() is None, "the progress line came only when the work was over"
    finally:
        proc.kill()
        proc.wait()
    return found["m"]


def test_a_long_loop_prints_progress_lines_into_the_log(tmp_path):
    log = tmp_path / "loop.log"
    code = textwrap.dedent("""
        import time
        from mhar_titan.progress import progress
        for _ in progress(range(6000), desc="long", unit="item"):  # a minute of work at least
            time.sleep(0.01)
    """)
    m = first_match(start_logged(["-c", code], log), log,
                    r"^long: (\d+)/6000 item \(\d+%\) \[\d\d:\d\d<[^,]+, [\d.]+\s?\S+\]$")
    assert 0 < int(m.group(1)) < 6000
    assert "\r" not in log.read_text()  # lines, not bar redraws


def test_lm_eval_scoring_prints_progress_into_the_log(tmp_path):
    """MharLM's log-likelihood scoring (lm-eval's requests, the paired evaluation's work) shows the
    scoring batches: 20,000 requests in batches of 2."""
    log = tmp_path / "score.log"
    code = textwrap.dedent("""
        import sys
        sys.path.insert(0, "tests")
        from helpers import tiny_model
        from mhar_titan.data import DataConfig, build_tokenizer
        from mhar_titan.eval.lm_eval_adapter import MharLM
        lm = MharLM(tiny_model(), build_tokenizer(DataConfig(tokenizer="bytes")), batch_size=2)
        lm.loglikelihood([("To be, or not to be", " that is the question")] * 20_000)
    """)
    m = first_match(start_logged(["-c", code], log), log,
                    r"^loglikelihood: (\d+)/10000 batch \(\d+%\) \[\d\d:\d\d<")
    assert 0 < int(m.group(1)) < 10_000


def test_compile_report_prints_a_line_per_compile_into_the_log(tmp_path):
    pytest.importorskip("triton")
    log = tmp_path / "compile.log"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the compiler, not the interpreter
    proc = start_logged([str(ROOT / "bench" / "compile_report.py")], log, env)
    try:
        wait_for(lambda: "compile_report: [" in log.read_text() or "no CUDA backend" in log.read_text()
                 or proc.poll() is not None, "compile_report's first line", context=lambda: log.read_text()[-2000:])
    except BaseException:
        proc.kill()
        raise
    if "no CUDA backend" in log.read_text():
        proc.kill()
        pytest.skip("this Triton build has no CUDA backend: the sm_90 compile cannot run")
    m = first_match(proc, log, r"^compile_report: \[(\d+)/24\] (forward|backward) d=512 H=1 (aligned|general): "
                               r"\d+ registers, \d+ spill bytes \(\d+ s\)$")
    assert 1 <= int(m.group(1)) < 24
