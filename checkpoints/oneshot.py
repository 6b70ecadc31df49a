"""Signals between the writer thread and a training thread that a signal handler may interrupt.

``flush()`` is called from SIGTERM handlers, which run on the training thread wherever it was
interrupted. Whatever lock that thread held at that moment stays held until the handler
returns, and the handler waits for the writer thread. So the writer thread must never block
on a lock the training thread can hold:

* ``threading.Event.set()`` takes the event's condition lock, which a training thread
  holds for a moment inside ``Event.wait()``; interrupted there, a handler that flushes
  waited for ever. :class:`OneShot` is set by releasing a plain lock, which never blocks.
* A ``logging`` handler's lock is held by a training thread for the length of each log
  call. :class:`LogPump` takes the writer thread's records and emits them from a thread of
  its own, so only that thread can wait on a handler's lock, and nobody waits on it.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any


class OneShot:
    """A flag set once, by one thread, that any number of threads may wait for."""

    def __init__(self) -> None:
        self._gate = threading.Lock()
        self._gate.acquire()  # released by set(); a waiter passes it on to the next
        self._set = False

    def set(self) -> None:
        """Never blocks: releases the gate. Call it from one thread, as the writer does."""
        if not self._set:
            self._set = True
            self._gate.release()

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float | None = None) -> bool:
        """True once set; False after ``timeout`` seconds. A signal handler may run during
        the wait: the waiting frame holds nothing another thread needs."""
        if self._set:
            return True
        if self._gate.acquire(timeout=-1 if timeout is None else max(timeout, 0.0)):
            self._gate.release()  # the next waiter passes too
        return self._set


class LogPump:
    """Log records handed over by a thread that must not block, emitted by a thread of their own."""

    def __init__(self, logger: logging.Logger, name: str) -> None:
        self.logger = logger
        self._records: queue.SimpleQueue[tuple[int, str, tuple[Any, ...]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def log(self, level: int, msg: str, *args: Any) -> None:
        if self.logger.isEnabledFor(level):
            self._records.put((level, msg, args))  # SimpleQueue.put is reentrant and never blocks

    def close(self, timeout: float = 5.0) -> None:
        """Emit what is queued, then stop."""
        self._records.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while (record := self._records.get()) is not None:
            level, msg, args = record
            self.logger.log(level, msg, *args)
