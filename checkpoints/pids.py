"""Is a process alive: the one answer every part of the project uses.

Here, not in ``elastic`` or ``agent``, because ``checkpoints`` imports neither: the snapshot
store (temp dirs named by their writer's pid), the agent (its process trees, network
namespaces, fork server) and the tests can all import it without a cycle.
"""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """True while ``pid`` is a process that can still run. A zombie (killed, not reaped yet)
    answers ``kill(pid, 0)`` but will never do anything again, so it counts as dead; a process
    owned by another user (EPERM) counts as alive."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except FileNotFoundError:
        return False  # exited (and was reaped) between the two looks
    except (OSError, IndexError):
        return True  # no /proc to ask: kill(0) said it exists
