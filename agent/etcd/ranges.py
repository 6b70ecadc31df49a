"""A mirror of a few keys and small prefixes, not of a whole prefix: what one node must hear.

:class:`.mirror.PrefixMirror` over a run's whole prefix makes every node hear every peer's
writes (its registry record, its joins, its store keys): O(N) events per node and O(N^2)
through etcd per round. A rendezvous member only needs a handful of keys (the round
record, the job's end, its own registry key) and a few prefixes that stay small (who
stewards the rounds, keep-outs and reachability reports, written only after a failure).
:class:`RangesMirror` reads them all in one transaction, so its picture is of one
revision, then watches each from the revision after it; the rest of the interface is
:class:`.mirror.PrefixMirror`'s.
"""

from __future__ import annotations

import logging
from typing import Sequence

from etcd3 import transactions as tx
from etcd3.utils import prefix_range_end, to_bytes

from agent.etcd.client import EtcdClient
from agent.etcd.kv import transact
from agent.etcd.mirror import Entry, PrefixMirror

log = logging.getLogger(__name__)


class RangesMirror(PrefixMirror):
    """``keys``: single keys; ``prefixes``: key prefixes (each one small)."""

    def __init__(self, client: EtcdClient, keys: Sequence[str], prefixes: Sequence[str]) -> None:
        super().__init__(client, prefixes[0] if prefixes else keys[0])
        self.keys, self.prefixes = tuple(keys), tuple(prefixes)

    def _watch_ranges(self) -> list[tuple[str, bytes | None]]:
        return [(k, None) for k in self.keys] + [(p, prefix_range_end(to_bytes(p))) for p in self.prefixes]

    def _read(self, deadline: float | None) -> tuple[dict[str, Entry], int]:
        result = transact(self.client, [], [tx.Get(key, end) for key, end in self._watch_ranges()],
                          deadline=deadline)
        entries = {meta.key.decode(): Entry(value, meta.mod_revision, meta.create_revision, meta.lease_id)
                   for rows in result.responses for value, meta in rows}
        return entries, result.revision
