"""``elastic sd`` against a real etcd: the targets are the registry's live nodes, nothing else.

The nodes are real registry entries (``NodeLease`` under real leases) written by this
test instead of by agents; their metrics URLs point nowhere, since sd never scrapes them.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from agent.tools.etcd_args import EtcdTarget
from agent.tools.sd import SdServer, target_group
from agent.etcd import EmbeddedEtcd, EtcdClient, free_port
from agent.rendezvous.registry import NodeLease, NodeRecord, nodes_prefix
from agent.rendezvous.signing import StateSigner
from tests.support.waiting import wait_until

KEY = b"0123456789abcdef0123456789abcdef"


def fetch(url: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=10) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.fixture
def register(etcd_client: EtcdClient, run_id: str) -> Iterator[Callable[..., NodeLease]]:
    """Register nodes of ``run_id`` as agents do; every lease is revoked at the end."""
    leases: list[NodeLease] = []

    def start(node: str, metrics_url: str | None, run: str = run_id) -> NodeLease:
        record = NodeRecord(node=node, host="127.0.0.1", pid=1, metrics_url=metrics_url, state="healthy")
        lease = NodeLease(etcd_client, "/elastic", run, record, StateSigner(KEY), ttl=5).start()
        leases.append(lease)
        return lease

    try:
        yield start
    finally:
        for lease in leases:
            lease.close()


@pytest.fixture
def sd(etcd_client: EtcdClient, run_id: str) -> Iterator[str]:
    """An in-process ``elastic sd`` on a free loopback port; yields its base URL."""
    server = SdServer(EtcdTarget(etcd_client, StateSigner(KEY), "/elastic", run_id), "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.port}"
    finally:
        server.shutdown()
        server.server_close()


def test_targets_are_the_live_nodes_with_metrics(register: Callable[..., NodeLease], sd: str, run_id: str,
                                                 etcd_client: EtcdClient) -> None:
    register("node-a", "http://127.0.0.1:9101/metrics")
    leaving = register("node-b", "http://127.0.0.1:9102/metrics")
    register("node-c", None)  # registered, but serves no metrics: not a target
    register("node-x", "http://127.0.0.1:9109/metrics", run=run_id + "-other")  # another job
    # A value nobody holding the job key wrote: dropped, not listed.
    forged = NodeRecord(node="evil", host="203.0.113.9", pid=1, metrics_url="http://203.0.113.9:1/metrics")
    etcd_client.call(lambda c: c.put(nodes_prefix("/elastic", run_id) + "evil",
                                     StateSigner(b"another-key-another-key-another!!").seal(b"x", forged.to_json())))

    status, groups = fetch(sd + "/targets")
    assert status == 200
    assert groups == [
        {"targets": ["127.0.0.1:9101"], "labels": {"node": "node-a", "run_id": run_id}},
        {"targets": ["127.0.0.1:9102"], "labels": {"node": "node-b", "run_id": run_id}},
    ]

    leaving.close()  # the node leaves: its lease is revoked and its key goes with it
    assert [g["labels"]["node"] for g in fetch(sd + "/targets")[1]] == ["node-a"]

    status, other = fetch(sd + f"/targets?run_id={run_id}-other")
    assert status == 200 and [g["labels"] for g in other] == [{"node": "node-x", "run_id": run_id + "-other"}]
    assert fetch(sd + "/targets?run_id=../../x")[0] == 400
    assert fetch(sd + "/nothing")[0] == 404


def test_path_and_scheme_travel_as_prometheus_labels() -> None:
    record = NodeRecord(node="n", host="h", pid=1, metrics_url="https://gpu-1.example:9464/custom")
    assert target_group(record, "r") == {
        "targets": ["gpu-1.example:9464"],
        "labels": {"node": "n", "run_id": "r", "__metrics_path__": "/custom", "__scheme__": "https"},
    }
    assert target_group(NodeRecord(node="n", host="h", pid=1, metrics_url="gpu-1:9464"), "r") is None


def test_cli_serves_until_killed(etcd_server: EmbeddedEtcd, register: Callable[..., NodeLease], run_id: str,
                                 tmp_path: Path) -> None:
    register("node-a", "http://127.0.0.1:9101/metrics")
    key_file = tmp_path / "job.key"
    key_file.write_bytes(KEY)
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent.tools.sd", "--port", "0", "--rdzv-endpoint", etcd_server.endpoint,
         "--rdzv-id", run_id, "--rdzv-conf", f"hmac_key_file={key_file}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
    )
    try:
        assert proc.stdout is not None
        banner = proc.stdout.readline()  # "elastic sd: serving ... at http://127.0.0.1:PORT/targets ..."
        assert "serving Prometheus http_sd targets at" in banner, proc.stderr.read() if proc.stderr else ""
        url = banner.split(" at ")[1].split()[0]
        status, groups = wait_until(lambda: fetch(url), 10, "elastic sd to answer")
        assert status == 200 and [g["labels"]["node"] for g in groups] == ["node-a"]
    finally:
        proc.kill()
        proc.wait(timeout=10)


@pytest.mark.slow  # starts processes
def test_unreachable_etcd_is_one_error_line() -> None:
    # free_port: nothing must listen there, so no bind race to lose (issue 40)
    done = subprocess.run(
        [sys.executable, "-m", "agent.tools.sd", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "r",
         "--rdzv-conf", "connect_timeout=1"],
        capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert lines[-1].startswith("error: etcd at http://127.0.0.1:") and "Traceback" not in done.stderr, done.stderr
