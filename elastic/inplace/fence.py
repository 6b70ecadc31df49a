"""Get a survivor out of a gloo collective that waits on a frozen peer, at once.

A SIGKILLed peer resets its TCP connections and the survivors' collective fails within
milliseconds. A SIGSTOPped (or cut-off) peer does not: the collective waits for its
timeout, and neither ``ProcessGroup.abort()`` nor gloo's ``abort()`` interrupts it (checked
with torch 2.14.1). When the rendezvous has already written the peer off, the survivors
must not wait that long.

So the fence remembers which sockets the last reconfigure opened (every TCP socket that
appeared in this process while gloo connected its pairs) and, when told the old world is
gone, ``shutdown()``s them. A blocked ``recv`` on a shut-down socket returns at once, so
gloo raises "Connection closed by peer" as if the peer had died, and the trainer goes to
the next round. The sockets stay open (gloo still owns and closes them); an fd number
reused since is recognised by its inode and left alone.

This uses no torch API, only the process's own sockets. If it ever stops working, the
fallback is the collective timeout, which the trainer sizes from the observed step time.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from typing import Iterator

_FD_DIR = "/proc/self/fd"


_LISTEN = "0A"  # /proc/net/tcp's state of a listening socket


def _tcp_rows() -> Iterator[list[str]]:
    """Every row of this process's ``/proc/self/net/tcp`` and ``tcp6`` tables, split (a table
    that cannot be read is skipped)."""
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as f:
                next(f, None)
                rows = [line.split() for line in f]
        except OSError:
            continue
        yield from (fields for fields in rows if len(fields) > 9)


def _tcp_inodes() -> set[str]:
    """The inodes of this process's connected TCP sockets. Listening ones are left out: a
    gloo device's listener shut down makes gloo's accept fail with EINVAL, and gloo
    terminates the process (seen when a new group's sockets were put on the fence)."""
    return {fields[9] for fields in _tcp_rows() if fields[3] != _LISTEN}


def _address(hex_addr: str) -> tuple[str, int]:
    """``/proc/net/tcp``'s ``0100007F:1F90`` (or tcp6's 32 hex digits) as ``("127.0.0.1", 8080)``."""
    ip, _, port = hex_addr.partition(":")
    raw = bytes.fromhex(ip)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # each 32-bit word in host order
    return socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, words), int(port, 16)


def listening() -> dict[str, tuple[str, int]]:
    """This process's listening TCP sockets: inode -> (address, port)."""
    mine = {target[8:-1] for target in socket_fds().values()}
    found: dict[str, tuple[str, int]] = {}
    for fields in _tcp_rows():
        if fields[3] == _LISTEN and fields[9] in mine:
            try:
                found[fields[9]] = _address(fields[1])
            except ValueError:
                continue
    return found


def socket_fds() -> dict[int, str]:
    """This process's open sockets: fd -> ``socket:[inode]``."""
    found: dict[int, str] = {}
    try:
        names = os.listdir(_FD_DIR)
    except OSError:
        return found
    for name in names:
        try:
            target = os.readlink(f"{_FD_DIR}/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            found[int(name)] = target
    return found


def _tcp_opened_since(before: dict[int, str]) -> dict[int, str]:
    """This process's connected TCP sockets that were not open at ``before`` (fd -> target)."""
    tcp = _tcp_inodes()
    return {fd: target for fd, target in socket_fds().items() if before.get(fd) != target and target[8:-1] in tcp}


class SocketFence:
    """Records the sockets a reconfigure opens; ``trip()`` shuts them down."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._before: dict[int, str] = {}
        self._current: dict[int, str] = {}
        self.tripped = False

    def before_connect(self) -> None:
        self._before = socket_fds()

    def after_connect(self) -> None:
        """Everything new since :meth:`before_connect` that is TCP belongs to the new world."""
        fresh = _tcp_opened_since(self._before)
        with self._lock:
            self._current, self.tripped = fresh, False

    @contextlib.contextmanager
    def adding(self) -> Iterator[None]:
        """Sockets opened inside also belong to the current world (a heal's group of its own):
        a trip shuts them down with the rest. A trip that came while they were opened (a newer
        round replaced the world as its group formed) shuts them as the block ends: recorded
        after it, they would be shut by no one, and a collective on them would wait for peers
        that left for the new round."""
        before = socket_fds()
        yield
        fresh = _tcp_opened_since(before)
        with self._lock:
            late = self.tripped  # the world they were made for was replaced meanwhile
            if not late:
                self._current.update(fresh)
        if late:  # shut at once: the trip that ended the world has passed them by
            _shut(fresh)

    def armed(self) -> int:
        return len(self._current)

    def trip(self) -> int:
        """Shut down the current world's sockets; returns how many were shut down."""
        with self._lock:
            chosen, self._current, self.tripped = self._current, {}, True
        return _shut(chosen)


def _shut(chosen: dict[int, str]) -> int:
    """``shutdown()`` each of ``chosen`` (fd -> target) still open as the same socket; how many."""
    done = 0
    for fd, target in chosen.items():
        try:
            if os.readlink(f"{_FD_DIR}/{fd}") != target:
                continue  # closed and the number reused: not ours to touch
        except OSError:
            continue
        with contextlib.suppress(OSError):
            sock = socket.socket(fileno=fd)
            try:
                sock.shutdown(socket.SHUT_RDWR)
                done += 1
            except OSError:
                pass
            finally:
                sock.detach()  # gloo still owns the fd
    return done
