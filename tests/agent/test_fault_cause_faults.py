"""Faults named by kind with real faults: a worker that hits a full disk (a real 4 MiB tmpfs,
filled until the kernel says ENOSPC) and a node whose etcd lease was lost (its agent frozen
with SIGSTOP past the lease TTL). What is checked is what an operator reads: the agent's
line, the node's registry record and the note ``elastic top`` shows for it."""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path
from typing import Callable, Iterator

import pytest

from agent.tools.top import scrape
from agent.etcd import EmbeddedEtcd, EtcdClient
from agent.rendezvous.registry import NodeRecord, list_nodes
from agent.rendezvous.signing import StateSigner
from tests.support.nodes import TorchrunNode as Node
from tests.support.waiting import wait_until

SCRIPT = textwrap.dedent('''\
    import os, sys, time
    if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":  # the first start writes to the full disk
        with open(os.path.join(sys.argv[1], "out.bin"), "wb") as f:
            f.write(b"\\0" * (1 << 20))
            f.flush()
            os.fsync(f.fileno())
    while True:  # the next one trains on
        time.sleep(1)
''')


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "disk"
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(path)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        with open(path / "filler", "wb") as f:
            try:
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
            except OSError:
                pass
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def _record(client: EtcdClient, run_id: str, name: str) -> NodeRecord | None:
    return next((r for r in list_nodes(client, run_id, StateSigner(None)) if r.node == name), None)


def _fault(client: EtcdClient, run_id: str, name: str) -> str:
    record = _record(client, run_id, name)
    return str(record.extra.get("fault", "")) if record is not None else ""


@pytest.mark.slow
def test_a_worker_that_hit_a_full_disk_is_named_so(
    etcd_server: EmbeddedEtcd, etcd_client: EtcdClient, run_id: str, nodes: Callable[..., Node], tmp_path: Path,
    full_disk: Path
) -> None:
    script = tmp_path / "write.py"
    script.write_text(SCRIPT)
    node = nodes(name="a", endpoint=etcd_server.endpoint, run_id=run_id, script=str(script), nnodes="1",
                 module_args=[str(full_disk)], agent_args=["--lease-ttl", "2"])
    wait_until(lambda: "restart (worker_failed)" in node.log_path.read_text(errors="replace"), 90,
               "the restart", on_timeout=node.log_tail)
    log = node.log_path.read_text(errors="replace")
    assert 'failed (exit 1) with "disk full (ENOSPC): OSError: [Errno 28] No space left on device' in log, log[-3000:]
    fault = wait_until(lambda: _fault(etcd_client, run_id, "a"), 30, "the record's fault", on_timeout=node.log_tail)
    assert fault.startswith("disk full (ENOSPC): OSError: [Errno 28]"), fault
    record = _record(etcd_client, run_id, "a")
    assert record is not None and scrape(record).note.startswith("last fault: disk full (ENOSPC)")


@pytest.mark.slow
def test_a_node_whose_lease_was_lost_says_so(
    etcd_server: EmbeddedEtcd, etcd_client: EtcdClient, run_id: str, nodes: Callable[..., Node]
) -> None:
    node = nodes(name="a", endpoint=etcd_server.endpoint, run_id=run_id, nnodes="1",
                 module_args=["--step-time", "0.05", "--progress", "{progress}"],
                 agent_args=["--lease-ttl", "2"])
    wait_until(lambda: node.progress(), 90, "training", on_timeout=node.log_tail)
    node.freeze()  # the agent and its workers, for three lease TTLs: etcd lets the lease expire
    try:
        wait_until(lambda: _record(etcd_client, run_id, "a") is None, 30, "the lease to expire")
    finally:
        node.thaw()
    wait_until(lambda: "restart (lease_lost)" in node.log_path.read_text(errors="replace"), 60,
               "the agent to see its lease lost", on_timeout=node.log_tail)
    fault = wait_until(lambda: _fault(etcd_client, run_id, "a"), 30, "the record's fault", on_timeout=node.log_tail)
    assert fault.startswith("etcd lease lost: "), fault
    record = _record(etcd_client, run_id, "a")
    assert record is not None and scrape(record).note.startswith("last fault: etcd lease lost")
