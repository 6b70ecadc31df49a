"""One strike counter for every keep-out of a node (agent/node/keep_outs.py), in milliseconds."""

from __future__ import annotations

import pytest

import agent.node.keep_outs as keep_outs_module
from agent.node.keep_outs import KeepOuts
from agent.rendezvous.keepout import BACKOFF_BASE_S, STRIKES_FORGOTTEN_AFTER_S


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(keep_outs_module, "time", fake)
    return fake


def test_every_cause_counts_on_one_strike_counter_and_backs_off_longer_each_time(clock: Clock) -> None:
    outs = KeepOuts("b", closed=lambda: False)
    crash = outs.strike("local rank(s) [0] failed right after each of the last 3 starts", 4)
    assert (crash.node, crash.strikes, crash.backoff, crash.round) == ("b", 1, BACKOFF_BASE_S, 4)
    assert outs.stay_out(crash) and clock.now == 1000.0 + BACKOFF_BASE_S
    sick = outs.strike("health check snapshot_dir_writable failed", 5)  # back at once, and sick: longer
    assert sick.strikes == 2 and sick.backoff == 2 * BACKOFF_BASE_S and sick.cause.startswith("health check")


def test_a_node_back_in_for_a_while_starts_again_from_the_base_back_off(clock: Clock) -> None:
    outs = KeepOuts("b", closed=lambda: False)
    for _ in range(3):
        assert outs.stay_out(outs.strike("slow", 1))
    clock.now += STRIKES_FORGOTTEN_AFTER_S
    assert outs.strike("slow", 2).strikes == 1


def test_the_end_of_the_job_ends_a_keep_out_at_once(clock: Clock) -> None:
    ended = {"now": False}
    outs = KeepOuts("b", closed=lambda: ended["now"])
    out = outs.strike("suspect hardware", 1)
    ended["now"] = True
    assert not outs.stay_out(out) and clock.now == 1000.0


def test_keep_out_s_sets_the_first_back_off_and_each_strike_doubles_it_up_to_the_cap(clock: Clock) -> None:
    outs = KeepOuts("b", closed=lambda: False, base_s=60.0)
    assert [outs.strike("suspect hardware", n).backoff for n in range(4)] == [60.0, 120.0, 240.0, 300.0]
