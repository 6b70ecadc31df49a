"""Is a node's agent still there? A TCP connect to its round store says so in a millisecond.

A SIGKILLed node keeps its etcd lease for up to the TTL, and a round waiting for a member
that still looks alive costs ``rejoin_timeout``. But a dead agent's listening port is
closed: the kernel refuses a connect at once. So while a round is open, the handler probes
each missing member's ``store_addr``; a refusal is proof of death and the round closes
without waiting. A frozen node (its kernel still accepts) or a cut-off one (the connect
times out) proves nothing, and the lease decides as before.
"""

from __future__ import annotations

import errno
import socket
import threading
import time
from typing import Callable, Mapping

_REPROBE_S = 0.2


OK, REFUSED, UNREACHABLE = "ok", "refused", "unreachable"
_UNREACHABLE_ERRNOS = {errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EINVAL, errno.ETIMEDOUT, errno.EHOSTDOWN,
                       errno.ENETDOWN}


def reach(addr: str, timeout: float = 1.0) -> str:
    """What a TCP connect to ``host:port`` says about the path to it: ``ok``; ``refused``
    (the host answered, nobody listens: a dead agent); or ``unreachable`` (the connect timed
    out or the route failed: a network fault between us). A blackhole route fails at once
    with EINVAL; a link down with EHOSTUNREACH after about a second; a dropped SYN-ACK is
    a timeout."""
    host, _, port = addr.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return OK
    except ConnectionRefusedError:
        return REFUSED
    except TimeoutError:
        return UNREACHABLE
    except OSError as exc:
        if exc.errno == errno.ECONNREFUSED:
            return REFUSED
        return UNREACHABLE if exc.errno in _UNREACHABLE_ERRNOS else OK  # no verdict on what we cannot read
    except ValueError:
        return OK  # not an address we can judge: no verdict against it


def refused(addr: str, timeout: float = 0.5) -> bool:
    """True only if ``host:port`` actively refused a TCP connect (nobody listens there)."""
    return reach(addr, timeout) == REFUSED


class DeathProbe:
    """Probes in the background; ``dead(addrs)`` answers from what has come back so far."""

    def __init__(self, timeout: float = 0.5, on_death: Callable[[], None] = lambda: None) -> None:
        self.timeout, self.on_death = timeout, on_death
        self._lock = threading.Lock()
        self._dead: set[str] = set()  # "node@addr"
        self._last: dict[str, float] = {}
        self._running: set[str] = set()

    def dead(self, addrs: Mapping[str, str | None]) -> set[str]:
        """Nodes (of ``node -> store address``) proven dead; starts probes for the rest."""
        found: set[str] = set()
        now = time.monotonic()
        for node, addr in addrs.items():
            if not addr:
                continue
            key = f"{node}@{addr}"
            with self._lock:
                if key in self._dead:
                    found.add(node)
                    continue
                if key in self._running or now - self._last.get(key, -1e9) < _REPROBE_S:
                    continue
                self._running.add(key)
                self._last[key] = now
            threading.Thread(target=self._probe, args=(key, addr), daemon=True, name="elastic-probe").start()
        return found

    def _probe(self, key: str, addr: str) -> None:
        try:
            if refused(addr, self.timeout):
                with self._lock:
                    self._dead.add(key)
                self.on_death()  # the round waiting on this node may close now
        finally:
            with self._lock:
                self._running.discard(key)
