"""The lease witness over real sockets: a peer's answer is trusted only if sealed for our question."""

from __future__ import annotations

import socket
import threading
import time

from agent.rendezvous.lease_clock import LeaseClock
from agent.rendezvous.signing import StateSigner
from agent.rendezvous.witness import PeerAsker, WitnessServer, ask
from tests.support.waiting import wait_until

KEY = b"k" * 32


def test_a_peer_answers_how_old_its_last_confirmed_keep_alive_is_and_whether_it_fails() -> None:
    confirmed = time.monotonic() - 1.5
    server = WitnessServer("b", StateSigner(KEY), lambda: LeaseClock(2.0, confirmed, confirmed + 0.5)).start()
    try:
        word = ask(f"127.0.0.1:{server.port}", "b", StateSigner(KEY), timeout=2.0)
        assert word is not None and word.failing
        assert word.age is not None and 1.5 <= word.age < 3.0
        assert word.asked_at <= word.answered_at
    finally:
        server.close()


def test_an_answer_sealed_with_another_job_key_or_for_another_node_is_ignored() -> None:
    server = WitnessServer("b", StateSigner(b"x" * 32), lambda: LeaseClock(2.0, time.monotonic())).start()
    try:
        assert ask(f"127.0.0.1:{server.port}", "b", StateSigner(KEY), timeout=2.0) is None
        assert ask(f"127.0.0.1:{server.port}", "c", StateSigner(b"x" * 32), timeout=2.0) is None  # not c's answer
    finally:
        server.close()


def test_a_peer_nobody_answers_for_leaves_no_word() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, not listening: refused
    asker = PeerAsker(StateSigner(KEY), timeout=0.5)
    server = WitnessServer("b", StateSigner(KEY), lambda: LeaseClock(2.0, time.monotonic())).start()
    try:
        asker.ask_all({"b": f"127.0.0.1:{server.port}", "c": f"127.0.0.1:{port}", "d": None})
        wait_until(lambda: asker.pending() == 0, 10, "every question answered or given up")
        assert set(asker.words()) == {"b"} and not asker.words()["b"].failing
    finally:
        server.close()


def test_a_hundred_witnesses_in_one_process_answer_from_one_thread_and_a_closed_one_stops() -> None:
    """The simulation holds hundreds of handlers per process: their witnesses share a thread."""
    before = threading.active_count()
    servers = [WitnessServer(f"n{i}", StateSigner(KEY), lambda: LeaseClock(2.0, time.monotonic())).start()
               for i in range(100)]
    try:
        assert threading.active_count() - before <= 1
        words = [ask(f"127.0.0.1:{s.port}", s.node, StateSigner(KEY), timeout=2.0) for s in servers]
        assert all(w is not None and not w.failing for w in words)
        servers[0].close()
        assert ask(f"127.0.0.1:{servers[0].port}", "n0", StateSigner(KEY), timeout=0.5) is None
        assert ask(f"127.0.0.1:{servers[1].port}", "n1", StateSigner(KEY), timeout=2.0) is not None
    finally:
        for server in servers:
            server.close()
