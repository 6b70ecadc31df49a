"""``agent.node.signal_flag``: raised from a real signal handler while the main thread waits on it."""

from __future__ import annotations

import os
import signal
import threading
import time

from agent.node.signal_flag import SignalFlag


def test_a_wait_times_out_without_the_flag_and_ends_at_once_with_it() -> None:
    flag = SignalFlag()
    t0 = time.monotonic()
    assert flag.wait(0.12) is False and time.monotonic() - t0 >= 0.12
    flag.set()
    assert flag.is_set() and flag.wait(5) is True


def test_signals_raised_while_the_main_thread_waits_never_hang_it() -> None:
    """The deadlock an Event had (its set() in the handler, its lock held by the waiting main
    thread) needs a signal in a narrow window; many signals at every point of the wait loop
    would find it. Each round must end with the flag seen, promptly."""
    previous = signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    try:
        for delay in [i * 0.0007 for i in range(60)]:
            flag = SignalFlag()
            signal.signal(signal.SIGUSR1, flag.set)
            timer = threading.Timer(delay, os.kill, (os.getpid(), signal.SIGUSR1))
            timer.start()
            t0 = time.monotonic()
            assert flag.wait(5) is True
            assert time.monotonic() - t0 < 1.0
            timer.join()
    finally:
        signal.signal(signal.SIGUSR1, previous)
