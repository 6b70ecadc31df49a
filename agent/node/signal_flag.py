"""A flag that a signal handler may raise: ``threading.Event.set()`` from one can deadlock.

A Python signal handler runs in the main thread between two bytecodes, possibly while that
thread holds the Event's lock inside ``Event.wait()`` (it takes the lock again each time a
wait times out). The handler's ``set()`` then waits for a lock its own thread holds,
forever. ``elastic etcd`` hung so once under load, after a SIGTERM; ``elastic local``'s
Ctrl-C had the same window. Raising this flag is one attribute write, and waiting on it is
sleeping in short slices: a signal wakes the sleep to run the handler, and the next slice
sees the flag.
"""

from __future__ import annotations

import time
from typing import Any

_SLICE_S = 0.05


class SignalFlag:
    """``set`` (usable as a signal handler), ``is_set``, ``wait(timeout)``: an Event's interface."""

    def __init__(self) -> None:
        self._raised = False
        self.signum: int | None = None  # the first signal that raised it, when a handler did

    def set(self, *signal_args: Any) -> None:
        if self.signum is None and signal_args and isinstance(signal_args[0], int):
            self.signum = signal_args[0]
        self._raised = True

    def is_set(self) -> bool:
        return self._raised

    def wait(self, timeout: float) -> bool:
        """True as soon as the flag is raised; False after ``timeout`` seconds without it."""
        deadline = time.monotonic() + timeout
        while not self._raised:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(left, _SLICE_S))
        return True
