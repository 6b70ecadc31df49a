"""A snapshot writer process forked ahead, while the worker is still one thread.

The writer process (:mod:`checkpoints.procwriter`) is started by exec and imports torch: 1-3 s
of CPU at idle priority each time a rank starts writing, after every restart of rank 0 and
every in-place takeover of rank 0 by a survivor. A worker forked from its node's template
(:mod:`agent.worker.fork_template`) has torch imported already and runs one thread until the
script starts, so it can fork its writer for the cost of a fork: :func:`prefork` does that,
just before the script runs, and the child waits on a socketpair, doing nothing, until the
first :class:`~checkpoints.procwriter.WriterProcess` of this process takes it (:func:`take`)
and says go with the priority to run at. From then on it is the writer process, speaking the
same protocol as an exec'd one. A stub never taken sleeps until its worker ends
(``PR_SET_PDEATHSIG``, armed in the child, as the exec'd writer arms it); a second writer start
(the first one died) is an exec again.

Why the fork is safe: the forking process runs no second thread (checked), so no lock is held
across the fork; the child uses only what an exec'd writer uses (the socket, the arena it is
sent, the store), and it sets its priority before it starts any thread.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import threading

from . import sched
from .pids import OwnChild

_PR_SET_PDEATHSIG = 1
_stub: tuple[int, socket.socket] | None = None


def prefork() -> bool:
    """Fork the writer stub now; False (nothing forked) where this process runs other threads."""
    global _stub
    if _stub is not None or threading.active_count() > 1:
        return False
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        ours.close()
        _serve(theirs, parent)  # never returns
    theirs.close()
    _stub = (pid, ours)
    return True


def take() -> tuple[OwnChild, socket.socket] | None:
    """The stub and this side of its socket, once; None if there is none (or it died)."""
    global _stub
    stub, _stub = _stub, None
    if stub is None:
        return None
    process = OwnChild(stub[0], "snapshot writer")
    if process.poll() is not None:
        stub[1].close()
        return None
    return process, stub[1]


def go(sock: socket.socket, priority: sched.Priority) -> None:
    """Start the stub as the writer process at ``priority``."""
    sock.sendall(f"go {priority}\n".encode())


def _serve(sock: socket.socket, parent: int) -> None:
    """In the stub: wait for go, take the priority, become the writer process."""
    code = 0
    try:
        try:
            ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass
        if os.getppid() != parent:
            os._exit(0)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _title(f"elastic snapshot writer for process {parent}")  # not the worker's command: ps tells them apart
        line = b""
        while not line.endswith(b"\n"):  # byte by byte: nothing after the line is ours to read here
            byte = sock.recv(1)
            if not byte:
                os._exit(0)  # never taken: the worker is done with us
            line += byte
        priority = line.decode().split()[1]
        try:
            if priority == "idle":
                os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            else:
                os.setpriority(os.PRIO_PROCESS, 0, int(priority))
        except OSError:
            pass
        from .procchild import main

        main(sock.detach())
    except BaseException:  # noqa: BLE001 - the stub must never run on into the worker's code
        code = 1
    os._exit(code)


def _title(text: str) -> None:
    try:
        import setproctitle
    except ImportError:
        return
    setproctitle.setproctitle(text)
