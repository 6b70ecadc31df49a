"""Warm starts where a fork is unsafe: one pre-imported standby process per local rank.

The agent's warm starts fork each worker from the node's template (``agent/node/fork_server.py``).
Where the template finds a fork unsafe (the CUDA driver loaded at import, a thread running),
the fork server keeps this pool instead. A cold worker spends 2-5 s importing torch before
it can rejoin, which after a fault is most of a restart's cost (docs/BENCHMARKS.md). The
pool starts standbys (:mod:`agent.worker.warm_worker`) while training is healthy, and
:class:`agent.node.workers.LocalWorkers` asks it first each time it starts a worker, so the new
worker begins at the script's first line with torch already loaded. A standby is a ``Popen`` in its own session, like a cold
worker; log files, ``killpg`` on stop, exit codes and error files are the same.

A worker is started cold when its command is not the agent's own Python running a target
through :mod:`agent.worker.worker_boot` (``--no-python``, a NUMA wrapper), or when no standby is
alive. The agent refills the pool only once a new group is up and running, so standbys
never compete with a recovery for the CPU.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

from elastic import contract

from agent.worker.warm_worker import STANDBY_CODE
from agent.worker.worker_boot import parse_boot_command


class _Standby:
    """One standby process and the pipe on which it says its imports are done."""

    def __init__(self, env: dict[str, str]) -> None:
        ready_r, ready_w = os.pipe()
        os.set_blocking(ready_r, False)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", STANDBY_CODE], stdin=subprocess.PIPE,
                env={**env, contract.STANDBY_READY_FD_ENV: str(ready_w)}, pass_fds=(ready_w,), start_new_session=True)
        finally:
            os.close(ready_w)
        self._ready_fd: int | None = ready_r
        self.ready = False

    def poll_ready(self) -> bool:
        if self._ready_fd is not None:
            try:
                self.ready = os.read(self._ready_fd, 1) == b"r"
            except BlockingIOError:
                return False
            os.close(self._ready_fd)
            self._ready_fd = None
        return self.ready

    def release(self) -> None:
        if self._ready_fd is not None:
            os.close(self._ready_fd)
            self._ready_fd = None


class WarmPool:
    """Standby processes for one node; ``size`` of them when full (one per local rank)."""

    def __init__(self, size: int, env: dict[str, str] | None = None) -> None:
        self.size = size
        self.env = dict(os.environ if env is None else env)  # what a cold worker would start from
        self._standbys: list[_Standby] = []
        self._closed = False

    def fill(self) -> None:
        """Start standbys up to ``size`` (call when the CPU is not needed for a recovery)."""
        self._prune()
        while not self._closed and len(self._standbys) < self.size:
            self._standbys.append(_Standby(self.env))

    @property
    def full(self) -> bool:
        return len(self._standbys) >= self.size

    def ready_count(self) -> int:
        """Standbys alive with their imports done (exported as a gauge; benches wait on it)."""
        self._prune()
        return sum(s.poll_ready() for s in self._standbys)

    def _prune(self) -> None:
        for standby in [s for s in self._standbys if s.proc.poll() is not None]:
            standby.release()
            self._standbys.remove(standby)

    def take(self, command: tuple[str, ...], env: dict[str, str], stdout: str | None,
             stderr: str | None) -> subprocess.Popen[bytes] | None:
        """A standby now running ``command`` under ``env``, or None: start it cold."""
        spec = parse_boot_command(command)
        self._standbys.sort(key=lambda s: not s.poll_ready())  # a ready one first
        while spec is not None and self._standbys:
            standby = self._standbys.pop(0)
            standby.release()
            proc = standby.proc
            if proc.poll() is not None or proc.stdin is None:
                continue
            try:
                given = {**spec, "env": env, "stdout": stdout, "stderr": stderr, "given_at": time.time()}
                proc.stdin.write(json.dumps(given).encode() + b"\n")
                proc.stdin.close()
            except OSError:  # it died between poll() and write()
                continue
            return proc
        return None

    def close(self) -> None:
        """Standbys exit on the end of their stdin; the kill is for one stuck in an import."""
        self._closed = True
        for standby in self._standbys:
            standby.release()
            with contextlib.suppress(OSError):
                if standby.proc.stdin is not None:
                    standby.proc.stdin.close()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(standby.proc.pid, signal.SIGKILL)
            standby.proc.wait()
        self._standbys.clear()
