"""When a step's collective is "stuck": the job's own pace, not a fixed timeout.

A SIGSTOPped peer never fails a gloo collective: it waits for the frozen rank until the
collective timeout or until the frozen node's etcd lease expires (seconds). But each rank
knows how long its steps take, so a step far beyond them is news long before that. The
rule, pure so it is a unit test away from being checked:

    stuck  <=>  waited > max(FLOOR_S, FACTOR x p90(last WINDOW steady step intervals))

* ``FACTOR`` = 4: a step four times the pace that nine steps in ten keep is not jitter.
* ``p90``, not ``p99`` (the first design): over its window of 64, p99 was the window's
  maximum, so one pause made the rule blind for 64 steps (measured: a 0.3 s pause and three
  slow first steps raised the limit to 1.7 s, and a freeze then cost 1.9 s). p90 follows the
  steady pace; a job whose slow steps are more than one in ten (a periodic stall) has them
  in its p90, and so in its limit.
* ``FLOOR_S`` = 0.5 s: a fast job's GC pause or page-fault storm (tens to hundreds of ms)
  never trips it.
* Until ``WARM_STEPS`` steady intervals are known the limit is ``STARTUP_S`` (10 s): the
  first steps (lazy initialisation, DDP buckets, optimizer state) say nothing of the pace,
  and the etcd lease still catches a freeze then.
* The first interval after a (re)join is not steady (it holds the heal and the reconfigure)
  and is not recorded (:meth:`StallRule.record` is told so by its caller).

**A join** of a round (the handle exchange and the reconfigure) has no pace of its own:
between live members it takes tens of milliseconds, and a survivor waiting for a joiner's
start-up waits on a live agent. So a join is held to the floor (:func:`join_level`): slow
at ``ASK_AT x FLOOR_S``, stuck at ``FLOOR_S``. A member frozen before or during the
exchange (the round's store host among them) then costs what a frozen peer in a step does,
and a joiner merely slow to start is asked about and found alive.

A trip is only a question: the agent asks the peers' agents directly (``agent/node/freeze.py``),
and a peer whose agent answers is never evicted. The question goes out early, at ``ASK_AT``
of the limit (:meth:`StallRule.level` 1, "slow"), so that at the limit (level 2, "stuck")
the answers, or their absence, are already in and the verdict costs no extra wait.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Iterable

FACTOR = 4.0
FLOOR_S = 0.5
STARTUP_S = 10.0
WARM_STEPS = 5
WINDOW = 100
ASK_AT = 0.4  # of the limit: when the agent starts asking the peers (0.2 s at the floor)
SLOW, STUCK = 1, 2
QUANTILE = 0.9


def percentile(values: Iterable[float], q: float = QUANTILE) -> float:
    """The ``q`` quantile (nearest rank) of ``values``; 0.0 for none."""
    ordered = sorted(values)
    if not ordered:
        return 0.0
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def stall_limit(intervals: Iterable[float], factor: float = FACTOR, floor: float = FLOOR_S,
                startup: float = STARTUP_S, warm: int = WARM_STEPS) -> float:
    """Seconds a step may take before it counts as stuck, given recent steady step intervals."""
    known = list(intervals)
    if len(known) < warm:
        return startup
    return max(floor, factor * percentile(known))


def join_level(waited: float, floor: float = FLOOR_S) -> int:
    """0, ``SLOW`` or ``STUCK`` for a join of a round that has waited ``waited`` seconds."""
    return STUCK if waited > floor else SLOW if waited > ASK_AT * floor else 0


class StallRule:
    """The recent steady step intervals of one rank, and the limit they imply."""

    def __init__(self, window: int = WINDOW) -> None:
        self._intervals: deque[float] = deque(maxlen=window)
        self._limit = stall_limit(self._intervals)  # kept with the intervals: level() runs at every poll

    def record(self, seconds: float) -> None:
        """One steady step interval (not the first after a join)."""
        if seconds >= 0:
            self._intervals.append(seconds)
            self._limit = stall_limit(self._intervals)

    def limit(self) -> float:
        return self._limit

    def stuck(self, waited: float) -> bool:
        return waited > self.limit()

    def level(self, waited: float) -> int:
        """0: on pace; ``SLOW``: past ``ASK_AT`` of the limit; ``STUCK``: past the limit."""
        limit = self.limit()
        return STUCK if waited > limit else SLOW if waited > ASK_AT * limit else 0
