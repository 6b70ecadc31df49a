"""Is a process alive: the one answer every part of the project uses.

Here, not in ``elastic`` or ``agent``, because ``checkpoints`` imports neither: the snapshot
store (temp dirs named by their writer's pid), the agent (its process trees, network
namespaces, fork server) and the tests can all import it without a cycle.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time


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


class OwnChild:
    """The part of ``Popen`` the owner of a child it forked itself needs (``pid``, ``poll``,
    ``wait``, ``kill``), its end learnt by ``waitpid``: the agent's forked template, a worker's
    snapshot writer forked ahead (checkpoints/procstub.py)."""

    def __init__(self, pid: int, name: str) -> None:
        self.pid = pid
        self.args = [name]
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                self.returncode = -signal.SIGKILL  # reaped elsewhere: gone all the same
            else:
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(0.01)
        return code

    def kill(self) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
