"""The stuck-step rule (elastic.inplace.stall): pure, checked in milliseconds."""

from __future__ import annotations

import pytest

from elastic.inplace.stall import FACTOR, FLOOR_S, STARTUP_S, WARM_STEPS, StallRule, percentile, stall_limit


def steady(seconds: float, n: int = 40) -> StallRule:
    rule = StallRule()
    for _ in range(n):
        rule.record(seconds)
    return rule


def test_the_percentile_is_the_nearest_rank() -> None:
    assert percentile([]) == 0.0
    assert percentile([0.2]) == 0.2
    assert percentile([float(i) for i in range(1, 101)]) == 90.0
    assert percentile([float(i) for i in range(1, 101)], 0.99) == 99.0


def test_no_history_means_the_generous_start_up_limit() -> None:
    assert StallRule().limit() == STARTUP_S
    rule = steady(0.02, WARM_STEPS - 1)
    assert rule.limit() == STARTUP_S and not rule.stuck(5.0), "a slow first step must not trip it"
    rule.record(0.02)
    assert rule.limit() == FLOOR_S


def test_a_fast_job_is_stuck_past_the_floor_and_not_before() -> None:
    rule = steady(0.03)
    assert rule.limit() == FLOOR_S
    assert not rule.stuck(0.33), "a 0.3 s GC pause on top of a step"
    assert rule.stuck(0.51)


def test_a_slow_job_scales_the_limit_with_its_own_pace() -> None:
    rule = steady(0.4)
    assert rule.limit() == pytest.approx(FACTOR * 0.4)
    assert not rule.stuck(1.5) and rule.stuck(1.7)


def test_a_few_slow_steps_do_not_blind_the_rule() -> None:
    """Slow first steps and a GC pause are outliers: the limit stays on the steady pace."""
    rule = StallRule()
    for seconds in [0.45, 0.45, 0.45] + [0.04] * 40 + [0.34] + [0.04] * 20:
        rule.record(seconds)
    assert rule.limit() == FLOOR_S


def test_a_periodic_stall_is_part_of_the_pace() -> None:
    """One step in five waits 0.3 s (a data loader refill): that is the job's pace, not a freeze."""
    rule = StallRule()
    for i in range(100):
        rule.record(0.3 if i % 5 == 0 else 0.03)
    assert rule.limit() == pytest.approx(FACTOR * 0.3)
    assert not rule.stuck(1.0)


def test_negative_intervals_are_ignored_and_limit_is_pure() -> None:
    rule = steady(0.03)
    rule.record(-1.0)
    assert rule.limit() == FLOOR_S
    assert stall_limit([0.2] * 10, factor=2.0, floor=0.1) == pytest.approx(0.4)
    assert stall_limit([0.2] * 2, startup=7.0) == 7.0
