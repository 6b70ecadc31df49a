"""The etcd-v3 Store behaves like torch's stores, against a real etcd."""

from __future__ import annotations

import json
import random
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from agent.etcd import EmbeddedEtcd, EtcdClient
from agent.rendezvous import EtcdV3Store, StateSigner
from agent.rendezvous.bootstrap import bootstrap_info, read_delays

KEY = b"s" * 32


def make_store(client: EtcdClient, prefix: str, timeout: float = 10.0) -> EtcdV3Store:
    return EtcdV3Store(client, prefix, StateSigner(KEY), timeout=timedelta(seconds=timeout))


@pytest.fixture
def store(etcd_client: EtcdClient, run_id: str) -> EtcdV3Store:
    return make_store(etcd_client, f"/test/{run_id}/store")


def test_set_get_roundtrip_str_and_bytes(store: EtcdV3Store) -> None:
    store.set("a", "text")
    store.set("b", b"\x00\xffbinary")
    assert store.get("a") == b"text"
    assert store.get("b") == b"\x00\xffbinary"


def test_get_blocks_until_another_writer_sets(store: EtcdV3Store, etcd_client: EtcdClient, run_id: str) -> None:
    writer = make_store(etcd_client, f"/test/{run_id}/store")
    timer = threading.Timer(0.5, writer.set, args=("late", "arrived"))
    started = time.monotonic()
    timer.start()
    try:
        assert store.get("late") == b"arrived"
    finally:
        timer.cancel()
    assert time.monotonic() - started >= 0.4  # it really waited for the write


def test_get_times_out_with_store_error(etcd_client: EtcdClient, run_id: str) -> None:
    store = make_store(etcd_client, f"/test/{run_id}/store", timeout=0.5)
    started = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="wait timeout after 500 ms, keys: \\['never'\\]"):
        store.get("never")
    assert 0.4 <= time.monotonic() - started < 5


def test_wait_and_check(store: EtcdV3Store) -> None:
    assert store.check(["x", "y"]) is False
    store.set("x", "1")
    assert store.check(["x"]) is True
    assert store.check(["x", "y"]) is False
    threading.Timer(0.3, store.set, args=("y", "2")).start()
    store.wait(["x", "y"])
    assert store.check(["x", "y"]) is True
    with pytest.raises(dist.DistStoreError):
        store.wait(["z"], timedelta(milliseconds=300))


def test_multi_set_and_multi_get(store: EtcdV3Store) -> None:
    store.multi_set(["k1", "k2"], ["v1", b"v2"])
    assert store.multi_get(["k2", "k1"]) == [b"v2", b"v1"]


def test_compare_set_follows_tcpstore_semantics(store: EtcdV3Store) -> None:
    assert store.compare_set("cs", "", "first") == b"first"  # absent + empty expected: set
    assert store.compare_set("cs", "wrong", "second") == b"first"  # mismatch: current returned
    assert store.get("cs") == b"first"
    assert store.compare_set("cs", "first", "second") == b"second"
    assert store.get("cs") == b"second"
    assert store.compare_set("absent", "expected", "x") == b"expected"
    assert store.check(["absent"]) is False


def test_add_append_delete_and_num_keys(store: EtcdV3Store) -> None:
    assert store.add("n", 3) == 3
    assert store.add("n", -1) == 2
    store.append("log", "ab")
    store.append("log", "cd")
    assert store.get("log") == b"abcd"
    assert store.num_keys() == 2
    assert store.delete_key("log") is True
    assert store.delete_key("log") is False
    assert store.num_keys() == 1


def test_prefixes_isolate_jobs(etcd_client: EtcdClient, run_id: str) -> None:
    one = make_store(etcd_client, f"/test/{run_id}/one")
    two = make_store(etcd_client, f"/test/{run_id}/two", timeout=0.3)
    one.set("shared-name", "one")
    with pytest.raises(dist.DistStoreError):
        two.get("shared-name")


def test_works_under_torch_prefix_store(store: EtcdV3Store) -> None:
    """DynamicRendezvousHandler wraps the store in a PrefixStore per round."""
    wrapped = dist.PrefixStore("round1", store)
    wrapped.set("MASTER_ADDR", "10.0.0.1")
    assert wrapped.get("MASTER_ADDR") == b"10.0.0.1"
    wrapped.multi_set(["a", "b"], ["1", "2"])
    assert wrapped.multi_get(["a", "b"]) == [b"1", b"2"]
    assert wrapped.add("counter", 5) == 5


def test_forged_store_value_is_refused(store: EtcdV3Store, etcd_client: EtcdClient, run_id: str) -> None:
    etcd_client.call(lambda c: c.put(f"/test/{run_id}/store/MASTER_ADDR", b"evil.example.com"))
    with pytest.raises(dist.DistStoreError, match="refusing"):
        store.get("MASTER_ADDR")


def _add_many(rank: int, endpoint: str, prefix: str, times: int, out: str) -> None:
    host, port = endpoint.split(":")
    from agent.etcd import EtcdSettings

    client = EtcdClient(EtcdSettings(endpoints=((host, int(port)),)))
    store = make_store(client, prefix)
    Path(out, f"adds-{rank}.json").write_text(json.dumps([store.add("counter", 1) for _ in range(times)]))
    client.close()


def test_add_under_contention_from_several_processes(etcd_server: EmbeddedEtcd, run_id: str, tmp_path: Path) -> None:
    """Four processes increment one counter; no increment is lost or duplicated."""
    from tests.support.spawn import ranks

    prefix, workers, times = f"/test/{run_id}/contended", 4, 25
    ranks(_add_many, (etcd_server.endpoint, prefix, times, str(tmp_path)), workers, tmp_path / "logs", timeout=120)
    seen = [value for rank in range(workers) for value in json.loads((tmp_path / f"adds-{rank}.json").read_text())]
    assert sorted(seen) == list(range(1, workers * times + 1))


def test_peek_reads_once_and_never_waits(store: EtcdV3Store, etcd_client: EtcdClient, run_id: str) -> None:
    assert store.peek(["p", "q"]) is None
    store.set("p", "1")
    assert store.peek(["p", "q"]) is None  # all or nothing
    store.set("q", "2")
    assert store.peek(["p", "q"]) == [b"1", b"2"]
    etcd_client.call(lambda c: c.put(f"/test/{run_id}/store/q", b"forged"))
    with pytest.raises(dist.DistStoreError, match="refusing"):
        store.peek(["p", "q"])


def test_bootstrap_address_is_read_without_a_watch(store: EtcdV3Store, etcd_client: EtcdClient,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A member reads MASTER_ADDR/PORT again on a back-off, not a watch per member (issue 53:
    1,023 watch creations on one key timed out); torch's blocking get only if still missing.
    The spy counts the client's watches; the etcd, store and torch's build are real."""
    watches: list[object] = []
    real_wait = etcd_client.wait_for_event
    monkeypatch.setattr(etcd_client, "wait_for_event",
                        lambda *a, **k: watches.append(a) or real_wait(*a, **k))
    round_store = dist.PrefixStore("round/7", store)
    peek = lambda keys: store.peek([f"round/7/{k}" for k in keys])  # noqa: E731 - as the handler does
    late = threading.Timer(0.3, bootstrap_info, args=(0, round_store, peek, "10.0.0.7"))
    late.start()
    try:
        info = bootstrap_info(3, round_store, peek, "10.0.0.9", delays=[0.1] * 30)
    finally:
        late.cancel()
    assert info.master_addr == "10.0.0.7" and 0 < info.master_port < 65536
    assert watches == []  # found by a read: no watch
    # still missing after the reads: torch's own build, whose get waits (a watch) for rank 0
    other = dist.PrefixStore("round/8", store)
    late = threading.Timer(0.4, other.multi_set, args=(["MASTER_ADDR", "MASTER_PORT"], ["10.0.0.8", "29500"]))
    late.start()
    try:
        info = bootstrap_info(1, other, lambda keys: store.peek([f"round/8/{k}" for k in keys]), None,
                              delays=[0.05])
    finally:
        late.cancel()
    assert (info.master_addr, info.master_port) == ("10.0.0.8", 29500) and watches


def test_read_delays_back_off_with_jitter_within_the_budget() -> None:
    delays = read_delays(first=0.05, cap=0.5, budget=2.0, rng=random.Random(1))
    assert 2.0 <= sum(delays) < 2.0 + 0.75 and len(delays) <= 10
    assert delays[0] < 0.08 and max(delays) <= 0.75  # jittered 0.5-1.5 x the step, capped
    assert read_delays(rng=random.Random(1)) != read_delays(rng=random.Random(2))  # members out of step
