"""A heal crosses the network the operator names (``ELASTIC_HEAL_IFNAME``), on real links.

Two ``elastic agent`` nodes, each in its own network namespace: ``eth0`` on the harness's
bridge (etcd, the rendezvous and the collectives) and ``heal0``, a second link straight
between them on addresses of its own, as a node's faster interface would be. Both run with
``ELASTIC_HEAL_IFNAME=heal0``. b is killed (its whole process tree) and started again; a,
the survivor, heals it in place. What a user would check: a's line names the link, the
training goes on at the step it stood on, and the link's own byte counters (the kernel's,
as ``ip -s link`` shows them) carried the state, where before the heal it carried nothing.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Iterator

import pytest

from agent.etcd import EmbeddedEtcd
from agent.local.netns import ip
from tests.support.fault_cluster import FaultCluster
from tests.support.netns import NodeNetwork, unavailable_reason
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

FORM_TIMEOUT = 240
LINK = "heal0"
ADDRS = {"a": "172.31.254.1", "b": "172.31.254.2"}  # only inside the two namespaces; gone with them


def add_link(net: NodeNetwork) -> None:
    """A veth pair straight from a's namespace to b's, ``heal0`` at both ends."""
    ip("-n", net["a"].name, "link", "add", LINK, "type", "veth", "peer", "name", LINK, "netns", net["b"].name)
    for node, addr in ADDRS.items():
        ns = net[node].name
        ip("-n", ns, "link", "set", LINK, "addrgenmode", "none")  # no IPv6 chatter on it
        ip("-n", ns, "addr", "add", f"{addr}/30", "dev", LINK)
        ip("-n", ns, "link", "set", LINK, "up")


def sent(net: NodeNetwork, node: str) -> int:
    """Bytes ``node`` sent on its heal link so far (the kernel's counter)."""
    out = ip("-n", net[node].name, "-s", "-j", "link", "show", LINK).stdout
    return int(json.loads(out)[0]["stats64"]["tx"]["bytes"])


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[FaultCluster]:
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"network namespaces unavailable: {reason}")
    with NodeNetwork(["a", "b"]) as net:
        add_link(net)
        etcd = EmbeddedEtcd(data_dir=tmp_path / "etcd", host=net.central_addr)
        etcd.start()
        job = FaultCluster(net, etcd.endpoint, tmp_path, ("a", "b"), lease_ttl=5)
        for node in job.nodes.values():
            node.env["ELASTIC_HEAL_IFNAME"] = LINK
        try:
            yield job
        finally:
            job.close()
            etcd.close()


def test_a_returning_node_is_healed_over_the_named_link(cluster: FaultCluster) -> None:
    cluster.start(["a"])
    wait_until(lambda: cluster.rows("a", 1), FORM_TIMEOUT, "a to train alone", on_timeout=cluster.logs)
    before = sent(cluster.net, "a")
    assert before < 2048, f"{before} bytes on {LINK} before any heal: something else uses it"
    cluster.start(["b"])
    wait_until(lambda: cluster.train_together(("a", "b"), 2, steps=3), FORM_TIMEOUT,
               "b to join a and train in a world of 2", on_timeout=cluster.logs)
    a_log = cluster["a"].log_path.read_text()
    assert "healing rank(s) [1] from [0] at step" in a_log and f"over {LINK}" in a_log, cluster.logs("a")
    survivor_pid = cluster.worker_pid("a")

    snapshot = max((cluster.workdir / "snapshots").glob("step-*"), default=None)
    assert snapshot is not None, cluster.logs("a")
    state = sum((snapshot / name).stat().st_size for name in ("000-model.pt", "001-optimizer.pt"))
    healed = sent(cluster.net, "a") - before
    assert healed >= state // 2, f"{LINK} carried {healed} bytes; the model and optimizer alone are {state}"

    # b killed and back: healed over the link again, a's worker the same process throughout
    cluster["b"].kill()
    killed_at = time.time()
    wait_until(lambda: cluster.rows("a", 1, after=killed_at), 90, "a to train on alone", on_timeout=cluster.logs)
    before = sent(cluster.net, "a")
    cluster.start(["b"])
    wait_until(lambda: cluster.train_together(("a", "b"), 2, steps=3, after=killed_at), FORM_TIMEOUT,
               "b back in a world of 2", on_timeout=cluster.logs)
    assert sent(cluster.net, "a") - before >= state // 2, cluster.logs("a")
    assert cluster.worker_pid("a") == survivor_pid, "the survivor's worker was restarted"
    back = cluster.rows("b", 2, after=killed_at)[0]
    alone = cluster.rows("a", 1, after=killed_at)
    assert back["step"] == alone[-1]["step"] + 1, (alone[-1], back)  # healed to where a stood, none rolled back
