"""Signals between the writer thread and a training thread that a signal handler may interrupt.

``flush()`` is called from SIGTERM handlers, which run on the training thread wherever it was
interrupted. Whatever lock that thread held at that moment stays held until the handler
returns, and the handler waits for the writer thread. So the writer thread must never block
on a lock the training thread can hold:

* ``threading.Event.set()`` takes the event's condition lock, which a training thread
  holds for a moment inside ``Event.wait()``; interrupted there, a handler that flushes
  waited for ever. :class:`OneShot` is set by releasing a plain lock, which never blocks.
* A ``logging`` handler's lock is held by a training thread for the length of each log
  call. :class:`LogPump` takes the writer's threads' records (the store's own lines on the
  snapshot-io thread too) and emits them from a thread of its own, so only that thread
  can wait on a handler's lock, and nobody waits on it.
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
    """Log records handed over by threads that must not block, emitted by a thread of their own.

    A thread that calls :meth:`adopt` hands over every record of the ``checkpoints``
    loggers it logs to (the store's prune and fence lines included, written on the
    snapshot-io thread): a filter on those loggers, which runs before any handler's lock is
    taken, queues the record here instead. Other threads log as before.
    """

    _local = threading.local()  # .pump: the LogPump this thread hands its records to

    def __init__(self, logger: logging.Logger, name: str) -> None:
        self.logger = logger
        self._records: queue.SimpleQueue[logging.LogRecord | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def log(self, level: int, msg: str, *args: Any) -> None:
        if self.logger.isEnabledFor(level):
            self.take(self.logger.makeRecord(self.logger.name, level, "(writer)", 0, msg, args, None))

    def take(self, record: logging.LogRecord) -> None:
        """Queue ``record`` for the pump's thread; never blocks (SimpleQueue.put is reentrant)."""
        self._records.put(record)

    def adopt(self) -> None:
        """From now on, this thread's ``checkpoints`` records go through the pump."""
        _divert_checkpoints_loggers()
        LogPump._local.pump = self

    def close(self, timeout: float = 5.0) -> None:
        """Emit what is queued, then stop."""
        self._records.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while (record := self._records.get()) is not None:
            logging.getLogger(record.name).handle(record)  # this thread adopted nothing: it emits


class _Divert(logging.Filter):
    """On an adopted thread, queue the record in its pump and drop it here."""

    def filter(self, record: logging.LogRecord) -> bool:
        pump: LogPump | None = getattr(LogPump._local, "pump", None)
        if pump is None:
            return True
        pump.take(record)
        return False


_DIVERT = _Divert()


def _divert_checkpoints_loggers() -> None:
    """A logger's filters apply to its own records only (a parent's do not), so the filter
    goes on every ``checkpoints`` logger that exists; the package's modules are imported
    before a writer starts. Idempotent."""
    for name in ["checkpoints", *logging.Logger.manager.loggerDict]:
        if name == "checkpoints" or name.startswith("checkpoints."):
            logger = logging.getLogger(name)
            if _DIVERT not in logger.filters:
                logger.addFilter(_DIVERT)
