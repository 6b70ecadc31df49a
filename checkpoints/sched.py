"""CPU priority of the snapshot writer process: idle while it can be, normal when it is late.

Linux only, best effort. ``SCHED_IDLE`` runs a thread only on CPU time nothing else in
its group wants, and a waking trainer thread preempts it at once, so a write at idle
priority costs training almost nothing. Leaving ``SCHED_IDLE`` again (the boost, when a
write is late) needs root, ``CAP_SYS_NICE`` or a permissive ``RLIMIT_NICE``; without it
the write stays idle and the overlap policy counts what that costs.

Scheduling policy and niceness are per thread on Linux, so every call walks
``/proc/<pid>/task``; threads started later inherit the policy of their creator.
"""

from __future__ import annotations

import os
from typing import Literal

Priority = Literal["idle"] | int  # "idle": SCHED_IDLE; an int: SCHED_OTHER at that nice value


def check_priority(priority: Priority) -> Priority:
    if priority == "idle" or (isinstance(priority, int) and not isinstance(priority, bool) and -20 <= priority <= 19):
        return priority
    raise ValueError(f"priority must be 'idle' or a nice value in [-20, 19], got {priority!r}")


def _tids(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return [pid]


def set_priority(pid: int, priority: Priority) -> bool:
    """Apply ``priority`` to every thread of ``pid`` (0: this process); False if refused."""
    pid = pid or os.getpid()
    ok = True
    for tid in _tids(pid):
        try:
            if priority == "idle":
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            else:
                if os.sched_getscheduler(tid) != os.SCHED_OTHER:
                    os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
                os.setpriority(os.PRIO_PROCESS, tid, int(priority))
        except ProcessLookupError:
            continue  # the thread ended meanwhile
        except (AttributeError, OSError):
            ok = False
    return ok
