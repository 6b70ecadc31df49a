"""One process per simulated node, forked from a zygote that never touched gRPC.

A benchmark of N nodes wants N processes (threads of one process share a GIL, which
starved keep-alive threads past their lease TTL at 64 nodes), but N fresh interpreters
would each import torch (~1.3 s, ~300 MB). Forking after the imports shares that memory
copy-on-write. gRPC, though, does not survive a fork with a live channel. Checked here
with grpcio 1.85 (a parent with a busy watch channel forking 16 children that each
build their own client): with ``GRPC_ENABLE_FORK_SUPPORT`` off (the default) all 16
children hung on their first request; with it on, the parent itself hung. gRPC's own
advice is to create every gRPC object after the fork, so:

* the bench imports everything, then starts a :class:`Zygote` before anything opens a
  channel; the zygote forks node processes on request and never opens one itself;
* each node builds its own etcd client after its fork, and talks to the bench over a
  Unix socket (:class:`NodeLinks`), not over anything inherited;
* the bench's main process is free to use gRPC (start etcd, watch keys) once the zygote
  exists.

Nodes die with the zygote, and the zygote with the bench (``PR_SET_PDEATHSIG``), so an
interrupted run leaves no process behind.
"""

from __future__ import annotations

import ctypes
import gc
import os
import signal
import socket
import tempfile
import time
import traceback
from multiprocessing.connection import Client, Connection, Pipe, wait
from pathlib import Path
from typing import Any, Callable, Sequence, cast

_PR_SET_PDEATHSIG = 1
_REAP_EVERY_S = 0.2

NodeMain = Callable[[Connection, int, Any], None]


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when the process that forked it exits."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


class Zygote:
    """A forked copy of the bench, taken right after its imports, that forks nodes.

    ``spawn(main, address, specs)`` forks one process per spec running
    ``main(connection, index, spec)``, where ``connection`` reaches the bench at
    ``address``; it returns their pids. The zygote reaps them; the bench signals them.
    """

    def __init__(self) -> None:
        ours, theirs = Pipe()
        gc.freeze()  # objects from the imports stay out of gc's reach: fewer copied pages per fork
        pid = os.fork()
        if pid == 0:  # the zygote
            ours.close()
            die_with_parent()
            os._exit(_serve(theirs))
        theirs.close()
        self.pid, self._conn = pid, ours

    def spawn(self, main: NodeMain, address: str, specs: Sequence[Any]) -> list[int]:
        self._conn.send((main, address, list(specs)))
        reply = self._conn.recv()
        if isinstance(reply, str):
            raise RuntimeError(f"the zygote could not fork: {reply}")
        return list(reply)

    def close(self) -> None:
        try:
            self._conn.send(None)
            self._conn.close()
        except OSError:
            pass
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            if os.waitpid(self.pid, os.WNOHANG)[0]:
                return
            time.sleep(0.05)
        os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)


def _serve(conn: Connection) -> int:
    """The zygote's loop: fork on request, reap whatever exited, stop when told."""
    while True:
        while True:  # reap exited nodes so they do not linger as zombies
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
        if not conn.poll(_REAP_EVERY_S):
            continue
        try:
            request = conn.recv()
        except EOFError:
            return 0
        if request is None:
            return 0
        main, address, specs = request
        pids: list[int] = []
        try:
            for index, spec in enumerate(specs):
                pid = os.fork()
                if pid == 0:
                    conn.close()
                    _run_node(main, address, index, spec)
                pids.append(pid)
        except OSError as exc:
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            conn.send(f"{exc} after {len(pids)} nodes")
            continue
        conn.send(pids)


def _run_node(main: NodeMain, address: str, index: int, spec: Any) -> None:
    die_with_parent()
    code = 0
    try:
        link = Client(address, family="AF_UNIX")
        link.send(index)
        main(link, index, spec)
    except BaseException:  # noqa: BLE001 - a node reports its own failure, then exits
        traceback.print_exc()
        code = 1
    os._exit(code)


class NodeLinks:
    """The bench's end: a Unix socket every node connects to, one connection per node."""

    def __init__(self) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="bench-nodes-")
        self.address = str(Path(self._dir.name) / "nodes.sock")
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._socket.bind(self.address)
        self._socket.listen(1024)

    def accept(self, count: int, timeout: float) -> dict[int, Connection]:
        """Connections of ``count`` nodes, keyed by the index each one sends first."""
        links: dict[int, Connection] = {}
        deadline = time.monotonic() + timeout
        while len(links) < count:
            self._socket.settimeout(max(deadline - time.monotonic(), 0.01))
            try:
                accepted, _ = self._socket.accept()
            except OSError as exc:  # TimeoutError included
                raise TimeoutError(f"only {len(links)} of {count} nodes connected within {timeout:.0f} s "
                                   f"({exc})") from None
            accepted.setblocking(True)
            conn = Connection(accepted.detach())
            links[int(conn.recv())] = conn
        return links

    def close(self) -> None:
        self._socket.close()
        self._dir.cleanup()


def gather(links: dict[int, Connection], want: Callable[[int, Any], bool], timeout: float,
           what: str) -> dict[int, Any]:
    """Messages from nodes until ``want(index, message)`` held once for each link.

    Raises ``TimeoutError`` naming ``what`` and how many answered, or ``RuntimeError``
    if a node's connection ended (it crashed; its traceback is on stderr).
    """
    by_conn = {conn: index for index, conn in links.items()}
    got: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while len(got) < len(links):
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{what}: {len(got)} of {len(links)} nodes within {timeout:.0f} s")
        for ready in wait([c for c, i in by_conn.items() if i not in got], timeout=left):
            conn = cast(Connection, ready)
            index = by_conn[conn]
            try:
                message = conn.recv()
            except EOFError:
                raise RuntimeError(f"{what}: node {index} exited (see its traceback above)") from None
            if want(index, message):
                got[index] = message
    return got


def tree_memory(pids: Sequence[int]) -> tuple[float, float]:
    """(PSS, RSS) of these processes in GiB. PSS splits shared pages among their sharers,
    so it sums to what the tree really costs; RSS counts them once per process."""
    pss = rss = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    pss += int(line.split()[1])
                elif line.startswith("Rss:"):
                    rss += int(line.split()[1])
        except OSError:
            continue
    return pss / 2**20, rss / 2**20


def tree_cpu_seconds(pids: Sequence[int]) -> float:
    """User + system CPU seconds these processes (all their threads) have used so far."""
    ticks = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ticks += int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15 of stat(5)
    return ticks / os.sysconf("SC_CLK_TCK")


def mem_available_gib() -> float:
    """``MemAvailable`` from /proc/meminfo (what ``free`` shows as available)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def kill_all(pids: Sequence[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
