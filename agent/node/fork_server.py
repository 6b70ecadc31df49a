"""Warm starts by fork: the agent's side of the node's template (:mod:`agent.worker.fork_template`).

One template per node imports torch once; every warm worker start after that is a fork of
it, milliseconds instead of the 3-5 s of CPU an import costs, however many ranks or
restarts. It keeps :class:`agent.node.warm_start.WarmPool`'s interface (``fill``, ``full``,
``ready_count``, ``take``, ``close``), so the agent and :class:`agent.node.workers.LocalWorkers`
use either the same way; where the template finds a fork unsafe (the CUDA driver loaded at
import, a thread running), it says why and this server hands every call to a pool of
standbys instead, one per local rank, which need no fork.

The template is normally the agent's own fork, made first thing at its start
(:func:`fork_early`), so agent and template share one torch import; a replacement, or one
the agent could not fork safely, is started by exec.

A forked worker is the template's child, not the agent's, so the agent cannot wait for it:
:class:`ForkedProcess` gives what the agent needs of a ``Popen`` (``pid``, ``poll``,
``wait``), its exit code read from the template's reply pipe. Signals go to the pid (or its
session) directly, as to any worker.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from typing import BinaryIO

from checkpoints.layout import pid_alive
from checkpoints.pids import OwnChild
from elastic import contract

from agent.worker.fork_template import TEMPLATE_CODE, fork_unsafe_reason, serve_forked
from agent.node.warm_start import WarmPool
from agent.worker.worker_boot import parse_boot_command

log = logging.getLogger("elastic.agent")

FORK_REPLY_TIMEOUT_S = 10.0  # a fork takes milliseconds; a template this slow is treated as gone


class _ForkedTemplate(OwnChild):
    """A template forked from the agent itself: the part of ``Popen`` the server uses."""

    def __init__(self, pid: int, requests_fd: int, replies_fd: int) -> None:
        super().__init__(pid, "template")
        self.replies_fd = replies_fd
        self.stdin: BinaryIO | None = os.fdopen(requests_fd, "wb")


def _wait(process: _ForkedTemplate | ForkedProcess, args: list[str], timeout: float | None) -> int:
    """``Popen.wait`` for a process this agent learns the end of by polling, not by waiting."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while (code := process.poll()) is None:
        if deadline is not None and time.monotonic() >= deadline:
            raise subprocess.TimeoutExpired(args, timeout or 0.0)
        time.sleep(0.01)
    return code


_forked_early: _ForkedTemplate | None = None
# Modules that fix their mode from the environment at import: imported here, before the node's
# env exists, a forked template would keep the agent's mode (prometheus_client's single-process
# values would hide every worker metric from /metrics). Where one is, the template is exec'd.
_READ_ENV_AT_IMPORT = ("prometheus_client",)


def fork_early() -> None:
    """Fork this node's template from the agent now, at its start, so that both share one
    torch import (about 2 s of CPU per node, the most of a template's cost).

    Called by ``elastic agent`` before anything starts a thread or reads the node's settings;
    :class:`ForkServer` takes the template over. Nothing is forked where a fork would be
    unsafe here (then the server starts its template by exec, as it does whenever one is
    gone), and a template never used exits when the agent does (its requests pipe closes).
    """
    global _forked_early
    import torch  # noqa: F401 - the import the template shares

    if _forked_early is not None or fork_unsafe_reason() or any(m in sys.modules for m in _READ_ENV_AT_IMPORT):
        return
    requests_r, requests_w = os.pipe()
    replies_r, replies_w = os.pipe()
    agent_pid = os.getpid()
    pid = os.fork()
    if pid == 0:
        os.close(requests_w)
        os.close(replies_r)
        serve_forked(requests_r, replies_w, agent_pid)  # never returns into the agent's code
    os.close(requests_r)
    os.close(replies_w)
    os.set_blocking(replies_r, False)
    _forked_early = _ForkedTemplate(pid, requests_w, replies_r)


def _take_forked_early() -> _ForkedTemplate | None:
    global _forked_early
    template, _forked_early = _forked_early, None
    return template


def discard_early() -> None:
    """With warm starts off: end the template forked at the start (it is waiting for its env)."""
    template = _take_forked_early()
    if template is not None:
        _end(template)


def _end(template: subprocess.Popen[bytes] | _ForkedTemplate) -> None:
    """Close its requests (it exits at their end); kill one stuck in an import; reap it."""
    with contextlib.suppress(OSError):
        if template.stdin is not None:
            template.stdin.close()
    try:
        template.wait(timeout=5)
    except subprocess.TimeoutExpired:
        _kill(template.pid)
        template.wait()


def _kill(pid: int) -> None:
    """SIGKILL a template: its session (it is the leader), or itself if it has none yet."""
    for kill in (os.killpg, os.kill):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            kill(pid, signal.SIGKILL)


class ForkedProcess:
    """A worker the template forked: the part of ``subprocess.Popen`` the agent uses."""

    def __init__(self, server: ForkServer, pid: int, args: tuple[str, ...]) -> None:
        self._server, self.pid, self.args = server, pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        return _wait(self, list(self.args), timeout)


class ForkServer:
    """The node's template, started at ``fill`` and used for every warm start after."""

    def __init__(self, size: int, env: dict[str, str] | None = None) -> None:
        self.size = size
        self.env = dict(os.environ if env is None else env)  # what a cold worker would start from
        self._lock = threading.Lock()  # the reply pipe is read from the agent's loop and its metrics
        self._proc: subprocess.Popen[bytes] | _ForkedTemplate | None = None
        self._reply_fd: int | None = None
        self._pending = b""
        self._ready = False
        self._template_gone = False  # its reply pipe closed: unreported children died with it
        self._started: dict[int, int] = {}  # request id -> pid
        self._exits: dict[int, int] = {}  # pid -> Popen-style exit code
        self._children: set[int] = set()  # forked by the running template, not yet reported
        self._orphans: set[int] = set()  # forked by a template that is gone: they died with it
        self._next_id = 0
        self._fallback: WarmPool | None = None
        self._closed = False

    # ------------------------------------------------------------------ WarmPool's interface

    def fill(self) -> None:
        """Start the template if none runs (it imports while the caller goes on)."""
        if self._closed:
            return
        with self._lock:
            self._pump()
            if self._fallback is not None:
                self._fallback.fill()
            elif self._proc is None or self._template_gone:
                forked = _take_forked_early() if self._proc is None else None
                if forked is not None:
                    self._adopt(forked)
                else:
                    self._spawn()

    @property
    def template_pid(self) -> int | None:
        """The running template's pid (every forked worker's parent), or None."""
        return self._proc.pid if self._proc is not None and not self._template_gone else None

    @property
    def full(self) -> bool:
        if self._fallback is not None:
            return self._fallback.full
        return self.template_pid is not None

    def ready_count(self) -> int:
        """Local ranks that can start warm now: all of them once the template is ready."""
        with self._lock:
            self._pump()
            if self._fallback is not None:
                return self._fallback.ready_count()
            return self.size if self._ready and not self._template_gone else 0

    def take(self, command: tuple[str, ...], env: dict[str, str], stdout: str | None,
             stderr: str | None) -> ForkedProcess | subprocess.Popen[bytes] | None:
        """A worker forked from the template running ``command`` under ``env``, or None:
        start it cold (not the agent's own Python, or no template ready)."""
        with self._lock:
            self._pump()
            if self._fallback is not None:
                return self._fallback.take(command, env, stdout, stderr)
            spec = parse_boot_command(command)
            if spec is None or not self._ready or self._template_gone or self._proc is None:
                return None
            request_id, self._next_id = self._next_id, self._next_id + 1
            given = {**spec, "env": env, "stdout": stdout, "stderr": stderr, "given_at": time.time()}
            try:
                assert self._proc.stdin is not None
                self._proc.stdin.write(json.dumps({"id": request_id, "spec": given}).encode() + b"\n")
                self._proc.stdin.flush()
            except OSError:
                self._lost("its request pipe broke")
                return None
            deadline = time.monotonic() + FORK_REPLY_TIMEOUT_S
            while request_id not in self._started:
                if self._template_gone or time.monotonic() >= deadline:
                    self._lost("it did not answer a fork request")
                    return None
                self._pump(wait=0.05)
            pid = self._started.pop(request_id)
            self._children.add(pid)
            return ForkedProcess(self, pid, command)

    def close(self) -> None:
        """The template exits at the end of its stdin; the kill is for one stuck in an import."""
        self._closed = True
        with self._lock:
            if self._fallback is not None:
                self._fallback.close()
            if self._proc is not None:
                _end(self._proc)
            self._pump()  # its last replies: the exits it reaped before leaving
            self._gone()
            if self._reply_fd is not None:
                os.close(self._reply_fd)
                self._reply_fd = None

    # ------------------------------------------------------------------ exits

    def exit_code(self, pid: int) -> int | None:
        """``pid``'s exit code as ``Popen.returncode`` gives it, or None while it runs."""
        with self._lock:
            self._pump()
            if pid in self._orphans and not pid_alive(pid):
                self._orphans.discard(pid)
                self._exits[pid] = -signal.SIGKILL  # PR_SET_PDEATHSIG: killed with its template
            return self._exits.get(pid)

    # ------------------------------------------------------------------ the template

    def _spawn(self) -> None:
        if self._proc is not None:  # the template that went away: reap it
            _kill(self._proc.pid)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=5)
        reply_r, reply_w = os.pipe()
        os.set_blocking(reply_r, False)
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", TEMPLATE_CODE], stdin=subprocess.PIPE,
                env={**self.env, contract.TEMPLATE_REPLY_FD_ENV: str(reply_w)}, pass_fds=(reply_w,), start_new_session=True)
        finally:
            os.close(reply_w)
        if self._reply_fd is not None:
            os.close(self._reply_fd)
        self._reply_fd, self._pending = reply_r, b""
        self._ready = self._template_gone = False

    def _adopt(self, template: _ForkedTemplate) -> None:
        """Take over the template forked at the agent's start: its first line is the env."""
        self._proc, self._reply_fd, self._pending = template, template.replies_fd, b""
        self._ready = self._template_gone = False
        try:
            assert template.stdin is not None
            template.stdin.write(json.dumps({"env": self.env}).encode() + b"\n")
            template.stdin.flush()
        except OSError:
            self._lost("its request pipe broke")

    def _pump(self, wait: float = 0.0) -> None:
        """Read what the template said (waiting up to ``wait`` for a first line)."""
        if self._reply_fd is None or self._template_gone:
            return
        if wait:
            select.select([self._reply_fd], [], [], wait)
        while True:
            try:
                data = os.read(self._reply_fd, 1 << 16)
            except BlockingIOError:
                break
            if not data:
                self._gone()
                break
            self._pending += data
        while b"\n" in self._pending:
            line, self._pending = self._pending.split(b"\n", 1)
            self._heard(line.decode(errors="replace"))

    def _heard(self, line: str) -> None:
        word, _, rest = line.partition(" ")
        if word == "ready":
            self._ready = True
        elif word == "started":
            request_id, pid = rest.split()
            self._started[int(request_id)] = int(pid)
            self._exits.pop(int(pid), None)  # an earlier child's, whose pid the kernel gave out again
        elif word == "exited":
            pid, code = rest.split()
            self._exits[int(pid)] = int(code)
            self._children.discard(int(pid))
        elif word == "unsafe":
            log.warning("warm starts by fork are off on this node: %s; keeping standby workers instead", rest)
            self._fallback = WarmPool(self.size, self.env)
            self._fallback.fill()

    def _lost(self, why: str) -> None:
        log.warning("the worker template (pid %s) is gone: %s; starting cold until it is back",
                    self._proc.pid if self._proc else "?", why)
        if self._proc is not None:
            _kill(self._proc.pid)
        self._gone()

    def _gone(self) -> None:
        self._template_gone, self._ready = True, False
        self._orphans |= self._children
        self._children.clear()

