"""torch's Store contract, checked on ``EtcdV3Store`` against a real etcd.

torch's own ``StoreTestBase``/``PythonStoreTest`` live in its source tree
(test/distributed/test_store.py) and are not in the wheel, so the same behaviours are
written here: each case runs on the store itself and through the ``PrefixStore`` that
torchrun's agent and process groups wrap it in (which reaches our Python methods by their
C++ names, e.g. ``getNumKeys``/``deleteKey``).
"""

from __future__ import annotations

import gc
import threading
import time
from datetime import timedelta
from typing import Iterator

import pytest
import torch
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousParameters

from agent.etcd import EmbeddedEtcd, EtcdClient, EtcdUnavailableError, free_port
from agent.rendezvous import EtcdV3Store, StateSigner
from agent.rendezvous.backend import EtcdV3RendezvousBackend, create_backend

KEY = b"c" * 32
TIMEOUT = timedelta(seconds=10)
SHORT = timedelta(milliseconds=300)


@pytest.fixture
def base(etcd_client: EtcdClient, run_id: str) -> EtcdV3Store:
    return EtcdV3Store(etcd_client, f"/test/{run_id}/store", StateSigner(KEY), timeout=TIMEOUT)


@pytest.fixture(params=["direct", "prefixed"])
def store(request: pytest.FixtureRequest, base: EtcdV3Store) -> Iterator[dist.Store]:
    """Our store, or torch's PrefixStore over it. ``base`` stays referenced for the whole
    test: pybind11 keeps only the C++ half of a Python store that C++ alone holds."""
    yield base if request.param == "direct" else dist.PrefixStore("round1", base)


# -- the cases of torch's StoreTestBase ---------------------------------------------------
def test_set_get_and_overwrite(store: dist.Store) -> None:
    store.set("key0", "value0")
    store.set("key1", b"value1")
    store.set("key0", "value2")  # overwrite
    assert store.get("key0") == b"value2"
    assert store.get("key1") == b"value1"


def test_add_counts_and_get_reads_the_decimal(store: dist.Store) -> None:
    assert store.add("counter", 1) == 1
    assert store.add("counter", 5) == 6
    assert store.add("counter", -2) == 4
    assert store.get("counter") == b"4"


def test_compare_set_on_an_existing_key(store: dist.Store) -> None:
    store.set("cs", "old")
    assert store.compare_set("cs", "wrong", "new") == b"old"  # mismatch: current value, unchanged
    assert store.get("cs") == b"old"
    assert store.compare_set("cs", "old", "new") == b"new"  # match: swapped
    assert store.get("cs") == b"new"
    assert store.compare_set("cs", "", "other") == b"new"  # empty expected is a mismatch here
    assert store.get("cs") == b"new"


def test_compare_set_on_a_missing_key(store: dist.Store) -> None:
    assert store.compare_set("absent", "expected", "desired") == b"expected"  # nothing written
    assert store.check(["absent"]) is False
    assert store.compare_set("absent", "", "created") == b"created"  # empty expected: create
    assert store.get("absent") == b"created"


def test_multi_set_and_multi_get_keep_order(store: dist.Store) -> None:
    store.multi_set(["a", "b", "c"], ["1", b"2", "3"])
    assert store.multi_get(["c", "a", "b"]) == [b"3", b"1", b"2"]


def test_check_is_true_only_when_every_key_exists(store: dist.Store) -> None:
    assert store.check(["x"]) is False
    store.set("x", "1")
    assert store.check(["x"]) is True
    assert store.check(["x", "y"]) is False


def test_num_keys_counts_what_was_set(store: dist.Store) -> None:
    assert store.num_keys() == 0
    for i in range(3):
        store.set(f"k{i}", "v")
    store.add("n", 1)
    assert store.num_keys() == 4


def test_delete_key(store: dist.Store) -> None:
    store.set("gone", "v")
    store.set("kept", "v")
    assert store.delete_key("gone") is True
    assert store.check(["gone"]) is False
    assert store.delete_key("gone") is False  # already gone
    assert store.num_keys() == 1


def test_append_creates_then_extends(store: dist.Store) -> None:
    store.append("log", "ab")
    store.append("log", b"cd")
    assert store.get("log") == b"abcd"


def test_wait_returns_once_another_writer_sets(store: dist.Store, etcd_client: EtcdClient, run_id: str) -> None:
    writer = EtcdV3Store(etcd_client, f"/test/{run_id}/store", StateSigner(KEY))
    key = "late" if isinstance(store, EtcdV3Store) else "round1/late"
    timer = threading.Timer(0.2, writer.set, args=(key, "here"))
    timer.start()
    try:
        store.wait(["late"], TIMEOUT)
    finally:
        timer.cancel()
    assert store.get("late") == b"here"


def test_wait_timeout_is_a_store_error_that_says_timeout(store: dist.Store) -> None:
    started = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="timeout") as caught:
        store.wait(["never"], SHORT)
    assert time.monotonic() - started >= SHORT.total_seconds() * 0.9  # it did wait
    assert "never" in str(caught.value)
    assert isinstance(caught.value, RuntimeError)  # what torch's callers catch


def test_set_timeout_bounds_get_and_wait(store: dist.Store) -> None:
    store.set_timeout(SHORT)
    assert store.timeout == SHORT
    started = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="timeout"):
        store.get("never")
    with pytest.raises(dist.DistStoreError, match="timeout"):
        store.wait(["never"])
    with pytest.raises(dist.DistStoreError, match="timeout"):
        store.multi_get(["never"])
    assert time.monotonic() - started < 3 * SHORT.total_seconds() + 5  # bounded, not TIMEOUT each


def test_has_extended_api(store: dist.Store) -> None:
    assert store.has_extended_api() is True


def test_clone_shares_data_but_not_timeout(store: dist.Store) -> None:
    twin = store.clone()
    assert twin is not store
    twin.set("from-twin", "1")
    store.set("from-original", "2")
    assert store.get("from-twin") == b"1"
    assert twin.get("from-original") == b"2"
    assert twin.add("counter", 2) == 2 and store.add("counter", 3) == 5
    twin.set_timeout(SHORT)
    assert store.timeout == TIMEOUT  # set_timeout on the clone leaves the original alone


def test_queues_are_refused_by_name(store: dist.Store) -> None:
    """Neither torch's rendezvous nor gloo use queues; a clear refusal, never a crash."""
    for call in (lambda: store.queue_push("q", "v"), lambda: store.queue_pop("q"), lambda: store.queue_len("q")):
        with pytest.raises(NotImplementedError, match="queue"):
            call()


# -- what only the store itself or only the wrapper shows ----------------------------------
def test_prefix_store_writes_under_its_prefix(base: EtcdV3Store) -> None:
    wrapped = dist.PrefixStore("round1", base)
    wrapped.set("MASTER_ADDR", "10.0.0.1")
    assert base.get("round1/MASTER_ADDR") == b"10.0.0.1"
    assert base.check(["MASTER_ADDR"]) is False
    assert wrapped.delete_key("MASTER_ADDR") is True
    assert base.check(["round1/MASTER_ADDR"]) is False


def test_queue_refusals_name_the_operation(base: EtcdV3Store) -> None:
    for name, call in (("queue_push", lambda: base.queue_push("q", "v")), ("queue_pop", lambda: base.queue_pop("q")),
                       ("queue_len", lambda: base.queue_len("q"))):
        with pytest.raises(NotImplementedError, match=name):
            call()


def test_list_keys_directly_and_torch_refusal_through_the_wrapper(base: EtcdV3Store) -> None:
    base.multi_set(["b", "a/x"], ["1", "2"])
    assert base.list_keys() == ["a/x", "b"]
    with pytest.raises(NotImplementedError, match="listKeys"):  # torch does not forward it
        dist.PrefixStore("p", base).list_keys()


def test_clone_made_by_torch_outlives_its_python_reference(base: EtcdV3Store) -> None:
    """torch's group split/shrink call ``PrefixStore(...).clone()``: the clone comes back to
    C++ only, and must still work after Python collects everything it could."""
    twin = dist.PrefixStore("round1", base).clone()
    gc.collect()
    twin.set("k", "v")
    assert twin.get("k") == b"v"
    assert base.get("round1/k") == b"v"
    assert twin.num_keys() == 1


def test_torch_builds_a_gloo_group_on_it(base: EtcdV3Store) -> None:
    """What the store is for: torch's own process-group bootstrap over it."""
    group_store = dist.PrefixStore("pg", base)
    dist.init_process_group("gloo", store=group_store, rank=0, world_size=1, timeout=TIMEOUT)
    try:
        tensor = torch.ones(3)
        dist.all_reduce(tensor)
        dist.barrier()
        assert tensor.tolist() == [1.0, 1.0, 1.0]
    finally:
        dist.destroy_process_group()


# -- the backend factory -----------------------------------------------------------------
def _params(endpoint: str, run_id: str, **config: str) -> RendezvousParameters:
    return RendezvousParameters(backend="etcd-v3-dynamic", endpoint=endpoint, run_id=run_id,
                                min_nodes=1, max_nodes=1, **config)


def test_factory_raises_torchs_connection_error_when_etcd_is_unreachable() -> None:
    started = time.monotonic()  # free_port: nothing must listen there, so no bind race to lose (issue 40)
    with pytest.raises(RendezvousConnectionError) as caught:
        create_backend(_params(f"127.0.0.1:{free_port()}", "unreachable", connect_timeout="1"))
    assert time.monotonic() - started < 10
    message = str(caught.value)
    assert "did not answer" in message and "check that etcd is running" in message  # our line, kept
    assert isinstance(caught.value.__cause__, EtcdUnavailableError)


@pytest.mark.parametrize("backend", ["etcd-v3-dynamic", "etcd-v3"])
def test_the_handler_factories_raise_torchs_connection_error_when_etcd_is_unreachable(
        backend: str, capsys: pytest.CaptureFixture[str]) -> None:
    """torch's dynamic-rendezvous test expects this type from the factory torch calls; on the
    command line the same error still ends the process with one line and exit 2."""
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    from agent.rendezvous.dynamic import create_dynamic_handler

    # free_port: nothing must listen there, so no bind race to lose (issue 40)
    params = RendezvousParameters(backend=backend, endpoint=f"127.0.0.1:{free_port()}", run_id="unreachable",
                                  min_nodes=1, max_nodes=1, connect_timeout="1")
    with pytest.raises(RendezvousConnectionError) as caught:
        get_rendezvous_handler(params)
    assert isinstance(caught.value, SystemExit) and caught.value.code == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith(f"error: {backend} rendezvous: ") \
        and "did not answer" in errors[0], errors
    if backend == "etcd-v3-dynamic":
        with pytest.raises(RendezvousConnectionError) as direct:
            create_dynamic_handler(params)
        assert isinstance(direct.value.__cause__, EtcdUnavailableError)


def test_factory_returns_a_working_backend_and_store(etcd_server: EmbeddedEtcd, run_id: str) -> None:
    backend, store = create_backend(_params(etcd_server.endpoint, run_id, key_prefix="/test"))
    assert isinstance(backend, EtcdV3RendezvousBackend) and isinstance(store, EtcdV3Store)
    assert backend.get_state() is None
    store.set("MASTER_PORT", "29500")
    assert store.get("MASTER_PORT") == b"29500"
