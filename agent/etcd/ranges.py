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
from typing import Any, Sequence

from etcd3 import transactions as tx
from etcd3.utils import prefix_range_end, to_bytes

from agent.etcd.client import EtcdClient, EtcdError
from agent.etcd.kv import transact
from agent.etcd.mirror import Entry, PrefixMirror

log = logging.getLogger(__name__)


class RangesMirror(PrefixMirror):
    """``keys``: single keys; ``prefixes``: key prefixes (each one small)."""

    def __init__(self, client: EtcdClient, keys: Sequence[str], prefixes: Sequence[str]) -> None:
        super().__init__(client, prefixes[0] if prefixes else keys[0])
        self.keys, self.prefixes = tuple(keys), tuple(prefixes)
        self._watch_ids: list[Any] = []

    def _ranges(self) -> list[tuple[str, bytes | None]]:
        return [(k, None) for k in self.keys] + [(p, prefix_range_end(to_bytes(p))) for p in self.prefixes]

    def _sync(self, deadline: float | None = None) -> None:
        self._cancel_watches()
        ranges = self._ranges()
        result = transact(self.client, [], [tx.Get(key, end) for key, end in ranges], deadline=deadline)
        entries = {meta.key.decode(): Entry(value, meta.mod_revision, meta.create_revision, meta.lease_id)
                   for rows in result.responses for value, meta in rows}
        with self._cond:
            self._entries, self.revision, self.healthy = entries, result.revision, True
            self._cond.notify_all()
        self._tell_listeners()
        ids = []
        for key, end in ranges:
            kwargs: dict[str, Any] = {"start_revision": result.revision + 1}
            if end is not None:
                kwargs["range_end"] = end
            ids.append(self._watch(key, kwargs, deadline))
        self._watch_ids = ids

    def _watch(self, key: str, kwargs: dict[str, Any], deadline: float | None) -> Any:
        return self.client.call(lambda c: c.add_watch_callback(key, self._on_watch, **kwargs), deadline=deadline)

    def _cancel_watches(self) -> None:
        ids, self._watch_ids = self._watch_ids, []
        for watch_id in ids:
            self._cancel(watch_id)

    def _cancel(self, watch_id: Any) -> None:
        try:
            self.client.call(lambda c: c.cancel_watch(watch_id), deadline=1.0)
        except EtcdError:
            pass

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._cancel_watches()
