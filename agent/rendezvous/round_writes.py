"""The round protocol's writes to etcd: the round record and this node's join keys.

Every write is one transaction. The round record only changes under a guard on the
revision the writer read (:meth:`RoundWriter.swap`), so of two agents racing to open or
close a round exactly one wins and the other re-reads. A join key is put under this
node's lease (:meth:`.registry.NodeLease.write`), so a node that dies while joining leaves
no ghost; opening a round and joining it go in one transaction, so the round cannot close
without its opener. Call order within a rendezvous: ``open_and_join`` or ``join``, then
``swap`` to close, then ``forget`` the round two back.
"""

from __future__ import annotations

import json
import time
from typing import Any

from etcd3 import transactions as tx

from agent.etcd import EtcdClient, EtcdError
from agent.etcd.kv import transact

from agent.rendezvous.mirror_view import RoundKeys
from agent.rendezvous.registry import NodeLease
from agent.rendezvous.rounds import RoundRecord
from agent.rendezvous.signing import SignatureError, StateSigner


class RoundWriter:
    """One node's writes to its run's round record and join keys (signed with the job key)."""

    def __init__(self, node: str, client: EtcdClient, signer: StateSigner, keys: RoundKeys, lease: NodeLease) -> None:
        self.node, self.client, self.signer, self.keys, self.lease = node, client, signer, keys, lease

    def swap(self, expected_mod_revision: int, record: RoundRecord) -> bool:
        """Replace the round record if nobody else did since we read it (0: if there is none)."""
        key = self.keys.round
        value = self.signer.seal(key.encode(), record.to_json())
        guard = tx.Version(key) == 0 if expected_mod_revision == 0 else tx.Mod(key) == expected_mod_revision
        return transact(self.client, [guard], [tx.Put(key, value)]).succeeded

    def open_and_join(self, expected_mod_revision: int, record: RoundRecord, previous_round: int | None) -> int | None:
        """Open ``record`` and put our join key in one transaction; the revision, or None if
        someone else changed the round record first."""
        key = self.keys.round
        value = self.signer.seal(key.encode(), record.to_json())
        join_key = self.keys.join(record.round, self.node)
        join_value = self._join_value(join_key)
        stale = self.keys.join(previous_round, self.node) if previous_round is not None else None
        stale = None if stale == join_key else stale

        def put(lease_id: int) -> int | None:
            ops = [tx.Put(key, value), tx.Put(join_key, join_value, lease=lease_id)]
            if stale:
                ops.append(tx.Delete(stale))
            result = transact(self.client, [tx.Mod(key) == expected_mod_revision], ops, [tx.Get(join_key)])
            if result.succeeded:
                return result.revision
            return committed_before(result.responses, join_value)

        return self.lease.write(put)

    def join(self, round_number: int, previous_round: int | None) -> int:
        """Put our join key (dropping the previous round's); returns the revision of the put."""
        key = self.keys.join(round_number, self.node)
        value = self._join_value(key)
        stale = self.keys.join(previous_round, self.node) if previous_round is not None else None

        def put(lease_id: int) -> int:
            ops = [tx.Put(key, value, lease=lease_id)]
            if stale:
                ops.append(tx.Delete(stale))
            return transact(self.client, [], ops).revision

        return self.lease.write(put)

    def _join_value(self, key: str) -> bytes:
        return self.signer.seal(key.encode(), json.dumps({"node": self.node, "t": time.time()}).encode())

    def forget(self, round_number: int) -> None:
        """Old rounds' store and join keys: nobody reads them two rounds later (best effort)."""
        if round_number < 0:
            return
        try:
            self.client.call(lambda c: c.delete_prefix(f"{self.keys.store_prefix}/round/{round_number}/"),
                             deadline=1.0)
            self.client.call(lambda c: c.delete_prefix(f"{self.keys.join_prefix}{round_number}/"), deadline=1.0)
        except EtcdError:
            pass

    def newest_round(self) -> int | None:
        """The round number etcd's round record holds now (read from etcd, before any mirror),
        or None if there is none or it does not verify."""
        raw, _ = self.client.call(lambda c: c.get(self.keys.round))
        if raw is None:
            return None
        try:
            return RoundRecord.from_json(self.signer.open(self.keys.round.encode(), raw)).round
        except (SignatureError, ValueError, KeyError, TypeError):
            return None


def committed_before(responses: list[Any], join_value: bytes) -> int | None:
    """The revision of our own join if a failed transaction found it in place: an earlier
    attempt of the same transaction committed and its reply was lost (the etcd leader died
    under it; the client retried, and the retry's guard failed on our own write). Else None.

    The join value carries its writer's clock, so no other write holds the same bytes."""
    rows = responses[0] if responses else []
    if rows and rows[0][0] == join_value:
        return int(rows[0][1].mod_revision)
    return None
