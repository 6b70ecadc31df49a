"""The round store's waits: bounded by its own timeout and ended by a newer round, never by
the short timeout gloo passes for a reconfigure (:func:`elastic.inplace.reconfigure.reconfigure_timeout`);
also when the round's host is frozen and its store answers nothing. An in-process TCPStore
stands for the round's store, a listening socket nobody accepts on for a frozen host."""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta
from typing import Iterator

import pytest
import torch.distributed as dist

from elastic.inplace.round_store import RoundAbandoned, RoundStore, _Caller


@pytest.fixture
def store() -> RoundStore:
    host = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    out = RoundStore(timedelta(seconds=30))
    out.point_at(f"127.0.0.1:{host.port}", "round/1/")  # port 0: the store binds one and says which
    out._host = host  # lives as long as the store under test
    return out


def test_gloos_short_timeout_does_not_bound_a_wait_for_a_slow_member(store: RoundStore) -> None:
    store.set_timeout(timedelta(seconds=0.05))  # what gloo does with the reconfigure's timeout
    threading.Timer(0.5, store.set, ("late", b"address")).start()  # a member 0.5 s late
    store.wait(["late"], timedelta(seconds=0.05))
    assert store.get("late") == b"address"


def test_a_newer_round_ends_a_wait_at_once(store: RoundStore) -> None:
    threading.Timer(0.2, store.abandon).start()
    started = time.monotonic()
    with pytest.raises(RoundAbandoned):
        store.get("never")
    assert time.monotonic() - started < 5  # its own bound is 30 s


def test_its_own_bound_still_ends_a_wait(store: RoundStore) -> None:
    short = RoundStore(timedelta(seconds=0.2))
    short.point_at(store.address, "round/1/")  # the same round, a 0.2 s bound
    with pytest.raises(dist.DistStoreError, match="timed out waiting for round store keys"):
        short.wait(["never"])



@pytest.fixture
def frozen_host() -> Iterator[str]:
    """A round store host that is frozen: its kernel completes connects (a listening socket
    with a backlog) and buffers what is sent, but nothing ever answers, as for a SIGSTOPped
    agent. torch's TCPStore client blocks on it in every call, its constructor included,
    past its own timeout."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        yield f"127.0.0.1:{listener.getsockname()[1]}"


def test_a_newer_round_ends_a_connect_to_a_frozen_host_at_once(frozen_host: str) -> None:
    store = RoundStore(timedelta(seconds=30))
    threading.Timer(0.2, store.abandon).start()
    started = time.monotonic()
    with pytest.raises(RoundAbandoned):
        store.point_at(frozen_host, "round/1/", connect_timeout=30)
    assert time.monotonic() - started < 2


def test_its_own_bound_ends_a_connect_to_a_frozen_host(frozen_host: str) -> None:
    store = RoundStore(timedelta(seconds=30))
    started = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="did not answer a connect"):
        store.point_at(frozen_host, "round/1/", connect_timeout=0.3)
    assert time.monotonic() - started < 2


class _FrozenSince(dist.Store):
    """A client that answered while it connected and blocks in every call since, as torch's
    TCPStore client does once its host froze (no process may be frozen in a fast test)."""

    def __init__(self) -> None:
        super().__init__()
        self.thawed = threading.Event()

    def set(self, key: str, value: str | bytes) -> None:
        self.thawed.wait()

    def check(self, keys: list[str]) -> bool:
        self.thawed.wait()
        return False


def _frozen_since(timeout: float) -> tuple[RoundStore, _FrozenSince]:
    client = _FrozenSince()
    store = RoundStore(timedelta(seconds=timeout))
    store._target, store._caller = client, _Caller()  # as point_at leaves them
    return store, client


def test_a_newer_round_ends_a_call_the_frozen_host_never_answers() -> None:
    store, client = _frozen_since(30)
    threading.Timer(0.2, store.abandon).start()
    started = time.monotonic()
    with pytest.raises(RoundAbandoned):
        store.get("handle")
    assert time.monotonic() - started < 2
    client.thawed.set()


def test_its_own_bound_ends_a_call_and_that_client_is_never_used_again() -> None:
    store, client = _frozen_since(0.3)
    with pytest.raises(dist.DistStoreError, match="did not answer a set"):
        store.set("handle", b"h")
    with pytest.raises(RoundAbandoned):  # a call queued behind the blocked one would block too
        store.set("handle", b"h")
    client.thawed.set()


def test_a_closed_store_lets_its_callers_thread_go(store: RoundStore) -> None:
    """The watcher posts ahead through one store per round: none may leave a thread behind."""
    def callers() -> int:
        return sum(t.name == "elastic-round-store" for t in threading.enumerate())

    before = callers()
    other = RoundStore(timedelta(seconds=5))
    other.point_at(store.address, "round/2/")
    other.set("k", b"v")
    assert callers() == before + 1
    other.close()
    deadline = time.monotonic() + 5
    while callers() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert callers() == before
    with pytest.raises(RoundAbandoned):
        other.set("k", b"v")
