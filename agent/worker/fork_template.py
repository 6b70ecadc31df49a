"""The template: one pre-imported process per node that forks every warm worker.

Started by :class:`agent.node.fork_server.ForkServer` (``TEMPLATE_CODE``). It imports what every
worker imports (torch, ``torch._dynamo``, the trainer: 3-5 s of CPU) once, then serves the
agent: for each request line on stdin it forks a child that *becomes* the worker exactly as
a warm standby does (:func:`agent.worker.warm_worker.become`: torchrun's environment, log files,
the target run through :mod:`agent.worker.worker_boot`), in a session of its own. A standby is
used up by one start; the template serves every start of every local rank of this node, so
a restart after a fault, or the tenth, costs a fork (milliseconds) instead of an import,
and a node with eight ranks keeps one pre-imported process, not eight.

Replies go to the agent on a pipe of their own (``TEMPLATE_REPLY_FD_ENV``), one line each:
``ready``, or ``unsafe REASON`` (then the template exits and the agent keeps standbys
instead); ``started ID PID``; ``exited PID CODE`` (``Popen.returncode``'s meaning: minus
the signal for a worker killed by one). The template reaps its children, so the agent,
which cannot wait for a grandchild, learns every exit code from it.

Why a fork is safe here: nothing but the main thread runs Python (checked before
``ready``), the CUDA driver is not loaded (checked: a child could not use CUDA after a
fork of a process that initialised it), and what differs per worker (ranks, the master's
address, ``TORCHELASTIC_*``) is read only when a process group or CUDA starts, as for a
standby. ``random`` reseeds itself in a forked child; NumPy's global generator is reseeded
here, as a fresh process would seed it. Each child arms ``PR_SET_PDEATHSIG`` against the
template, and the template against the agent, so a node's workers still die with it.

``multiprocessing``'s forkserver was the obvious piece, and does not fit: its children
run a pickled function rather than ``__main__``, exit through ``os._exit`` without the
interpreter's shutdown (the snapshot writer flushes at ``atexit``), and leave
``multiprocessing.parent_process()`` set in a user's script.
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import threading
import traceback
from typing import Any

from elastic import contract

from agent.worker import warm_worker

from agent.worker import worker_boot
TEMPLATE_CODE = "import sys; sys.path.pop(0); from agent.worker.fork_template import main; main()"


def fork_unsafe_reason() -> str:
    """Why forking workers from this process would be unsafe, or ''."""
    if threading.active_count() > 1:
        return "a Python thread besides the main one runs in the template"
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            if any("libcuda.so" in line for line in maps):
                return "the CUDA driver is loaded in the template (a forked worker could not use CUDA)"
    except OSError:
        return "cannot read /proc/self/maps to check for the CUDA driver"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA is initialised in the template"
    return ""


def main() -> None:
    """The template started by exec: its environment is the node's already."""
    warm_worker.title_ready()
    worker_boot.die_with_agent()
    _preload_and_serve(int(os.environ.pop(contract.TEMPLATE_REPLY_FD_ENV)))


def serve_forked(requests_fd: int, reply_fd: int, agent_pid: int) -> None:
    """The template forked from the agent at its start (:func:`agent.node.fork_server.fork_early`),
    sharing the agent's torch import. Its first request line is the node's environment, which
    the agent knows only later; the rest of its imports wait for it (prometheus_client reads
    ``PROMETHEUS_MULTIPROC_DIR`` at import). Never returns into the agent's code: the template
    leaves through ``os._exit``, and only a forked worker unwinds, to the interpreter's exit."""
    template_pid = os.getpid()
    try:
        warm_worker.title_ready()
        os.setsid()
        worker_boot.die_with_agent(agent_pid)
        os.dup2(requests_fd, 0)
        os.close(requests_fd)
        first, rest = b"", b""
        while b"\n" not in first:
            data = os.read(0, 1 << 16)
            if not data:
                os._exit(0)  # the agent went away, or turned warm starts off
            first += data
        first, rest = first.split(b"\n", 1)
        os.environ.clear()
        os.environ.update(json.loads(first)["env"])
        sys.argv = ["-c"]
        _preload_and_serve(reply_fd, rest)
    except SystemExit:
        if os.getpid() != template_pid:
            raise  # a worker's own end: the interpreter's shutdown, as for any worker
        os._exit(contract.EXIT_FAILED)
    except BaseException:  # noqa: BLE001 - the template must never run on in the agent's code
        traceback.print_exc()
        os._exit(contract.EXIT_FAILED)
    os._exit(0)  # it said "unsafe"


def _preload_and_serve(reply_fd: int, pending: bytes = b"") -> None:
    warm_worker.preload_configured()
    unsafe = fork_unsafe_reason()
    if unsafe:
        _say(reply_fd, f"unsafe {unsafe}")
        return
    Template(reply_fd, pending).serve()


class Template:
    """The serving loop: requests in on stdin, children out, their exits back."""

    def __init__(self, reply_fd: int, pending: bytes = b"") -> None:
        self.reply_fd = reply_fd
        self.pid = os.getpid()  # the children's parent, taken before any fork: not getppid() after
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        signal.signal(signal.SIGCHLD, lambda signum, frame: None)  # only to wake select below
        signal.set_wakeup_fd(self.wake_w)
        self.pending = pending

    def serve(self) -> None:
        """Until the agent closes stdin. A forked child never returns here: it runs the
        worker to its end and leaves through the interpreter's shutdown or ``os._exit``."""
        _say(self.reply_fd, "ready")
        self._fork_requested()
        while True:
            readable, _, _ = select.select([0, self.wake_r], [], [])
            if self.wake_r in readable:
                _drain(self.wake_r)
            self._reap()
            if 0 in readable:
                data = os.read(0, 1 << 16)
                if not data:  # the agent is done with us; a child still running dies with us
                    os._exit(0)  # nothing to flush, and torch's teardown would hold the agent's exit ~1 s
                self.pending += data
                self._fork_requested()

    def _fork_requested(self) -> None:
        while b"\n" in self.pending:
            line, self.pending = self.pending.split(b"\n", 1)
            self._fork(json.loads(line))

    def _fork(self, request: dict[str, Any]) -> None:
        pid = os.fork()
        if pid == 0:
            self._become(request["spec"])  # raises SystemExit or calls os._exit
            sys.exit(0)
        _say(self.reply_fd, f"started {request['id']} {pid}")

    def _become(self, spec: dict[str, Any]) -> None:
        """In the child: shed the template's fds and handlers, then become the worker."""
        try:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for fd in (self.reply_fd, self.wake_r, self.wake_w):
                os.close(fd)
            os.setsid()  # a session of its own, as a cold worker's Popen(start_new_session=True)
            numpy = sys.modules.get("numpy")
            if numpy is not None:
                numpy.random.seed()  # fresh entropy, as a new process's first use would take
            warm_worker.become(spec, parent_pid=self.pid)
        except SystemExit:
            raise
        except BaseException:  # noqa: BLE001 - the worker's own code reports its errors itself
            traceback.print_exc()
            os._exit(contract.EXIT_FAILED)

    def _reap(self) -> None:
        reap_children(self.reply_fd)


def reap_children(reply_fd: int) -> None:
    """Reap every child that has ended, saying ``exited PID CODE`` for each on ``reply_fd``
    (the template's and the local nodes' zygote's protocol)."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _say(reply_fd, f"exited {pid} {os.waitstatus_to_exitcode(status)}")


def _say(fd: int, line: str) -> None:
    os.write(fd, line.encode() + b"\n")


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass
