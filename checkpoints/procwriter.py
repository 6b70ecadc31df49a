"""The trainer's handle on its snapshot writer process.

Why a process: serialising, hashing and writing a snapshot on a thread of the trainer
holds the trainer's GIL for the pickler and torch.save's record writes (measured: ~0.1 s
of GIL per 100 MB), and a thread cannot be given SCHED_IDLE without a priority inversion
whenever it holds the GIL. A separate process has its own GIL and can run at idle
priority: it then uses only CPU time the trainer leaves free.

Why it must not fall behind: at idle priority on a machine the trainer saturates, a write
could take forever. So each job carries a deadline (half the interval between snapshots,
set by the caller) and anyone waiting for it (``flush``, a due snapshot, exit) can
``urge`` it; either raises the writer to normal priority until that job is durable.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from . import errors, fence, procstub, sched, wire
from .capture import Capture
from .errors import SnapshotError
from .pids import OwnChild
from .store import SnapshotInfo, SnapshotStore

log = logging.getLogger(__name__)

_PKG_PARENT = str(Path(__file__).resolve().parents[1])
# Before torch is imported: the priority, so that every thread torch starts inherits it, and
# PR_SET_PDEATHSIG, so that a trainer killed during the import does not leave us behind.
_BOOT = (
    "import ctypes, os, signal, sys\n"
    "pkg, prio, fd, parent = sys.argv[1:5]\n"
    "try:\n"
    "    if prio == 'idle':\n"
    "        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))\n"
    "    else:\n"
    "        os.setpriority(os.PRIO_PROCESS, 0, int(prio))\n"
    "except OSError:\n"
    "    pass\n"
    "try:\n"
    "    ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)\n"
    "except (OSError, AttributeError):\n"
    "    pass\n"
    "if os.getppid() != int(parent):\n"
    "    os._exit(0)\n"
    "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "sys.path.insert(0, pkg)\n"
    "from checkpoints.procchild import main\n"
    "main(int(fd))\n"
)


class WriterProcess:
    """One long-lived child that writes the jobs it is sent, one at a time.

    Used only from the writer thread, except :meth:`urge`, which is safe from any thread
    and from a signal handler. A child that dies fails its job with one clear line and
    is started again for the next one.
    """

    def __init__(self, store: SnapshotStore, priority: sched.Priority, boost_nice: int = 0) -> None:
        self.store = store
        self.priority = sched.check_priority(priority)
        self.boost_nice = boost_nice
        self.boosts = 0  # jobs that had to be raised to normal priority, in all
        self._boosted = False
        self._ready = False  # the child said "ready": its bootstrap will not change its priority again
        self._hurried = False  # raised while starting because a snapshot was due
        self._proc: subprocess.Popen[bytes] | OwnChild | None = None
        self._sock: socket.socket | None = None
        self._arena_sent: object | None = None
        self._boost_refused_logged = False
        self._housekeeping_due = False  # a job was sent whose "housekept" message is still to come
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        os.set_blocking(self._wake_r, False)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self) -> None:
        """Spawn the child now; it imports torch (~1-2 s of CPU) while training goes on."""
        if self._proc is not None and (self._proc.poll() is not None or self._channel_closed()):
            if self._proc.poll() is None:
                self._proc.kill()
            log.warning("snapshot writer process %d died between snapshots (%s); starting a new one",
                        self._proc.pid, _how(self._proc.wait()))
            self._proc = None
            self._ready = False
            if self._sock is not None:
                self._sock.close()
                self._sock = None
        if self._proc is not None:
            return
        stub = procstub.take()
        if stub is not None:  # forked ahead by this worker (checkpoints/procstub.py): no import to wait for
            try:
                procstub.go(stub[1], self.priority)
            except OSError:
                stub[0].kill()
                stub[1].close()
            else:
                self._proc, self._sock = stub
                self._ready = False
                self._arena_sent = None
                return
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _BOOT, _PKG_PARENT, str(self.priority), str(theirs.fileno()), str(os.getpid())],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=env,
            )
        except OSError as e:
            mine.close()
            raise SnapshotError(f"cannot start the snapshot writer process ({e.strerror or e}); "
                                "pass AsyncSnapshotWriter(mode='thread') to write from a thread instead") from None
        finally:
            theirs.close()
        self._sock = mine
        self._ready = False
        self._arena_sent = None

    def _channel_closed(self) -> bool:
        """The child's end of the socket is gone (checked between jobs, when it sends nothing)."""
        if self._sock is None or not select.select([self._sock], [], [], 0)[0]:
            return False
        if not self._ready:
            return False  # probably its "ready": is_ready reads it
        try:
            return self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True

    def is_ready(self) -> bool:
        """True once the child has imported torch and can take a job (never blocks); starts or
        replaces a dead child, which is then not ready."""
        try:
            self.start()
        except SnapshotError:
            return False
        if self._ready:
            return True
        if self._sock is None or (self._proc is not None and self._proc.poll() is not None):
            return False
        try:
            while select.select([self._sock], [], [], 0)[0]:
                msg, fds = wire.recv(self._sock)
                for fd in fds:
                    os.close(fd)
                if msg.get("op") == "ready":
                    self._ready = True
                    if self._hurried:  # raised to get it up; it waits for jobs at its own priority
                        self._hurried = False
                        if self._proc is not None:
                            sched.set_priority(self._proc.pid, self.priority)
                    break
        except (OSError, EOFError):
            return False  # it died: start() notices and replaces it before the next job
        return self._ready

    def hurry(self) -> None:
        """A snapshot had to be written without us: raise the start so the next one need not be."""
        if not self._ready and self.pid is not None:
            self._hurried = True
            self._raise()

    def wait_ready(self, timeout: float) -> bool:
        """Someone waits for the start, so it runs at the boost priority until ready, whichever
        child it is: one that replaced a dead one here (``is_ready`` starts it) starts at idle
        priority, and two busy processes beside it kept it from ever running (a whole suite
        under that load waited out 60 s)."""
        deadline = time.monotonic() + timeout
        while not self.is_ready():
            left = deadline - time.monotonic()
            if left <= 0 or self._sock is None:
                return False
            self._hurried = True
            self._raise()  # again each time: its bootstrap sets its own priority, which may come after ours
            select.select([self._sock], [], [], min(left, 0.2))
        return True

    def urge(self) -> None:
        """Someone waits for the job in flight: raise its priority (signal-safe)."""
        try:
            os.write(self._wake_w, b"!")
        except OSError:
            pass  # already urged (pipe full), or closed

    def write(self, step: int, capture: Capture, world_size: int, extra_meta: dict[str, Any] | None,
              boost_at: float | None) -> tuple[SnapshotInfo, dict[str, float]]:
        """Hand one captured snapshot to the child and wait until it is durable."""
        self.start()
        assert self._sock is not None and capture.arena is not None
        index = {id(t): i for i, t in enumerate(capture.arena.views)}
        donor = capture.donor  # a host copy's shared memory: its views follow the staging arena's
        if donor is not None:
            index.update({id(t): len(index) + i for i, t in enumerate(donor.views)})
        try:
            state = wire.encode(capture.staged, lambda t: index[id(t)])
            msg = {"op": "job", "step": step, "world_size": int(world_size), "extra_meta": dict(extra_meta or {}),
                   "state": state, "store": self._store_config()}
            if self._arena_sent is not capture.arena:
                wire.send(self._sock, {"op": "arena", "size": capture.arena.size, "specs": capture.arena.specs},
                          fds=[capture.arena.fd])
                self._arena_sent = capture.arena
            if donor is not None:  # mapped by the child for this job only
                wire.send(self._sock, {"op": "donor", "size": donor.size, "specs": donor.specs}, fds=[donor.fd])
                donor.close_fd()
            wire.send(self._sock, msg)
            self._housekeeping_due = True
            reply = self._wait_reply(boost_at, ("done", "error"))
        except (OSError, EOFError) as e:
            raise self._died(step, e) from None
        except (TypeError, ValueError) as e:  # e.g. extra_meta that JSON cannot carry
            raise SnapshotError(f"snapshot step {step} cannot be sent to the writer process: {e}") from None
        if reply["op"] == "error":
            kind = str(reply.get("kind"))  # the child's exception type, so a fence refusal stays one
            cls = getattr(errors, kind, None) or getattr(fence, kind, SnapshotError)
            raise (cls if isinstance(cls, type) and issubclass(cls, SnapshotError) else SnapshotError)(reply["message"])
        info = SnapshotInfo(
            step=reply["step"], path=Path(reply["path"]), world_size=reply["world_size"],
            written_at=reply["written_at"], size_bytes=reply["size_bytes"], torch_version=reply["torch_version"],
            extra_meta=reply["extra_meta"],
        )
        return info, {"write_s": float(reply["write_s"]), "cpu_s": float(reply["cpu_s"])}

    def finish_housekeeping(self, step: int, boost_at: float | None) -> float:
        """Wait for the pruning the child does after each reply; its CPU seconds.

        Call after every :meth:`write`, failed or not: the job stays raised (if it was)
        until this returns. The snapshot's fate is already known, so a child that dies
        here costs only a log line; the next job starts a new one.
        """
        try:
            if not self._housekeeping_due or self._sock is None:
                return 0.0
            return float(self._wait_reply(boost_at, ("housekept",)).get("cpu_s", 0.0))
        except (OSError, EOFError, ValueError) as e:
            log.warning("the snapshot writer process %s while pruning after step %d; "
                        "the next snapshot starts a new writer process", self._reap(e), step)
            return 0.0
        finally:
            self._housekeeping_due = False
            self._calm_down()

    def _store_config(self) -> dict[str, Any]:
        s = self.store
        return {"root": str(s.root), "keep": s.keep, "if_exists": s.if_exists,
                "io_threads": s.io_threads, "stale_temp_grace_s": s.stale_temp_grace_s, "recycle": s.recycle,
                # The child signs with the trainer's store's key, not whatever its environment says
                # (over the private socketpair to our own child).
                "key": s._key.hex() if s._key is not None else None}

    def _wait_reply(self, boost_at: float | None, until: tuple[str, ...]) -> dict[str, Any]:
        """The child's next message whose op is in ``until``, raising its priority when late."""
        assert self._sock is not None
        while True:
            if self._boosted and not self._ready:
                timeout: float | None = 0.2  # the child's bootstrap sets its own priority: raise it again
            elif self._boosted or boost_at is None:
                timeout = None
            else:
                timeout = max(0.0, boost_at - time.monotonic())
            waitables: list[socket.socket | int] = [self._sock, self._wake_r]
            ready, _, _ = select.select(waitables, [], [], timeout)
            if self._sock in ready:
                msg, fds = wire.recv(self._sock)
                for fd in fds:
                    os.close(fd)
                if msg.get("op") in until:
                    return msg
                self._ready = True  # "ready"
                if self._boosted:
                    self._raise()
                continue
            if not self._boosted:  # late, or someone is waiting for it
                self._boost()
            elif not self._ready:
                self._raise()
            if self._wake_r in ready:
                self._drain()

    def _boost(self) -> None:
        self._boosted = True
        self.boosts += 1
        self._raise()

    def _raise(self) -> None:
        pid = self.pid
        if pid is None or (self.priority != "idle" and self.priority <= self.boost_nice):
            return
        if not sched.set_priority(pid, self.boost_nice) and not self._boost_refused_logged:
            self._boost_refused_logged = True
            log.info("cannot raise the snapshot writer's priority (needs CAP_SYS_NICE or RLIMIT_NICE); "
                     "a late write stays at priority %s and due snapshots are handled by the overlap policy",
                     self.priority)

    def _calm_down(self) -> None:
        self._drain()
        pid = self.pid
        if self._boosted and pid is not None:
            sched.set_priority(pid, self.priority)
        self._boosted = False

    def _drain(self) -> None:
        try:
            while os.read(self._wake_r, 64):
                pass
        except BlockingIOError:
            pass

    def _died(self, step: int, cause: BaseException) -> SnapshotError:
        return SnapshotError(
            f"the snapshot writer process {self._reap(cause)} while writing step {step}; that snapshot is lost, "
            "earlier ones are intact, and the next snapshot starts a new writer process"
        )

    def _reap(self, cause: BaseException) -> str:
        """Forget a child whose channel failed; how it ended, for the log line."""
        proc, self._proc = self._proc, None
        self._housekeeping_due = False
        self._ready = False
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        how = "closed its channel"
        if proc is not None:
            try:
                code = proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
            how = _how(code)
        log.debug("writer process channel failed: %r", cause)
        return how

    def close(self, timeout: float = 5.0) -> None:
        """Stop the child; call only when nothing is in flight (after a flush)."""
        proc, sock = self._proc, self._sock
        self._proc = self._sock = None
        if sock is not None:
            try:
                wire.send(sock, {"op": "exit"})
            except OSError:
                pass
            sock.close()
        if proc is not None:
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        self._wake_r = self._wake_w = -1


def _how(code: int) -> str:
    try:
        return f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
    except ValueError:
        return f"was killed by signal {-code}"
