"""The hang watchdog: has any local rank finished a step lately?

One frozen rank (a deadlock, a stuck data loader, a wedged GPU) blocks every other rank
in the next collective, so "no local rank progressed for T seconds" is the signal, read
from the heartbeat files the workers overwrite at each step (:mod:`elastic.heartbeat`).

``auto`` derives T from the observed step time (20 x the median interval between beats,
at least 60 s) so a job of 30-second steps is not killed for being slow. Before a worker
group's first step (imports, restore, compilation) the budget is ``startup_timeout``.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from pathlib import Path

from elastic.heartbeat import read_beats

AUTO_FLOOR_S = 60.0
AUTO_FACTOR = 20.0
STARTUP_TIMEOUT_S = 600.0


class HangWatch:
    def __init__(self, directory: Path, timeout: float | None, startup_timeout: float = STARTUP_TIMEOUT_S) -> None:
        self.directory, self.timeout = directory, timeout  # None: auto
        self.startup_timeout = max(startup_timeout, timeout or 0.0)
        self._intervals: deque[float] = deque(maxlen=200)
        self._last: dict[int, tuple[int, float]] = {}
        self.reset()

    def reset(self) -> None:
        """A new worker group: forget old beats (a new group's first beat must be its own)."""
        self._group_started = time.time()
        self._last.clear()
        for path in self.directory.glob("rank-*"):
            path.unlink(missing_ok=True)

    def current_timeout(self) -> float:
        if self.timeout is not None:
            return self.timeout
        if len(self._intervals) < 5:
            return AUTO_FLOOR_S
        return max(AUTO_FLOOR_S, AUTO_FACTOR * statistics.median(self._intervals))

    def describe_timeout(self) -> str:
        return f"{self.timeout:g} s" if self.timeout is not None else f"auto, {self.current_timeout():.0f} s"

    def progressed(self) -> bool:
        """Has a rank of the current group finished a step (as last seen by ``stalled``)?"""
        return bool(self._last)

    def stalled(self) -> float | None:
        """Seconds since the last progress on this node if that exceeds the budget, else None."""
        now = time.time()
        beats = {r: b for r, b in read_beats(self.directory).items() if b.time >= self._group_started}
        for rank, beat in beats.items():
            seen = self._last.get(rank)
            if seen is not None and beat.step > seen[0] and beat.time > seen[1]:
                self._intervals.append((beat.time - seen[1]) / (beat.step - seen[0]))
            self._last[rank] = (beat.step, beat.time)
        if not beats:
            quiet = now - self._group_started
            return quiet if quiet > self.startup_timeout else None
        quiet = now - max(b.time for b in beats.values())
        return quiet if quiet > self.current_timeout() else None
