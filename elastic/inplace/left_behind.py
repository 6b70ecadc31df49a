"""A worker that never leaves a world its round replaced: it exits for its agent to restart it.

When a newer round replaces this worker's world (a member lost or written off), the
membership watcher trips the fence (:mod:`.fence`): the main thread's next collective fails
at once and it joins the new round. If it never does (it waits on something no fence
covers: a socket or pipe of the script's own, a lock a dead thread held), its peers' join of
the new round waits for its handle, fails at the reconfigure timeout, and is tried again,
for ever: the job stands still while every agent looks healthy. The whole suite met it once
(HSDP over 3 nodes: a survivor's local rank 1 after rank 0's node was killed).

The rule, pure so it is a unit test away from being checked:

    left behind  <=>  waited > max(FLOOR_S, FACTOR x stall limit) since the trip
                      and the main thread spent < IDLE_SHARE of that on a CPU

* ``FLOOR_S`` = 20 s: a join of a round between live members takes milliseconds, and even a
  slow machine's step reaches its next collective well within it.
* ``FACTOR`` x the step's stall limit (:mod:`.stall`, 4 x the p90 step) = 10: a job of long
  steps gets a bound of its own size.
* A main thread still computing (an evaluation on rank 0, a large save) is not stuck: it
  reaches its next collective and fails there. So the bound only passes judgement on a main
  thread that sat idle, and one that computed is given another window.

Then the worker writes every thread's stack to its log (so the next reader knows what it
waited on), one line, and its error record, and exits :data:`~elastic.contract.LEFT_BEHIND_EXIT`.
Its agent restarts it (with its node's ranks where they hold one unit of state), healed
from a live replica or a peer's memory, as for a worker killed alone.
"""

from __future__ import annotations

import os
import threading

FLOOR_S = 20.0
FACTOR = 10.0
IDLE_SHARE = 0.1


def bound(stall_limit: float, floor: float = FLOOR_S, factor: float = FACTOR) -> float:
    """Seconds a replaced world's main thread may take to leave it."""
    return max(floor, factor * stall_limit)


def left_behind(waited: float, cpu_used: float | None, stall_limit: float, floor: float = FLOOR_S) -> bool:
    """Whether a main thread that has not left its replaced world for ``waited`` seconds, and
    used ``cpu_used`` CPU seconds meanwhile (None: not known, counted as idle), is stuck."""
    if waited <= bound(stall_limit, floor):
        return False
    return cpu_used is None or cpu_used < IDLE_SHARE * waited


def main_thread_cpu() -> float | None:
    """CPU seconds the process's main thread has used (``/proc``); None where it cannot be read."""
    tid = threading.main_thread().native_id
    try:
        with open(f"/proc/self/task/{tid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    except (OSError, ValueError, IndexError):
        return None


class LeftBehindWatch:
    """Clocks one trip: :meth:`tripped` when the fence is tripped for a replacing round,
    :meth:`check` at the watcher's polls while the main thread has not left (cheap: it reads
    ``/proc`` only once a window has passed)."""

    def __init__(self, floor: float = FLOOR_S) -> None:
        self.floor = floor
        self._since: float | None = None
        self._cpu_at_start: float | None = None

    def tripped(self, now: float) -> None:
        if self._since is None:
            self._since, self._cpu_at_start = now, main_thread_cpu()

    def left(self) -> None:
        """The main thread joined a round: the clock stops."""
        self._since = None

    def check(self, now: float, stall_limit: float) -> float | None:
        """Seconds waited if the main thread is left behind now, else None. A window in which it
        computed starts another."""
        since = self._since
        if since is None or now - since <= bound(stall_limit, self.floor):
            return None
        cpu_now = main_thread_cpu()
        used = None if cpu_now is None or self._cpu_at_start is None else cpu_now - self._cpu_at_start
        if left_behind(now - since, used, stall_limit, self.floor):
            return now - since
        self._since, self._cpu_at_start = now, cpu_now  # it computes: give it another window
        return None
