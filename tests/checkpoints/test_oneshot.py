"""The writer thread's signals never block on a lock a (signal-interrupted) waiter holds."""

from __future__ import annotations

import logging
import threading
import time

from checkpoints.oneshot import LogPump, OneShot


class Recording(logging.Handler):
    """Each record's message and the thread that emitted it."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append((record.getMessage(), threading.current_thread().name))


def test_set_returns_while_another_thread_waits_and_every_waiter_passes() -> None:
    flag = OneShot()
    passed: list[bool] = []
    waiters = [threading.Thread(target=lambda: passed.append(flag.wait(30))) for _ in range(4)]
    for w in waiters:
        w.start()
    time.sleep(0.05)  # let them block (not a correctness wait: set() must work either way)
    flag.set()
    flag.set()  # a second set is a no-op, not a second release
    for w in waiters:
        w.join(30)
    assert passed == [True] * 4 and flag.is_set() and flag.wait(0)


def test_a_wait_that_times_out_says_so() -> None:
    flag = OneShot()
    started = time.monotonic()
    assert flag.wait(0.05) is False and not flag.is_set()
    assert time.monotonic() - started >= 0.05


def test_threading_event_would_block_its_setter_where_oneshot_does_not() -> None:
    """The deadlock the writer had: a waiter interrupted inside ``Event.wait`` holds the
    event's condition lock, and ``set()`` from the writer thread waits for it."""
    event = threading.Event()
    event._cond.acquire()  # where an interrupted Event.wait() stands
    try:
        setter = threading.Thread(target=event.set, daemon=True)
        setter.start()
        setter.join(0.2)
        assert setter.is_alive(), "threading.Event.set no longer takes its condition lock: revisit checkpoints/oneshot.py"
    finally:
        event._cond.release()
    setter.join(5)
    flag = OneShot()
    setter = threading.Thread(target=flag.set)
    setter.start()
    setter.join(5)
    assert not setter.is_alive() and flag.is_set()


def test_the_log_pump_emits_in_order_from_its_own_thread_even_while_the_handler_is_held() -> None:
    logger = logging.getLogger("checkpoints.test_oneshot")
    handler = Recording()
    seen = handler.seen
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    pump = LogPump(logger, "pump-under-test")
    try:
        handler.acquire()  # a training thread inside a log call, interrupted
        try:
            started = time.monotonic()
            for i in range(3):
                pump.log(logging.INFO, "line %d", i)
            assert time.monotonic() - started < 1.0  # handing a line over never waits for the handler
        finally:
            handler.release()
        pump.close()
        assert seen == [(f"line {i}", "pump-under-test") for i in range(3)]
    finally:
        logger.removeHandler(handler)


def test_an_adopted_threads_store_lines_go_through_the_pump_while_the_handler_is_held() -> None:
    """The deadlock of a loaded run: the snapshot-io thread logged the store's prune line
    directly, on a handler whose lock the interrupted training thread held, and the writer
    (and the handler's flush) waited on that thread for ever."""
    import checkpoints.store  # noqa: F401 - its logger exists, as in a run

    store_log = logging.getLogger("checkpoints.store")
    handler = Recording()
    seen = handler.seen
    store_log.addHandler(handler)
    level = store_log.level
    store_log.setLevel(logging.INFO)
    pump = LogPump(logging.getLogger("checkpoints.writer"), "pump-under-test")
    logged = OneShot()

    def io_thread() -> None:
        pump.adopt()
        store_log.info("pruned snapshots %s", [1, 2])
        logged.set()

    try:
        handler.acquire()  # a training thread inside a log call, interrupted
        try:
            threading.Thread(target=io_thread, name="snapshot-io-under-test", daemon=True).start()
            assert logged.wait(5), "an adopted thread's store line waited on the handler's lock"
        finally:
            handler.release()
        store_log.info("from the training thread")  # threads that adopted nothing log as before
        pump.close()
        assert ("pruned snapshots [1, 2]", "pump-under-test") in seen
        assert ("from the training thread", threading.current_thread().name) in seen
    finally:
        store_log.removeHandler(handler)
        store_log.setLevel(level)
