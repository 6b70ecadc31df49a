"""The left-behind rule (elastic.inplace.left_behind): pure, checked in milliseconds. The
worker that acts on it end to end: tests/agent/test_left_behind.py."""

from __future__ import annotations

import threading
import time

from elastic.inplace.left_behind import FLOOR_S, IDLE_SHARE, LeftBehindWatch, bound, left_behind, main_thread_cpu


def test_the_bound_is_the_floor_for_fast_steps_and_grows_with_slow_ones() -> None:
    assert bound(0.5) == FLOOR_S
    assert bound(10.0) == 100.0  # 10 x a 10 s stall limit (2.5 s steps)


def test_an_idle_main_thread_past_the_bound_is_left_behind_and_one_that_computes_is_not() -> None:
    assert not left_behind(FLOOR_S - 1, 0.0, 0.5)  # within the bound: never
    assert left_behind(FLOOR_S + 1, 0.0, 0.5)  # idle past it
    assert left_behind(FLOOR_S + 1, None, 0.5)  # idle or not known: counted idle
    assert not left_behind(FLOOR_S + 1, (FLOOR_S + 1) * IDLE_SHARE * 2, 0.5)  # still computing (an evaluation)
    assert not left_behind(60.0, 0.0, 10.0)  # a slow job's bound is its own: 100 s


def test_the_watch_clocks_from_the_trip_and_stops_when_the_main_thread_joins() -> None:
    watch = LeftBehindWatch()
    assert watch.check(1000.0, 0.5) is None  # no trip: nothing to judge
    watch.tripped(100.0)
    watch.tripped(110.0)  # a second replacing round does not restart the clock
    assert watch.check(100.0 + FLOOR_S - 1, 0.5) is None
    waited = watch.check(100.0 + FLOOR_S + 1, 0.5)  # this test's main thread computed little since
    assert waited == FLOOR_S + 1
    watch.left()
    assert watch.check(1000.0, 0.5) is None


def test_a_main_thread_that_computes_through_the_window_gets_another_and_is_judged_once_idle() -> None:
    """Read from /proc for real, with a short floor: the main thread spins through the first
    window (not left behind: a new window starts), then sleeps through the second (left behind)."""
    watch = LeftBehindWatch(floor=0.3)
    watch.tripped(time.monotonic())
    found: list[float | None] = []

    def judge() -> None:
        time.sleep(0.4)
        found.append(watch.check(time.monotonic(), 0.0))

    for computes in (True, False):
        judging = threading.Thread(target=judge)
        judging.start()
        while judging.is_alive():
            if computes:
                sum(range(1000))  # an evaluation, a save: the main thread is busy, not stuck
            else:
                time.sleep(0.01)  # idle, as in a read nobody answers
        judging.join()
    assert found[0] is None, "a computing main thread was judged left behind"
    assert found[1] is not None and found[1] >= 0.3, found


def test_the_main_threads_cpu_is_read_from_proc_and_grows_while_it_computes() -> None:
    before = main_thread_cpu()
    assert before is not None
    deadline = time.thread_time() + 0.2
    while time.thread_time() < deadline:
        pass
    after = main_thread_cpu()
    assert after is not None and after - before >= 0.15
