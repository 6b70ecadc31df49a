"""Peers vouch for each other's view of etcd over a channel that does not need etcd.

Each node runs a tiny TCP **witness**: ask it (one line, a nonce) and it answers how long
ago its last confirmed etcd keep-alive was sent and whether its latest one failed,
HMAC-sealed with the job key over the nonce, so neither a stranger nor a replayed answer
can make a cut-off node believe etcd is down for everyone. Its address goes into the
node's registry record (``witness_addr``), which every member of a round already holds
in its mirror, so asking needs no etcd request.

A node whose own keep-alives fail asks a bounded set of its round's members (the stewards
and a few spread around the round, :mod:`.vouchers`; every other member in a small round)
(:class:`PeerAsker`, in the background, a bounded connect per peer) and
:mod:`.lease_clock` judges the answers. The questions are few: only while failing, four
times per keep-alive interval, one short connection per asked peer, at most 11 at any size.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import selectors
import socket
import threading
import time
from typing import Callable, Mapping

from agent.rendezvous.lease_clock import LeaseClock, PeerWord
from agent.rendezvous.signing import SignatureError, StateSigner

log = logging.getLogger(__name__)

_REQUEST_BYTES = 64
_ACCEPT_POLL_S = 0.5


def _sealing_key(node: str, nonce: str) -> bytes:
    return f"witness/{node}/{nonce}".encode()


class WitnessServer:
    """Answers ``lease?<nonce>`` with this node's sealed lease clock. Every witness of a process
    is served by one thread (:class:`_Acceptor`): an agent has one, the simulation hundreds."""

    def __init__(self, node: str, signer: StateSigner, clock: Callable[[], LeaseClock], host: str = "0.0.0.0") -> None:
        self.node, self.signer, self.clock = node, signer, clock
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 0))
        self._sock.listen(32)
        self._sock.setblocking(False)
        self.port = int(self._sock.getsockname()[1])

    def start(self) -> "WitnessServer":
        _acceptor.add(self)
        return self

    def answer(self, nonce: str) -> bytes:
        clock, now = self.clock(), time.monotonic()
        payload = json.dumps({"node": self.node, "age": clock.age(now),
                              "failing": clock.failing_since is not None}).encode()
        return self.signer.seal(_sealing_key(self.node, nonce), payload)

    def serve_one(self) -> None:
        """Answer one waiting question (the acceptor saw our socket readable)."""
        try:
            conn, _ = self._sock.accept()
        except OSError:
            return  # taken already, or closed
        with conn:
            try:
                conn.settimeout(0.5)
                request = conn.recv(_REQUEST_BYTES).decode(errors="replace").strip()
                if request.startswith("lease?"):
                    conn.sendall(self.answer(request[len("lease?"):]))
            except OSError:
                pass

    def close(self) -> None:
        _acceptor.remove(self)
        try:
            self._sock.close()
        except OSError:
            pass


class _Acceptor:
    """One thread and one selector over every witness socket of the process."""

    def __init__(self) -> None:
        self._selector = selectors.DefaultSelector()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def add(self, server: WitnessServer) -> None:
        with self._lock:
            self._selector.register(server._sock, selectors.EVENT_READ, server)
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="elastic-witness", daemon=True)
                self._thread.start()

    def remove(self, server: WitnessServer) -> None:
        with self._lock:
            try:
                self._selector.unregister(server._sock)
            except (KeyError, ValueError):
                pass

    def _serve(self) -> None:
        while True:
            with self._lock:
                idle = not self._selector.get_map()
            if idle:
                time.sleep(_ACCEPT_POLL_S)
                continue
            try:
                ready = self._selector.select(timeout=_ACCEPT_POLL_S)
            except (OSError, ValueError):
                continue  # a socket closed under the select: the next one goes without it
            for key, _events in ready:
                key.data.serve_one()


_acceptor = _Acceptor()


def _after_fork() -> None:  # a forked child has no acceptor thread: it starts its own on first use
    global _acceptor
    _acceptor = _Acceptor()


os.register_at_fork(after_in_child=_after_fork)


def ask(addr: str, node: str, signer: StateSigner, timeout: float) -> PeerWord | None:
    """One question to ``node``'s witness at ``host:port``; None if it cannot be trusted or reached."""
    host, _, port = addr.rpartition(":")
    nonce = secrets.token_hex(8)
    asked = time.monotonic()
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout) as sock:
            sock.settimeout(max(0.05, timeout - (time.monotonic() - asked)))
            sock.sendall(f"lease?{nonce}\n".encode())
            chunks = []
            while True:
                chunk = sock.recv(4096)
                if not chunk:
                    break
                chunks.append(chunk)
    except (OSError, ValueError):
        return None
    answered = time.monotonic()
    try:
        age, failing = decode_answer(signer, node, nonce, b"".join(chunks))
    except (SignatureError, ValueError) as exc:
        log.warning("ignoring %s's witness answer: %s", node, exc)
        return None
    return PeerWord(asked_at=asked, answered_at=answered, age=age, failing=failing)


def decode_answer(signer: StateSigner, node: str, nonce: str, raw: bytes) -> tuple[float | None, bool]:
    """``(age, failing)`` from ``node``'s answer to ``nonce``; SignatureError if it is not
    sealed for that question, ValueError if it is not an answer :meth:`WitnessServer.answer`
    gives (an infinite age, say, would read as a peer that lost etcd long ago)."""
    try:
        data = json.loads(signer.open(_sealing_key(node, nonce), raw))
    except RecursionError:
        raise ValueError("not a witness answer: nested too deeply") from None
    if not isinstance(data, dict):
        raise ValueError("not a witness answer: not a JSON object")
    age, failing = data.get("age"), data.get("failing")
    if age is not None and (not isinstance(age, (int, float)) or isinstance(age, bool) or not 0 <= age < 1e300):
        raise ValueError(f"witness answer age {age!r:.40} is not seconds")
    if not isinstance(failing, bool):
        raise ValueError(f"witness answer failing={failing!r:.40} is not true or false")
    return None if age is None else float(age), failing


class PeerAsker:
    """Asks peers in the background and keeps each one's freshest answer."""

    def __init__(self, signer: StateSigner, timeout: float) -> None:
        self.signer, self.timeout = signer, timeout
        self._lock = threading.Lock()
        self._words: dict[str, PeerWord] = {}
        self._asking: set[str] = set()
        self.last_asked: float | None = None

    def words(self) -> dict[str, PeerWord]:
        with self._lock:
            return dict(self._words)

    def pending(self) -> int:
        """Questions still waiting for an answer or a timeout."""
        with self._lock:
            return len(self._asking)

    def ask_all(self, addrs: Mapping[str, str | None]) -> None:
        """Start one question per peer not already being asked (never blocks)."""
        self.last_asked = time.monotonic()
        for node, addr in addrs.items():
            if not addr:
                continue
            with self._lock:
                if node in self._asking:
                    continue
                self._asking.add(node)
            threading.Thread(target=self._ask, args=(node, addr), name="elastic-witness-ask", daemon=True).start()

    def _ask(self, node: str, addr: str) -> None:
        try:
            word = ask(addr, node, self.signer, self.timeout)
            if word is not None:
                with self._lock:
                    self._words[node] = word
        finally:
            with self._lock:
                self._asking.discard(node)
