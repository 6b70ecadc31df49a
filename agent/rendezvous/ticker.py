"""One thread for every handler's small periodic duties in a process.

An agent holds one rendezvous handler, so a thread per duty costs it nothing. The
simulation (``bench/rendezvous_sim.py``) holds hundreds per process, and a thread each for
duties that mostly sleep (the lease watch's look, ``ttl / 16`` apart) made thousands of
threads whose wake-ups alone starved the handlers' keep-alives on 2 cores. A duty here
must not block: it looks at memory and starts whatever waits elsewhere.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import threading
import time
from typing import Callable

log = logging.getLogger(__name__)


class Duty:
    """A handle: :meth:`cancel` stops it (its next run at the latest)."""

    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class Ticker:
    """``every(interval, fn)``: run ``fn`` about every ``interval`` seconds on the ticker's thread."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, float, Callable[[], None], Duty]] = []
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None

    def every(self, interval: float, fn: Callable[[], None]) -> Duty:
        duty = Duty()
        with self._cond:
            heapq.heappush(self._heap, (time.monotonic() + interval, next(self._ids), interval, fn, duty))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="elastic-ticker", daemon=True)
                self._thread.start()
            self._cond.notify()
        return duty

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._heap or self._heap[0][0] > time.monotonic():
                    self._cond.wait(self._heap[0][0] - time.monotonic() if self._heap else None)
                due, ident, interval, fn, duty = heapq.heappop(self._heap)
                if duty.cancelled:
                    continue
                heapq.heappush(self._heap, (max(due + interval, time.monotonic()), ident, interval, fn, duty))
            try:
                fn()
            except Exception:  # one duty's bug must not stop the others
                log.exception("periodic duty failed")


_shared = Ticker()


def shared() -> Ticker:
    return _shared


def _after_fork() -> None:  # a forked child has no ticker thread: it starts its own on first use
    global _shared
    _shared = Ticker()


os.register_at_fork(after_in_child=_after_fork)
