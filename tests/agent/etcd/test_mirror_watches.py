"""A mirror's watches after their stream breaks: none left dead while the mirror says healthy.

Real etcd, real gRPC streams broken by closing the client's shared channel (what a keep-alive
that found no member does, and what an etcd leader's death does to every stream on it). Two
ways a watch died silently under the whole suite's load, each tested here:

* a watch number is per stream: cancelling an old watch by its number on the new stream
  cancelled another mirror's new watch there (:mod:`agent.etcd.watches`);
* a stream that broke while a resync was still making its watches (one round trip each, six
  for a rendezvous member's narrow mirror) was ignored, and the resync ended "restored" with
  dead watches. The moment of that second break is the one thing injected: the break is real.
"""

from __future__ import annotations

import queue
from typing import Any

import pytest

import agent.etcd.mirror as mirror_module
from agent.etcd import EmbeddedEtcd, EtcdClient
from agent.etcd.ranges import RangesMirror
from agent.etcd.watches import OwnWatch
from tests.support.waiting import wait_until


def test_cancelling_a_watch_of_a_broken_stream_leaves_the_new_streams_watch_alone(
        etcd_server: EmbeddedEtcd, run_id: str) -> None:
    client = EtcdClient(etcd_server.settings(), retry_deadline=5.0)
    try:
        old_events: queue.Queue[Any] = queue.Queue()
        old = OwnWatch(client, f"/{run_id}/old", old_events.put, deadline=5.0)
        client.drop_channel()  # the stream breaks: every watch on it is told
        wait_until(lambda: old.ended, 10, "the old watch to hear that its stream ended")
        new_events: queue.Queue[Any] = queue.Queue()
        new = OwnWatch(client, f"/{run_id}/new", new_events.put, deadline=5.0)
        assert new.id == old.id, "etcd no longer numbers each stream's watches from 0: this test tests nothing"
        old.cancel()
        client.call(lambda c: c.put(f"/{run_id}/new", "v"))
        response = new_events.get(timeout=10)
        assert not isinstance(response, BaseException) and response is not None and response.events, \
            "cancelling the old watch by its number cancelled the new one"
        new.cancel()
    finally:
        client.close()


def test_a_break_during_the_resync_is_resynced_again(
        etcd_server: EmbeddedEtcd, run_id: str, monkeypatch: pytest.MonkeyPatch) -> None:
    client = EtcdClient(etcd_server.settings(), retry_deadline=5.0)
    keys = [f"/{run_id}/round", f"/{run_id}/closed", f"/{run_id}/nodes/me"]
    made = {"armed": False, "count": 0, "broke": False}

    class BreaksAfterTwo(OwnWatch):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if made["armed"]:
                made["count"] += 1
                if made["count"] == 2:  # the stream breaks again while the resync makes its watches
                    made["armed"], made["broke"] = False, True
                    client.drop_channel()

    monkeypatch.setattr(mirror_module, "OwnWatch", BreaksAfterTwo)
    narrow = RangesMirror(client, keys, [f"/{run_id}/keepout/"])
    try:
        narrow.start(deadline=5.0)
        made["armed"] = True
        client.drop_channel()
        wait_until(lambda: made["broke"], 10, "the second break, during the resync")
        wait_until(lambda: narrow.healthy and not narrow._resyncing, 10, "the mirror to resync")
        for key in keys:
            client.call(lambda c: c.put(key, "v"))
        wait_until(lambda: all(k in narrow.entries()[0] for k in keys), 10,
                   "the mirror to hear every key after the resync (a watch left dead while it said healthy)")
    finally:
        narrow.close()
        client.close()
