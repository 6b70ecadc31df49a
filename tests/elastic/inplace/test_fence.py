"""The socket fence (elastic.inplace.fence) on real TCP connections of this process: what a
trip shuts, and sockets recorded after a trip. (gloo's own sockets in a real group:
tests/elastic/inplace/test_gloo_freeze_mid_connect.py and the in-place freeze tests.)"""

from __future__ import annotations

import socket
import threading
from typing import Iterator

import pytest

from elastic.inplace.fence import SocketFence


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    server = socket.create_server(("127.0.0.1", 0))
    yield server
    server.close()


def _connected(server: socket.socket) -> tuple[socket.socket, socket.socket]:
    client = socket.create_connection(server.getsockname(), timeout=5)
    accepted, _ = server.accept()
    return client, accepted


def _recv_returns(sock: socket.socket, within: float = 5.0) -> bool:
    """Whether a blocked recv on ``sock`` returns (EOF or an error) within ``within`` seconds:
    what gloo's wait for a frozen peer needs from a trip."""
    done = threading.Event()

    def wait() -> None:
        try:
            sock.settimeout(None)
            sock.recv(1)
        except OSError:
            pass
        done.set()

    threading.Thread(target=wait, daemon=True).start()
    return done.wait(within)


def test_a_trip_shuts_what_the_world_opened_and_nothing_older(listener: socket.socket) -> None:
    older = _connected(listener)  # opened before the world: not its own
    fence = SocketFence()
    fence.before_connect()
    mine = _connected(listener)
    fence.after_connect()
    assert fence.armed() == 2  # both ends of the world's connection are this process's
    assert fence.trip() == 2
    assert _recv_returns(mine[0]) and _recv_returns(mine[1])
    older[0].settimeout(0.2)
    with pytest.raises(socket.timeout):  # untouched: still open, nothing to read
        older[0].recv(1)
    for s in (*older, *mine):
        s.close()


def test_sockets_a_group_opens_while_the_world_is_tripped_are_shut_as_it_is_recorded(
        listener: socket.socket) -> None:
    """A newer round replaced the world while a group of it formed (a heal's, a rebuilt mesh):
    its sockets, recorded after the trip, were shut by no one and a collective on them waited
    for peers that had left."""
    fence = SocketFence()
    fence.before_connect()
    fence.after_connect()
    with fence.adding():
        fence.trip()  # the watcher, meanwhile
        late = _connected(listener)
    assert fence.armed() == 0
    assert _recv_returns(late[0]) and _recv_returns(late[1])
    for s in late:
        s.close()


def test_a_world_joined_again_records_its_groups_for_the_next_trip(listener: socket.socket) -> None:
    fence = SocketFence()
    fence.before_connect()
    fence.after_connect()
    fence.trip()
    fence.before_connect()  # the next world
    fence.after_connect()
    with fence.adding():
        group = _connected(listener)
    assert fence.armed() == 2
    group[0].settimeout(0.2)
    with pytest.raises(socket.timeout):  # recorded, not shut: this world is live
        group[0].recv(1)
    assert fence.trip() == 2 and _recv_returns(group[0])
    for s in group:
        s.close()
