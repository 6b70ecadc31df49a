"""``pid_alive``: the one answer the store, the agent and the tests share (checkpoints/pids.py)."""

from __future__ import annotations

import os
import time
from typing import Callable

import pytest

from checkpoints.pids import pid_alive


def test_this_process_is_alive_and_no_process_is_not() -> None:
    assert pid_alive(os.getpid())
    assert not pid_alive(0) and not pid_alive(-1)
    with open("/proc/sys/kernel/pid_max") as f:
        assert not pid_alive(int(f.read()) + 1)  # above any pid the kernel hands out


@pytest.mark.slow
def test_a_zombie_counts_as_dead_until_and_after_it_is_reaped() -> None:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    try:
        assert _wait(lambda: not pid_alive(pid)), "an exited, unreaped child still counts as alive"
    finally:
        os.waitpid(pid, 0)
    assert not pid_alive(pid)


def _wait(cond: Callable[[], bool], deadline: float = 10.0) -> bool:
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return False
