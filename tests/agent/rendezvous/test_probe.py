"""The death probe against real sockets: a closed port is dead, a listening one is not."""

from __future__ import annotations

import socket

from agent.etcd import free_port
from agent.rendezvous.probe import DeathProbe, refused
from tests.support.waiting import wait_until


def test_a_port_nobody_listens_on_is_refused_and_a_listening_one_is_not() -> None:
    closed = free_port()  # free_port: nothing must listen there, so no bind race to lose (issue 40)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        assert refused(f"127.0.0.1:{closed}")
        assert not refused(f"127.0.0.1:{server.getsockname()[1]}")


def test_the_probe_reports_only_proven_deaths_and_never_blocks_the_caller() -> None:
    probe = DeathProbe()  # "gone" below: free_port: nothing must listen there, so no bind race to lose (issue 40)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        addrs = {"gone": f"127.0.0.1:{free_port()}", "alive": f"127.0.0.1:{server.getsockname()[1]}",
                 "unknown": None}
        assert wait_until(lambda: probe.dead(addrs), 5, "the dead node's probe to come back") == {"gone"}
        assert probe.dead(addrs) == {"gone"}
