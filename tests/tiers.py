"""The suite's two tiers and the fast tier's per-test budget (imported by tests/conftest.py).

The slow tier is every test marked ``slow``; everything else is the fast tier, which ``make
test-fast`` runs (``pytest -m "not slow"``) and ``make test`` runs with the slow tier. A test lands
in a tier by how it is written, not by a list:

- ``@pytest.mark.slow``: a test that takes long for another reason (a subprocess training run,
  several trainings, a whole README).
- A kind marker puts its tests in the slow tier too (``IMPLIES_SLOW``), and skips them where the
  kind cannot run: ``distributed`` (launches torchrun; skipped without torch.distributed),
  ``processes`` (waits on other processes or signals), ``lm_eval`` (runs lm-eval; skipped without
  the lm-eval extra). ``gpu`` skips without CUDA (on a GPU machine it runs in either tier).
- A test that asks for a fixture of ``SLOW_FIXTURES`` (conftest: ``torchrun``, ``train_process``,
  which launch them) is in the slow tier, marked as the fixture's kind.

The budget: with ``CI`` set (``.ci/run`` sets it) or ``MHAR_TEST_BUDGET_S`` given, a fast-tier test
whose setup, call and teardown take more than ``BUDGET_S`` seconds of wall time fails the run: the
summary names the test, its time and the tier it belongs in. ``MHAR_TEST_BUDGET_S`` sets another
budget in seconds (0 turns the check off). Wall time stretches with the machine's load: the
budget is for an otherwise idle CI runner (the fast tier's slowest tests take a few seconds there,
docs/TRAINING.md "The test suite's wall time").
"""
from __future__ import annotations

import importlib.util
import os

import pytest

BUDGET_S = 20.0
"""Seconds of wall time one fast-tier test may take on the CI runner (setup + call + teardown)."""

IMPLIES_SLOW = {"distributed": "launches torchrun", "processes": "waits on other processes or signals",
                "lm_eval": "runs lm-eval"}
"""Markers whose tests are in the slow tier, with what they mean."""

SLOW_FIXTURES = {"torchrun": "distributed", "train_process": "processes"}
"""Fixtures (tests/conftest.py) whose tests are in the slow tier -> the kind marker they get."""


def _skip_reason(kind: str, has_cuda: bool) -> str | None:
    if kind == "gpu" and not has_cuda:
        return "needs CUDA (marked gpu)"
    if kind == "distributed":
        import torch.distributed as dist

        if not dist.is_available():
            return "needs torch.distributed (marked distributed)"
    if kind == "lm_eval" and importlib.util.find_spec("lm_eval") is None:
        return "needs lm-eval (marked lm_eval): `make setup` installs it"
    return None


def mark_tiers(items: list, has_cuda: bool) -> None:
    """Mark every test of the slow tier ``slow`` (a kind marker or a launching fixture implies it)
    and skip the tests whose kind cannot run here."""
    for item in items:
        for fixture, kind in SLOW_FIXTURES.items():
            if fixture in getattr(item, "fixturenames", ()):
                item.add_marker(kind)
        kinds = [kind for kind in ("gpu", *IMPLIES_SLOW) if item.get_closest_marker(kind)]
        if any(kind in IMPLIES_SLOW for kind in kinds) and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.slow)
        for kind in kinds:
            reason = _skip_reason(kind, has_cuda)
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))
                break


def budget_s() -> float | None:
    """The fast tier's per-test budget in seconds where the check runs (``CI`` set, or
    ``MHAR_TEST_BUDGET_S``), else None; ``MHAR_TEST_BUDGET_S=0`` is None."""
    given = os.environ.get("MHAR_TEST_BUDGET_S")
    if given is not None:
        try:
            seconds = float(given)
        except ValueError:
            raise pytest.UsageError(f"MHAR_TEST_BUDGET_S={given!r} is not a number of seconds (0 turns the "
                                    "budget check off)") from None
        return seconds if seconds > 0 else None
    return BUDGET_S if os.environ.get("CI", "").lower() not in ("", "0", "false", "no") else None


class Budget:
    """Adds up each fast-tier test's setup, call and teardown time; a test over ``seconds`` fails
    the session, named in the summary with the tier it belongs in."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.slow: set[str] = set()
        self.times: dict[str, float] = {}
        self.over: list[tuple[str, float]] = []

    def pytest_collection_finish(self, session) -> None:
        self.slow = {item.nodeid for item in session.items if item.get_closest_marker("slow")}

    def pytest_runtest_logreport(self, report) -> None:
        if report.nodeid in self.slow or report.skipped:
            return
        self.times[report.nodeid] = self.times.get(report.nodeid, 0.0) + report.duration
        if report.when == "teardown" and self.times[report.nodeid] > self.seconds:
            self.over.append((report.nodeid, self.times[report.nodeid]))

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session) -> None:
        if self.over and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.over:
            return
        terminalreporter.section("fast tier over its budget", sep="=", red=True, bold=True)
        for nodeid, seconds in self.over:
            terminalreporter.line(
                f"{nodeid} took {seconds:.1f} s, over the fast tier's {self.seconds:g} s per test: it belongs in "
                f"the slow tier (mark it @pytest.mark.slow, or a kind that implies it: "
                f"{', '.join(IMPLIES_SLOW)}), or make it faster", red=True)


def configure(config) -> None:
    """Register the budget check where it runs (``budget_s``)."""
    seconds = budget_s()
    if seconds is not None and not config.pluginmanager.has_plugin("mhar-test-budget"):
        config.pluginmanager.register(Budget(seconds), "mhar-test-budget")
