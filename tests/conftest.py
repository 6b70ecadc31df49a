"""Fixtures shared by every suite: a real etcd and cleanup of every process we start."""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Callable, Iterator

import pytest

from elastic import contract
from agent.etcd import EmbeddedEtcd, EtcdClient
from tests.support.netns import NodeNetwork, unavailable_reason
from tests.support.nodes import TorchrunNode
from tests.support.s3server import SeaweedS3
from tests.support.schedule import HeavyTogether, file_of, file_seconds, longest_first
from tests.support.secure_etcd import SecureEtcd, start_secure_etcd

_run_ids = itertools.count()

# Agents the tests start run the product's default: warm starts, each worker forked from its
# node's template (agent/node/fork_server.py), one torch import per node however many starts. The
# tests of the cold path pass --no-warm-start.
WARM_START_ENV = contract.flag_twin("warm_start")

# Every simulated node of every test shares this machine's cores, as `elastic local`'s nodes
# do, so their workers get its rule (agent/local/local_cluster.py): a share each, here one thread.
# With torch's default, one intra-op thread per core in every worker, their OpenMP threads
# spun against each other: the three-node demo used 112 s of CPU instead of 34 s. A test
# that is about the thread count sets its own.
os.environ.setdefault("OMP_NUM_THREADS", "1")

try:  # the same examples every run: a fuzz test that fails, fails again (never flaky)
    from hypothesis import settings as _hypothesis_settings

    _hypothesis_settings.register_profile("repeatable", derandomize=True, database=None)
    _hypothesis_settings.load_profile("repeatable")
except ImportError:  # only the red-team fuzz tests need it
    pass

# Fixtures that start a real etcd, agents, namespaces or other processes. A test that uses
# one is slow by itself, so a new test cannot slip into `make test-fast` by forgetting a
# marker; and under `make test-fast` a test that starts a process anyway fails, saying so.
SLOW_FIXTURES = frozenset({"etcd_server", "secure_etcd", "etcd_client", "nodes", "node_network", "s3_server"})
FAST_ONLY_ENV = "ELASTIC_TESTS_FAST_ONLY"


# `make test` runs on three pytest-xdist workers: each file is one unit, as under --dist
# loadfile (module fixtures stay shared), except these files, the heaviest of three or more
# real nodes, which are one unit together (tests/support/schedule.py). They run one after
# another on one worker, about a third of the suite's time, while the other two take every
# other file, slow ones first, the longest first (tests/support/file_seconds.json). Two of
# them at once put eight nodes' torch imports on 2 cores, and every timeout in both tests
# became a race. The multi-node files that mostly wait (an etcd outage, a partition, a lease
# running out) are left to the other workers.
# Only the schedule depends on this list: a file missing from it runs on the others.
HEAVY_FILES = (
    "tests/agent/test_demo.py",
    "tests/agent/test_chaos.py",
    "tests/elastic/inplace/test_inplace_recovery.py",
    "tests/agent/test_plain_scripts.py",
    "tests/elastic/inplace/test_user_collectives.py",
    "tests/elastic/inplace/test_prepare_faults.py",
    "tests/agent/test_goodput.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    slow_files = {file_of(item.nodeid) for item in items if item.get_closest_marker("slow")}
    by_seconds = longest_first(file_seconds())

    def weight(item: pytest.Item) -> tuple[int, bool, float]:
        path = file_of(item.nodeid)
        heavy = HEAVY_FILES.index(path) if path in HEAVY_FILES else len(HEAVY_FILES)
        return heavy, path not in slow_files, by_seconds(path)

    items.sort(key=weight)  # stable: within a file, and among files of equal weight, collection order


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    return HeavyTogether(config, log, HEAVY_FILES)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Under ``make test-fast``, starting a process fails the test (or its fixture); imports
    during collection may (torch probes its platform), tests may not."""
    if os.environ.get(FAST_ONLY_ENV) != "1":
        return
    import multiprocessing.process
    import subprocess

    def refuse(*args: object, **kwargs: object) -> None:
        pytest.fail("this test starts a process, so it belongs in the slow set: mark it "
                    "@pytest.mark.slow, or use a fixture from tests/conftest.py's SLOW_FIXTURES", pytrace=False)

    subprocess.Popen.__init__ = refuse  # type: ignore[method-assign]  # refused for the test: nothing may start a process
    multiprocessing.process.BaseProcess.start = refuse  # type: ignore[method-assign]  # as Popen above
    os.fork = refuse  # type: ignore[assignment]  # as Popen above
    os.posix_spawn = refuse  # type: ignore[assignment]  # as Popen above


@pytest.fixture(autouse=True)
def _environment_restored() -> Iterator[None]:
    """Each test's changes to ``os.environ`` end with it. A test that builds a world of one in
    this process sets MASTER_PORT, RANK and WORLD_SIZE; left behind, every later subprocess
    inherited that port, and two pytest-xdist workers' jobs collided on it (EADDRINUSE)."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedEtcd]:
    """One real etcd for tests that only read and write keys (each uses its own prefix)."""
    server = EmbeddedEtcd(data_dir=tmp_path_factory.mktemp("etcd"))
    server.start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedS3]:
    """One real S3-compatible server (SeaweedFS) for the session; each test uses its own bucket."""
    server = SeaweedS3(tmp_path_factory.mktemp("s3"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def secure_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureEtcd]:
    """One etcd with TLS, client-certificate auth and RBAC (certificates from deploy/certs)."""
    etcd = start_secure_etcd(tmp_path_factory.mktemp("secure"))
    try:
        yield etcd
    finally:
        etcd.server.close()


@pytest.fixture
def etcd_client(etcd_server: EmbeddedEtcd) -> Iterator[EtcdClient]:
    client = EtcdClient(etcd_server.settings(), retry_deadline=5.0)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def run_id() -> str:
    return f"run{os.getpid()}x{next(_run_ids)}"


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[Callable[..., TorchrunNode]]:
    """Start torchrun nodes; every one is killed, tree and all, when the test ends."""
    started: list[TorchrunNode] = []

    def start(**kwargs: object) -> TorchrunNode:
        node = TorchrunNode(**{"workdir": tmp_path, **kwargs})
        started.append(node)
        node.start()  # returns the node itself, typed as its base class
        return node

    try:
        yield start
    finally:
        for node in started:
            node.cleanup()


@pytest.fixture
def node_network() -> Iterator[Callable[..., NodeNetwork]]:
    """Build nodes on their own network (bridge + namespaces); removed when the test ends.

    Skips, saying why, where root or ``ip netns`` is missing (``-rs`` prints the reason).
    """
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"network namespaces unavailable: {reason}")
    built: list[NodeNetwork] = []

    def build(nodes: object = 2, **kwargs: object) -> NodeNetwork:
        network = NodeNetwork(nodes, **kwargs)
        built.append(network)
        return network.start()

    try:
        yield build
    finally:
        for network in built:
            network.close()
