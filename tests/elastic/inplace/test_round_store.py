"""The round store's waits: bounded by its own timeout and ended by a newer round, never by
the short timeout gloo passes for a reconfigure (:func:`elastic.inplace.reconfigure.reconfigure_timeout`).
An in-process TCPStore stands for the round's store."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from elastic.etcd.server import free_port
from elastic.inplace.round_store import RoundAbandoned, RoundStore


@pytest.fixture
def store() -> RoundStore:
    port = free_port()
    host = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    out = RoundStore(timedelta(seconds=30))
    out.point_at(f"127.0.0.1:{port}", "round/1/")
    out._host = host  # type: ignore[attr-defined]  # lives as long as the store under test
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
