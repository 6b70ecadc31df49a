"""What the agent's watches may do with the rendezvous: a narrow session, never the handler.

The straggler, freeze, command, goodput and SDC watches (``agent/node``) each need a little
of the etcd-v3 rendezvous: the run's keys, signed reads and writes of their own records,
this node's registry record, every node's, reach reports and how fresh this node's lease
is. They get a :class:`RendezvousSession` and nothing else, so that the handler's round
protocol (its fields, its private members) stays its own and a watch can be tested against
any object that answers these few calls.
:class:`EtcdSession` is the one implementation, over :class:`.handler.EtcdV3RendezvousHandler`.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Mapping, Protocol

from agent.etcd import EtcdError
from agent.etcd.mirror import Entry
from agent.rendezvous.keepout import ReachReport
from agent.rendezvous.registry import NodeRecord, list_nodes
from agent.rendezvous.signing import StateSigner

if TYPE_CHECKING:
    from agent.rendezvous.handler import EtcdV3RendezvousHandler

log = logging.getLogger("elastic.agent")


class RendezvousSession(Protocol):
    """See the module doc. Reads of ``entries``/``node_records`` cost no etcd request (the
    run's watch-fed mirror); the writes and :meth:`live_nodes` are one request each and raise
    :class:`agent.etcd.EtcdError` (or etcd3's own) when etcd does not answer."""

    @property
    def key_prefix(self) -> str: ...

    @property
    def run_id(self) -> str: ...

    @property
    def signer(self) -> StateSigner:
        """Seals what a watch writes and opens what it reads (the job's key)."""

    def entries(self) -> Mapping[str, Entry]:
        """Every key of the run as the mirror holds it now."""

    @property
    def healthy(self) -> bool:
        """Whether the mirror follows etcd (False: etcd is away, its picture may be stale)."""

    def node_records(self) -> Mapping[str, NodeRecord]:
        """Every live node's registry record, from the mirror."""

    def live_nodes(self) -> list[str]:
        """Every node holding a live lease in the run, read from etcd now."""

    def publish(self, **fields: Any) -> None:
        """Write ``fields`` into this node's registry record (only on a change)."""

    def put_signed(self, key: str, payload: bytes, deadline: float) -> None:
        """Seal ``payload`` for ``key`` and put it."""

    def swap_signed(self, key: str, payload: bytes, revision: int | None, deadline: float) -> tuple[bool, int]:
        """Seal and put ``payload`` in one transaction, only if ``key`` stands at ``revision``
        (0: absent; None: whatever it holds). Returns (it took, the revision it took at)."""

    def delete(self, key: str, deadline: float) -> None: ...

    def lease_fresh(self, within: float) -> bool:
        """Whether this node's lease is not suspect and a keep-alive was confirmed within
        ``within`` of its TTL (a node that may itself be the cut-off one judges no peer)."""

    def record_reach(self, report: ReachReport) -> bool:
        """Put this node's reach report (under its lease); False if etcd refused it."""

    def reach_entries(self, fresh: bool = False) -> Mapping[str, Entry]:
        """The entries to read reach reports from: the mirror's, or with ``fresh`` (and etcd
        answering) the reports' keys as etcd holds them now (the mirror's if it fails to answer)."""

    def reach_reports(self, entries: Mapping[str, Entry], round_number: int) -> list[ReachReport]:
        """The verified reach reports for ``round_number`` among ``entries``."""


class EtcdSession:
    """:class:`RendezvousSession` over the etcd-v3 handler (or anything with its ``options``,
    ``run_id``, ``signer``, ``client``, ``mirror``, ``lease`` and ``node_records``)."""

    def __init__(self, handler: "EtcdV3RendezvousHandler") -> None:
        self._h = handler

    @property
    def key_prefix(self) -> str:
        return str(self._h.options.key_prefix)

    @property
    def run_id(self) -> str:
        return str(self._h.run_id)

    @property
    def signer(self) -> StateSigner:
        return self._h.signer

    def entries(self) -> Mapping[str, Entry]:
        return self._h.mirror.entries()[0]

    @property
    def healthy(self) -> bool:
        return bool(self._h.mirror.healthy)

    def node_records(self) -> Mapping[str, NodeRecord]:
        return self._h.node_records()

    def live_nodes(self) -> list[str]:
        return [n.node for n in list_nodes(self._h.client, self.run_id, self.signer, self.key_prefix)]

    def publish(self, **fields: Any) -> None:
        self._h.lease.update(**fields)

    def put_signed(self, key: str, payload: bytes, deadline: float) -> None:
        body = self.signer.seal(key.encode(), payload)
        self._h.client.call(lambda c: c.put(key, body), deadline=deadline)

    def swap_signed(self, key: str, payload: bytes, revision: int | None, deadline: float) -> tuple[bool, int]:
        from etcd3 import transactions as tx

        from agent.etcd.kv import transact

        value = self.signer.seal(key.encode(), payload)
        guard = [] if revision is None else [tx.Version(key) == 0 if revision == 0 else tx.Mod(key) == revision]
        result = transact(self._h.client, guard, [tx.Put(key, value)], deadline=deadline)
        return bool(result.succeeded), int(result.revision)

    def delete(self, key: str, deadline: float) -> None:
        self._h.client.call(lambda c: c.delete(key), deadline=deadline)

    def lease_fresh(self, within: float) -> bool:
        lease = self._h.lease
        if lease.suspect_lost():
            return False
        age = lease.clock().age(time.monotonic())
        return age is not None and age < within * lease.ttl

    def record_reach(self, report: ReachReport) -> bool:
        return bool(self._h.reachability.record(report))

    def reach_entries(self, fresh: bool = False) -> Mapping[str, Entry]:
        entries = self.entries()
        if fresh and self.healthy:  # etcd answers: no request may wait on an outage
            prefix = self._h.reachability.reach_prefix
            try:
                reply = self._h.client.call(lambda c: c.get_prefix_response(prefix), deadline=1.0)
                entries = {kv.key.decode(): Entry(kv.value, kv.mod_revision, kv.create_revision, kv.lease)
                           for kv in reply.kvs}
            except EtcdError as exc:
                log.debug("[%s] cannot read the reach reports: %s", self._h.node, exc)
        return entries

    def reach_reports(self, entries: Mapping[str, Entry], round_number: int) -> list[ReachReport]:
        return self._h.reachability.reports(entries, round_number)


__all__ = ["EtcdSession", "RendezvousSession"]
