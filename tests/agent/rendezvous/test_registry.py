"""The node lease against a real etcd: what counts as this node having been frozen."""

from __future__ import annotations

import time

from agent.etcd import EtcdClient
from agent.rendezvous.registry import NodeLease, NodeRecord
from agent.rendezvous.signing import StateSigner


def test_a_lease_started_long_after_it_was_built_is_not_mistaken_for_a_freeze(etcd_client: EtcdClient,
                                                                             run_id: str) -> None:
    # An agent builds its rendezvous handler (and lease) at start-up but joins later, for
    # instance after waiting for its standby workers. That wait is not a freeze: the
    # freeze clock must start with the keep-alive thread. Found as a false "lease lost"
    # that cost a scale-up an extra round.
    lease = NodeLease(etcd_client, "/elastic", run_id, NodeRecord(node="late", host="127.0.0.1", pid=1),
                      StateSigner(None), ttl=2)
    time.sleep(2.5)  # the scenario itself: longer than the TTL between building and starting
    lease.start()
    try:
        assert not lease.suspect_lost()
    finally:
        lease.close()


def test_a_keep_alive_thread_that_did_not_run_for_a_ttl_is_a_freeze(etcd_client: EtcdClient, run_id: str) -> None:
    lease = NodeLease(etcd_client, "/elastic", run_id, NodeRecord(node="frozen", host="127.0.0.1", pid=1),
                      StateSigner(None), ttl=2).start()
    try:
        lease._last_tick -= 2.5  # as the thread would find it after a 2.5 s SIGSTOP
        assert lease.suspect_lost()
    finally:
        lease.close()
