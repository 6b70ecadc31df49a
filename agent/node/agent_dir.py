"""The agent's run-time directory, and the rule that the agent deletes only what it created.

At each start the agent clears its run-time folders (a previous agent's heartbeats, in-place
channel and goodput marks would mislead this one). ``--agent-dir`` may name a directory a
person cares about (a typo, a home or shared folder), so the agent first makes sure the
directory is its own: one it created, or one that was empty, marked with :data:`MARKER`.
A non-empty directory without the marker is refused. Without ``--agent-dir`` the agent
makes a temporary directory, and :meth:`AgentDir.release` removes it when the agent exits.

Two agents must never share one: the second would clear the first's run-time folders under
its live workers (a careless second start on the same node crashed the live agent). The
agent holds a POSIX lock on :data:`LOCK` for its life; the kernel drops it when the agent
dies, however it dies, and forked workers do not inherit it (``lockf`` locks are per process).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

MARKER = ".elastic-agent-dir"
LOCK = ".elastic-agent.lock"  # locked by the live agent using the directory; holds its pid
RUNTIME = ("heartbeat", "control", "goodput")  # cleared at start (metrics/ loses its *.db files)
LOGS = "logs"  # the workers' torch log files (--log-dir) when none is given: they go with the directory
_MARKER_TEXT = ("Made by elastic agent, which clears heartbeat/, control/, goodput/ and metrics/*.db "
                "here at each start. It uses a directory only when it is new, empty or holds this file.\n")


class AgentDirError(ValueError):
    """An ``--agent-dir`` the agent must not use; the message says why and what to pass."""


@dataclass(frozen=True)
class AgentDir:
    path: Path
    temporary: bool  # made for this run only, so removed when the agent exits
    lock_fd: int | None = None  # open while the agent lives: its lock on LOCK

    def release(self) -> None:
        """Remove the directory if the agent made it for this run; a given one stays."""
        if self.temporary:
            shutil.rmtree(self.path, ignore_errors=True)
        if self.lock_fd is not None:
            os.close(self.lock_fd)  # the lock goes with it (it would at exit anyway)


def claim_agent_dir(value: str | os.PathLike[str] | None) -> AgentDir:
    """The directory to run in: a fresh temporary one when ``value`` is empty, else
    ``value`` once it is known to be the agent's (created, empty, or marked), with the
    previous agent's run-time folders cleared. Raises :class:`AgentDirError`."""
    if not value:
        path = Path(tempfile.mkdtemp(prefix=f"elastic-agent-{os.getpid()}-"))
        _mark(path)
        return AgentDir(path, temporary=True)
    path = Path(value)
    if path.exists() and not path.is_dir():
        raise AgentDirError(f"{path} is not a directory; pass a new or empty directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
        if not (path / MARKER).is_file():
            if any(path.iterdir()):
                raise AgentDirError(
                    f"{path} holds files the agent did not create (it has no {MARKER}), and the agent "
                    "clears its run-time folders there; pass a new or empty directory")
            _mark(path)
        lock_fd = _lock(path)
        for stale in RUNTIME:
            shutil.rmtree(path / stale, ignore_errors=True)  # a previous agent's: the marker says so
    except OSError as exc:
        raise AgentDirError(f"{path}: cannot use it ({exc.strerror}); pass a writable directory") from None
    return AgentDir(path, temporary=False, lock_fd=lock_fd)


def _lock(path: Path) -> int:
    """Lock ``path``'s :data:`LOCK` for this process, or say which live agent holds it."""
    fd = os.open(path / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise AgentDirError(f"{path} is in use by a live agent (pid {holder}); give each agent on a "
                            "machine its own directory") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _mark(path: Path) -> None:
    (path / MARKER).write_text(_MARKER_TEXT)


SHM = Path("/dev/shm")
MEMORY_PREFIX = "elastic-copies-"  # + the agent's pid + a random tail


def claim_memory_dir(work: Path, shm: Path = SHM) -> Path | None:
    """A directory of this agent's for its workers' own copies (``elastic.inplace.memory_copies``),
    in shared memory where the node has it (``/dev/shm``), else under the agent's directory:
    either way it outlives the workers and goes with the agent (:func:`release_memory_dir`).
    An agent killed outright cannot remove its own; the next agent on the node removes those
    whose agent is gone (their names hold its pid). None: none could be made (no copies kept)."""
    base = shm if shm.is_dir() and os.access(shm, os.W_OK | os.X_OK) else work
    _sweep_orphans(base)
    try:
        return Path(tempfile.mkdtemp(prefix=f"{MEMORY_PREFIX}{os.getpid()}-", dir=base))
    except OSError:
        return None


def release_memory_dir(path: Path | None) -> None:
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)


def _sweep_orphans(base: Path) -> None:
    """Remove memory-copy directories left by agents that are no longer alive (shared memory is RAM)."""
    try:
        names = os.listdir(base)
    except OSError:
        return
    for name in names:
        pid = name[len(MEMORY_PREFIX):].split("-", 1)[0] if name.startswith(MEMORY_PREFIX) else ""
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(base / name, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's: alive, and not ours to remove
    return True
