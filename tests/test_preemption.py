"""PreemptionHandler in one process: the signals set the flag, nothing else happens.
Agreement across ranks and SIGTERM to real training runs (single process and torchrun)
are in test_checkpoint_e2e.py; SIGTERM through the two-node launcher in
test_launch_two_node.py."""
from __future__ import annotations

import os
import signal

import pytest

from mhar_titan.preemption import PreemptionHandler


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_signal_sets_should_stop_and_restore_reinstalls_previous(sig):
    previous = signal.getsignal(sig)
    handler = PreemptionHandler()
    try:
        assert handler.should_stop() is False
        os.kill(os.getpid(), sig)  # the process survives: the handler only records it
        assert handler.should_stop() is True
        assert handler.received == sig
    finally:
        handler.restore()
    assert signal.getsignal(sig) is previous


def test_only_the_chosen_signals_are_handled():
    handler = PreemptionHandler(signals=(signal.SIGUSR1,))
    try:
        assert signal.getsignal(signal.SIGTERM) is not handler._on_signal
        os.kill(os.getpid(), signal.SIGUSR1)
        assert handler.should_stop()
    finally:
        handler.restore()
