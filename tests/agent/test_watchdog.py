"""The hang watchdog's verdicts (``agent.node.watchdog``), on records written as workers write them.

The clock is the test's, so each verdict is exact and takes no time: what is checked is
when a node's workers count as hung, not how long a test can wait.
"""

from __future__ import annotations

import math
import os
import struct
from pathlib import Path

import pytest

from agent.node import watchdog
from agent.node.watchdog import HangWatch
from elastic.heartbeat import LOCAL_COUNT

RECORD = struct.Struct("<qdqqdqd")  # as elastic.heartbeat writes it: spelled out, so a change fails here


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock(1000.0)
    monkeypatch.setattr(watchdog.time, "time", clock)
    return clock


def beat(directory: Path, rank: int, step: int, at: float, finished: float = 0.0) -> None:
    (directory / f"rank-{rank}").write_bytes(RECORD.pack(step, at, os.getpid(), LOCAL_COUNT, math.nan, 0, finished))


def test_no_progress_past_the_timeout_is_a_hang(tmp_path: Path, clock: Clock) -> None:
    watch = HangWatch(tmp_path, timeout=2.0)
    beat(tmp_path, 0, 1, 1000.5)
    clock.now = 1002.0
    assert watch.stalled() is None
    clock.now = 1003.0
    assert watch.stalled() == pytest.approx(2.5)


def test_a_script_that_returned_is_never_hung_however_long_its_teardown(tmp_path: Path, clock: Clock) -> None:
    """The interpreter's teardown, or an exit hook such as ``wandb.finish()``, on a loaded
    machine: restarting the workers would train a finished script all over again."""
    watch = HangWatch(tmp_path, timeout=2.0)
    for rank in (0, 1):
        beat(tmp_path, rank, 200, 1010.0, finished=1010.1)
    clock.now = 1010.0 + watchdog.LINGER_WARNING_S + 50
    assert watch.stalled() is None


def test_a_rank_still_running_is_judged_from_the_last_return_or_beat(tmp_path: Path, clock: Clock) -> None:
    watch = HangWatch(tmp_path, timeout=2.0)
    beat(tmp_path, 0, 200, 1010.0, finished=1011.0)  # returned at 1011
    beat(tmp_path, 1, 199, 1009.0)  # never returned, last progress at 1009
    clock.now = 1012.5
    assert watch.stalled() is None
    clock.now = 1014.0
    assert watch.stalled() == pytest.approx(3.0)


def test_lingering_after_the_script_returned_is_said_once(tmp_path: Path, clock: Clock,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    watch = HangWatch(tmp_path, timeout=None, node="a")
    beat(tmp_path, 0, 9, 1001.0, finished=1001.0)
    clock.now = 1001.0 + watchdog.LINGER_WARNING_S - 1
    with caplog.at_level("WARNING", logger="elastic.agent"):
        assert watch.stalled() is None
        assert "have not exited" not in caplog.text
        clock.now += 2
        assert watch.stalled() is None and watch.stalled() is None
    assert caplog.text.count("have not exited") == 1


def test_a_spares_workers_adopted_keep_the_heartbeat_files_they_opened(tmp_path: Path, clock: Clock) -> None:
    """A spare's workers, started ahead, opened their files before the round admitted them:
    a reset that unlinked those left them beating into files no one reads, so the node had
    no hang watch and no pace (it was never named a straggler). An older group's go."""
    watch = HangWatch(tmp_path, timeout=2.0)
    beat(tmp_path, 0, 7, 1000.0)
    watch.reset()
    assert not list(tmp_path.glob("rank-*")), "an older group's beat outlived a new group's start"
    beat(tmp_path, 0, 1, 1000.5)  # the spare's worker, started ahead
    watch.reset(keep_files=True)  # admitted: the same workers go on
    assert [p.name for p in tmp_path.glob("rank-*")] == ["rank-0"]
    beat(tmp_path, 0, 2, 1001.0)
    clock.now = 1002.5
    assert watch.stalled() is None  # its beat is read
    clock.now = 1003.5
    assert watch.stalled() == pytest.approx(2.5)
