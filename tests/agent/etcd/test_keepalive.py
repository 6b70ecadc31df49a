"""Keep-alives on a real 3-member etcd cluster whose member in use freezes or loses its leader.

A keep-alive must not wait on the one member it asked: the node's own clock stops its
workers about 2.25 s after its last confirmed keep-alive (TTL 3 s), and the cluster's
other members can answer at once. Each test gives a request to one member far more time
(``attempt`` 5 s) than the refresh should take, so a sender that waited on that member
would be seen at once. Members are real etcd processes (tests/support/etcd_cluster.py);
frozen means SIGSTOP, cut off means blackholed routes to its peers.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from agent.etcd import EtcdClient, EtcdUnavailableError
from agent.etcd.keepalive import KeepAlive
from tests.support.etcd_cluster import MEMBERS, EtcdCluster
from tests.support.waiting import wait_until

PATIENT_ATTEMPT = 5.0  # what waiting on the member in use would cost


def follower(cluster: EtcdCluster) -> str:
    leader = cluster.wait_for_leader(30)
    return next(m for m in MEMBERS if m != leader)


@pytest.mark.slow  # starts processes
def test_a_frozen_member_costs_a_keep_alive_the_hedge_delay_not_the_attempt(cluster: EtcdCluster) -> None:
    victim = follower(cluster)  # the cluster keeps its leader: only the member in use is gone
    client = EtcdClient(cluster.settings(timeout=2.0), retry_deadline=5.0)
    sender = KeepAlive(client, first=cluster.members[victim].endpoint)
    lease = client.call(lambda c: c.lease(3))
    process = cluster.members[victim].process
    assert process is not None
    os.kill(process.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        ttl = sender.refresh(lease.id, timeout=6.0, attempt=PATIENT_ATTEMPT)
        took = time.monotonic() - started
    finally:
        os.kill(process.pid, signal.SIGCONT)
        sender.close()
        client.close()
    assert ttl > 0, "etcd did not confirm a live lease"
    assert sender.preferred != cluster.members[victim].endpoint, "the next keep-alive would ask the frozen member first"
    assert took < PATIENT_ATTEMPT / 2, f"the keep-alive waited {took:.2f} s on the frozen member"


@pytest.mark.slow  # starts processes
def test_a_member_without_a_leader_sends_the_keep_alive_elsewhere_at_once(cluster: EtcdCluster) -> None:
    victim = follower(cluster)
    client = EtcdClient(cluster.settings(timeout=2.0), retry_deadline=5.0)
    sender = KeepAlive(client, first=cluster.members[victim].endpoint)
    lease = client.call(lambda c: c.lease(3))
    try:
        cluster.isolate(victim)
        wait_until(lambda: cluster.leader([victim]) is None, 30, f"{victim} to lose its leader")
        started = time.monotonic()
        ttl = sender.refresh(lease.id, timeout=6.0, attempt=PATIENT_ATTEMPT)
        took = time.monotonic() - started
    finally:
        sender.close()
        client.close()
    assert ttl > 0
    assert sender.preferred != cluster.members[victim].endpoint
    assert took < PATIENT_ATTEMPT / 2, f"the keep-alive took {took:.2f} s"


@pytest.mark.slow  # starts processes
def test_a_lease_etcd_no_longer_has_is_reported_gone_not_unreachable(cluster: EtcdCluster) -> None:
    client = EtcdClient(cluster.settings(timeout=2.0), retry_deadline=5.0)
    sender = KeepAlive(client)
    try:
        lease = client.call(lambda c: c.lease(3))
        assert sender.refresh(lease.id, timeout=2.0, attempt=1.0) > 0
        client.call(lambda c: c.revoke_lease(lease.id))
        assert sender.refresh(lease.id, timeout=2.0, attempt=1.0) == 0
    finally:
        sender.close()
        client.close()


@pytest.mark.slow  # starts processes
def test_a_keep_alive_after_close_fails_as_unreachable_not_with_a_crash(cluster: EtcdCluster) -> None:
    """The lease's own thread may be mid-refresh when the agent revokes the lease."""
    client = EtcdClient(cluster.settings(timeout=2.0), retry_deadline=5.0)
    sender = KeepAlive(client)
    try:
        lease = client.call(lambda c: c.lease(3))
        sender.close()
        with pytest.raises(EtcdUnavailableError):
            sender.refresh(lease.id, timeout=1.0, attempt=0.5)
    finally:
        client.close()
