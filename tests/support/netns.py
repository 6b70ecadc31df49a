"""Nodes on their own network, for tests and ``bench/chaos_soak.py``: see :mod:`agent.local.netns`.

The harness itself lives in the ``agent`` package (``elastic local --netns`` offers it to
users); this module adds what only tests need: a bounded listener to probe a fault
against, and the reason a test skips where root or ``ip netns`` is missing.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from typing import Iterator

from agent.local.netns import Namespace, NodeNetwork, ProbeResult, sweep, unavailable_reason
from tests.support.waiting import wait_until

__all__ = ["Listener", "Namespace", "NodeNetwork", "ProbeResult", "listening", "sweep", "unavailable_reason"]

_LISTEN = """
import socket, sys, time
sock = socket.socket()
sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
sock.bind((sys.argv[1], int(sys.argv[2])))
sock.listen(64)
sock.settimeout(0.2)
deadline = time.monotonic() + float(sys.argv[3])
held = []
while time.monotonic() < deadline:  # bounded: it lives --seconds at most
    try:
        held.append(sock.accept()[0])
    except OSError:
        pass
"""


class Listener:
    """A TCP listener that accepts and holds connections for at most ``seconds``."""

    def __init__(self, net: NodeNetwork, node: str | None, port: int, seconds: float = 120.0) -> None:
        self.net, self.node, self.port = net, node, port
        self.host = net[node].addr if node is not None else net.central_addr
        cmd = [sys.executable, "-c", _LISTEN, self.host, str(port), str(seconds)]
        self.process = net.popen(node, cmd) if node is not None else subprocess.Popen(cmd)
        wait_until(lambda: net.probe(node, self.host, port, timeout=1.0).ok or self.process.poll() is not None,
                   30, f"a listener on {self.host}:{port}")
        assert self.process.poll() is None, f"listener on {self.host}:{port} exited"

    def close(self) -> None:
        self.process.kill()
        self.process.wait(timeout=10)


@contextlib.contextmanager
def listening(net: NodeNetwork, port: int, seconds: float = 120.0) -> Iterator[dict[str | None, Listener]]:
    """A listener on ``port`` at the central address (key None) and in every namespace."""
    listeners: dict[str | None, Listener] = {}
    try:
        for node in [None, *(ns.node for ns in net)]:
            listeners[node] = Listener(net, node, port, seconds)
        yield listeners
    finally:
        for listener in listeners.values():
            listener.close()
