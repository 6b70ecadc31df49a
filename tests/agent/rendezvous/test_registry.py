"""The node lease against a real etcd: what counts as this node having been frozen."""

from __future__ import annotations

import time

import pytest
from etcd3 import transactions as tx

from agent.etcd import EtcdClient, EtcdError
from agent.etcd.kv import transact
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


def test_a_stopped_lease_is_never_granted_again_by_a_later_write(etcd_client: EtcdClient, run_id: str) -> None:
    """A node whose lease stopped (closed, or a frozen agent's keep-alive) must not come back
    through another thread's write: the steward's slot claim once re-granted it and rewrote
    the node's record, so peers counted a node alive that was gone (redteam test_forged_state)."""
    lease = NodeLease(etcd_client, "/elastic", run_id, NodeRecord(node="gone", host="127.0.0.1", pid=1),
                      StateSigner(None), ttl=5)
    lease.start()
    lease._stop.set()  # its keep-alive stops, as a frozen agent's would
    expired = lease.lease_id()
    etcd_client.call(lambda c: c.revoke_lease(expired))  # its lease runs out (at once, not a TTL later)
    slot = f"/elastic/{run_id}/rdzv/steward/0"
    with pytest.raises(EtcdError):
        lease.write(lambda lease_id: transact(etcd_client, [], [tx.Put(slot, b"x", lease=lease_id)]))
    assert etcd_client.call(lambda c: c.get(lease.key))[0] is None, "the stopped node registered again"
    assert etcd_client.call(lambda c: c.get(slot))[0] is None
    lease.close()
