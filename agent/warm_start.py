"""Warm starts: the agent keeps one pre-imported standby process per local rank.

After a node loss every survivor restarts its workers, and a cold worker spends 2-5 s
importing torch before it can rejoin: most of the recovery time (docs/BENCHMARKS.md).
The pool starts standbys (:mod:`agent.warm_worker`) while training is healthy and hands
one to torchrun each time it starts a worker, so the new worker begins at the script's
first line with torch already loaded.

torch offers no hook for *how* a worker process is created, so :func:`warm_handlers`
swaps the handler factory that ``SubprocessContext`` calls, for the duration of one
``_start_workers`` call made by the agent's single thread. Everything else (the
environment torchrun builds, log files, ``killpg`` on stop, exit codes, error files) is
torchrun's own; a standby is a ``Popen`` in its own session, like a cold worker.

A worker is started cold when the entrypoint is not this Python (``--no-python``, a
NUMA wrapper), when its interpreter flags are anything but ``-u``, or when no standby is
alive. Replacements start only after the new group finished a step, so they never compete
with a recovery for the CPU.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
from typing import Any, Callable, Iterator

import torch.distributed.elastic.multiprocessing.api as mp_api
from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler

from .warm_worker import READY_FD_ENV

log = logging.getLogger("elastic.agent")


def parse_python_command(args: tuple[str, ...]) -> dict[str, Any] | None:
    """``(python, -u, [-m], target, *rest)`` as torchrun builds it -> a standby spec, or None.

    None means "start it cold": anything a standby cannot reproduce exactly.
    """
    if not args or os.path.realpath(args[0]) != os.path.realpath(sys.executable):
        return None
    flags, rest = [], list(args[1:])
    while rest and rest[0].startswith("-") and rest[0] != "-m":
        flags.append(rest.pop(0))
    if any(flag != "-u" for flag in flags) or not rest:
        return None
    spec: dict[str, Any] = {"unbuffered": "-u" in flags}
    if rest[0] == "-m":
        if len(rest) < 2:
            return None
        spec.update(module=rest[1], args=rest[2:])
    else:
        spec.update(script=rest[0], args=rest[1:])
    return spec


class _Standby:
    """One standby process and the pipe on which it says its imports are done."""

    def __init__(self) -> None:
        ready_r, ready_w = os.pipe()
        os.set_blocking(ready_r, False)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "agent.warm_worker"], stdin=subprocess.PIPE,
                env={**os.environ, READY_FD_ENV: str(ready_w)}, pass_fds=(ready_w,), start_new_session=True)
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

    def __init__(self, size: int, on_start: Callable[[str], None] = lambda mode: None) -> None:
        self.size, self.on_start = size, on_start
        self._standbys: list[_Standby] = []
        self._closed = False

    def fill(self) -> None:
        """Start standbys up to ``size`` (call when the CPU is not needed for a recovery)."""
        self._prune()
        while not self._closed and len(self._standbys) < self.size:
            self._standbys.append(_Standby())

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
        spec = parse_python_command(command)
        self._standbys.sort(key=lambda s: not s.poll_ready())  # a ready one first
        while spec is not None and self._standbys:
            standby = self._standbys.pop(0)
            standby.release()
            proc = standby.proc
            if proc.poll() is not None or proc.stdin is None:
                continue
            try:
                proc.stdin.write(json.dumps({**spec, "env": env, "stdout": stdout, "stderr": stderr}).encode()
                                 + b"\n")
                proc.stdin.close()
            except OSError:  # it died between poll() and write()
                continue
            self.on_start("warm")
            return proc
        self.on_start("cold")
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


class _WarmHandler(SubprocessHandler):
    """torch's handler, except that ``_popen`` asks the pool first."""

    pool: WarmPool

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._log_paths = (kwargs.get("stdout"), kwargs.get("stderr"))
        super().__init__(*args, **kwargs)

    def _popen(self, args: tuple, env: dict[str, str]) -> subprocess.Popen:
        proc = self.pool.take(tuple(str(a) for a in args), env, *self._log_paths)
        return proc if proc is not None else super()._popen(args, env)


@contextlib.contextmanager
def warm_handlers(pool: WarmPool) -> Iterator[None]:
    """Within the block, workers torchrun starts come from ``pool`` where they can."""
    original = getattr(mp_api, "get_subprocess_handler", None)
    if original is None:  # a torch that starts workers differently: cold starts, said once
        if not getattr(warm_handlers, "warned", False):
            log.warning("this torch has no SubprocessContext handler factory; workers start cold")
            warm_handlers.warned = True  # type: ignore[attr-defined]
        yield
        return
    handler = type("WarmHandler", (_WarmHandler,), {"pool": pool})
    mp_api.get_subprocess_handler = handler  # type: ignore[assignment]
    try:
        yield
    finally:
        mp_api.get_subprocess_handler = original
