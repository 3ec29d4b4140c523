"""The suite's tiers and the fast tier's per-test budget (tests/tiers.py), checked on small suites
run by pytest's own pytester with this suite's conftest: a slow-tier test is one marked slow, of a
kind that implies it, or asking for a launching fixture; with the budget on, a fast-tier test over
it fails the run, named with the tier it belongs in, while the same test marked slow passes."""
import pytest

from helpers import ROOT

pytest_plugins = ["pytester"]

SUITE = """
import time
import pytest

def test_quick():
    pass

def test_sleeps():
    time.sleep(SLEEP)

@pytest.mark.slow
def test_sleeps_marked_slow():
    time.sleep(SLEEP)

@pytest.mark.processes
def test_sleeps_waiting_on_a_process():
    time.sleep(SLEEP)

def test_asks_for_torchrun(torchrun):
    pass

def test_asks_for_a_training_process(train_process):
    pass
"""
SLEEP = 1.0  # over the budgets below, however idle the machine


@pytest.fixture
def suite(pytester, monkeypatch):
    """A test folder with this suite's conftest and SUITE; neither CI nor a budget set."""
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("MHAR_TEST_BUDGET_S", raising=False)
    pytester.makeconftest((ROOT / "tests" / "conftest.py").read_text())
    pytester.makepyfile(test_suite=SUITE.replace("SLEEP", repr(SLEEP)))
    return pytester


def collected(result) -> list[str]:
    return sorted(line.split("::")[1] for line in result.outlines if "::" in line)


def test_the_fast_tier_leaves_out_slow_marks_kinds_and_launching_fixtures(suite):
    fast = suite.runpytest_inprocess("-m", "not slow", "--collect-only", "-q", "-p", "no:cacheprovider")
    assert collected(fast) == ["test_quick", "test_sleeps"]
    slow = suite.runpytest_inprocess("-m", "slow", "--collect-only", "-q", "-p", "no:cacheprovider")
    assert collected(slow) == ["test_asks_for_a_training_process", "test_asks_for_torchrun",
                               "test_sleeps_marked_slow", "test_sleeps_waiting_on_a_process"]
    kinds = suite.runpytest_inprocess("-m", "distributed or processes", "--collect-only", "-q", "-p", "no:cacheprovider")
    assert collected(kinds) == ["test_asks_for_a_training_process", "test_asks_for_torchrun",
                                "test_sleeps_waiting_on_a_process"]


def test_a_fast_tier_test_over_the_budget_fails_the_run_naming_it_and_its_tier(suite, monkeypatch):
    monkeypatch.setenv("MHAR_TEST_BUDGET_S", "0.5")
    result = suite.runpytest_inprocess("-p", "no:cacheprovider", "-k", "sleeps")
    result.assert_outcomes(passed=3)  # every test passed: the budget fails the run, not the test
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    over = [line for line in result.outlines if " s per test: it belongs in the slow tier" in line]
    assert len(over) == 1 and over[0].startswith("test_suite.py::test_sleeps took "), result.outlines[-10:]
    assert "over the fast tier's 0.5 s per test" in over[0] and "@pytest.mark.slow" in over[0]


def test_marked_slow_the_same_test_passes_the_budget(suite, monkeypatch):
    monkeypatch.setenv("MHAR_TEST_BUDGET_S", "0.5")
    result = suite.runpytest_inprocess("-p", "no:cacheprovider", "-k", "marked or waiting")
    result.assert_outcomes(passed=2)
    assert result.ret == pytest.ExitCode.OK
    assert not any("belongs in the slow tier" in line for line in result.outlines)


def test_ci_turns_the_budget_on_at_20_s_and_0_turns_it_off(suite, monkeypatch):
    import tiers

    assert tiers.budget_s() is None  # neither CI nor MHAR_TEST_BUDGET_S: no check
    monkeypatch.setenv("CI", "true")
    assert tiers.budget_s() == tiers.BUDGET_S == 20.0
    result = suite.runpytest_inprocess("-p", "no:cacheprovider", "-k", "sleeps")
    assert result.ret == pytest.ExitCode.OK  # a 1 s test is within 20 s
    monkeypatch.setenv("MHAR_TEST_BUDGET_S", "0")
    assert tiers.budget_s() is None
    monkeypatch.setenv("MHAR_TEST_BUDGET_S", "soon")
    with pytest.raises(pytest.UsageError, match="MHAR_TEST_BUDGET_S='soon' is not a number of seconds"):
        tiers.budget_s()
