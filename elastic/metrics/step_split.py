"""One rank's step time split: its own work (compute) apart from waiting on the others.

In data-parallel training every rank's step takes as long as the slowest rank's, so the
step time says nothing about *which* rank is slow. What differs is where the time goes: a
slow rank computes longer, the others wait longer in the gradient all-reduce. So

    compute = step time - data wait - collective wait - snapshot stall

(the collective wait is what the comm hook timed this step) is the figure that tells a
straggler from its victims. Exported as the *median of the last* :data:`WINDOW_STEPS`
steps (a gauge), not a histogram: a reader (the agent, ``elastic top``) needs the rank's
current pace in one sample, without keeping histogram deltas of its own, and a median
ignores the odd slow step (a GC pause, a snapshot's capture) that a mean would not.
The first :data:`SKIP_STEPS` steps of a world are left out (warm-up, lazy allocation,
autotuning), so no figure exists until ``SKIP_STEPS + MIN_STEPS`` steps have run.

Pure and torch-free: unit-tested with synthetic timings.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

WINDOW_STEPS = 20  # the median's window: long enough to ignore a pause, short enough to follow a change
SKIP_STEPS = 2  # the first steps of each world (warm-up) are not the rank's pace
MIN_STEPS = 5  # steps in the window before the median is worth exporting


@dataclass(frozen=True)
class Split:
    """Medians over the window, in seconds per step."""

    compute: float
    collective: float
    data_wait: float
    steps: int  # steps in the window


class StepSplit:
    """Feed it every committed step; :attr:`current` is the window's medians (None at first)."""

    def __init__(self, window: int = WINDOW_STEPS, skip: int = SKIP_STEPS, min_steps: int = MIN_STEPS) -> None:
        self._window, self._skip, self._min = window, skip, min_steps
        self._compute: deque[float] = deque(maxlen=window)
        self._collective: deque[float] = deque(maxlen=window)
        self._data: deque[float] = deque(maxlen=window)
        self._seen = 0

    def reset(self) -> None:
        """A new world (other peers, another rank): the old pace no longer applies."""
        self._compute.clear()
        self._collective.clear()
        self._data.clear()
        self._seen = 0

    def add(self, step_seconds: float, data_wait_seconds: float, collective_seconds: float,
            snapshot_seconds: float = 0.0) -> Split | None:
        """One committed step. The snapshot stall (rank 0's submit, every rank's capture wait)
        is left out too: with snapshots every step, rank 0 would otherwise look slow."""
        self._seen += 1
        if self._seen <= self._skip:
            return None
        collective = min(max(0.0, collective_seconds), max(0.0, step_seconds - data_wait_seconds))
        own = step_seconds - data_wait_seconds - collective - max(0.0, snapshot_seconds)
        self._compute.append(max(0.0, own))
        self._collective.append(collective)
        self._data.append(max(0.0, data_wait_seconds))
        return self.current

    @property
    def current(self) -> Split | None:
        if len(self._compute) < self._min:
            return None
        return Split(statistics.median(self._compute), statistics.median(self._collective),
                     statistics.median(self._data), len(self._compute))
