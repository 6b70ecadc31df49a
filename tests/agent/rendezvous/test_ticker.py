"""The process's one thread for the handlers' periodic duties (agent.rendezvous.ticker)."""

from __future__ import annotations

import threading

from agent.rendezvous.ticker import Ticker
from tests.support.waiting import wait_until


def test_duties_run_again_and_again_until_cancelled_and_one_that_raises_stops_no_other() -> None:
    ticker = Ticker()
    runs = {"a": 0, "b": 0}

    def a() -> None:
        runs["a"] += 1

    def b() -> None:
        runs["b"] += 1
        raise RuntimeError("a duty's bug")

    before = threading.active_count()
    duty_a, duty_b = ticker.every(0.01, a), ticker.every(0.01, b)
    assert threading.active_count() - before == 1  # one thread for both
    wait_until(lambda: runs["a"] >= 3 and runs["b"] >= 3, 5, "both duties to run three times")
    duty_a.cancel()
    duty_b.cancel()
    wait_until(lambda: not ticker._heap, 5, "the cancelled duties to leave the schedule (nothing left to run)")
