"""A node's round writes against a real etcd, when the reply to a committed write is lost.

When the etcd leader dies under a transaction, etcd may have committed it while the client
sees only a broken connection, and the client retries. Opening a round guards on the round
record's revision, so the retry fails on the node's own write: the node must still know it
opened and joined the round (before, it took the round for someone else's, and when that
round closed with it inside, it opened the next one: a whole extra round for every member,
test_etcd_cluster_faults' "leader killed while a round is open"). The lost reply is the one
thing injected (one attempt raises after the real request ran); etcd and the retries are real.
"""

from __future__ import annotations

from typing import Any, Callable

import etcd3.exceptions as etcd_exc

from agent.etcd import EmbeddedEtcd, EtcdClient
from agent.rendezvous.mirror_view import RoundKeys
from agent.rendezvous.registry import NodeLease, NodeRecord
from agent.rendezvous.round_writes import RoundWriter
from agent.rendezvous.rounds import OPEN, RoundRecord
from agent.rendezvous.signing import StateSigner


class LosesOneReply(EtcdClient):
    """Once armed, the next request runs in etcd and then fails as a dropped connection would."""

    armed = False

    def call(self, request: Callable[[Any], Any], *, deadline: float | None = None) -> Any:
        def attempt(c: Any) -> Any:
            result = request(c)
            if self.armed:
                self.armed = False
                raise etcd_exc.ConnectionFailedError("the leader died before it answered")
            return result
        return super().call(attempt, deadline=deadline)


def test_a_round_opened_whose_reply_was_lost_is_known_as_opened_and_joined(
        etcd_server: EmbeddedEtcd, run_id: str) -> None:
    client = LosesOneReply(etcd_server.settings(), retry_deadline=5.0)
    signer = StateSigner(b"k" * 32)
    keys = RoundKeys.of("/elastic", run_id)
    lease = NodeLease(client, "/elastic", run_id, NodeRecord(node="c", host="h", pid=1), signer, ttl=5)
    try:
        lease.start()
        writer = RoundWriter("c", client, signer, keys, lease)
        assert writer.swap(0, RoundRecord(0, OPEN))
        _value, meta = client.call(lambda c: c.get(keys.round))
        client.armed = True
        revision = writer.open_and_join(meta.mod_revision, RoundRecord(0, OPEN).next_open(), None)
        assert not client.armed, "the injected loss did not happen"
        join, join_meta = client.call(lambda c: c.get(keys.join(1, "c")))
        assert join is not None and revision == join_meta.mod_revision, \
            "the node does not know that its own committed open-and-join went through"
        assert writer.newest_round() == 1
        # a real race lost still says so: the record moved on without our join
        _value, meta = client.call(lambda c: c.get(keys.round))
        assert writer.swap(meta.mod_revision, RoundRecord(1, OPEN).next_open())
        assert writer.open_and_join(meta.mod_revision, RoundRecord(2, OPEN), 1) is None
    finally:
        lease.close()
        client.close()
