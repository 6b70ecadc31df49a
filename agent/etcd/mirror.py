"""A local, watch-fed copy of every key under one etcd prefix.

The rendezvous and the agent ask "who is alive, which round is open" many times a
second. Asking etcd each time would put an etcd round trip (and an etcd outage) on the
training hot path; a mirror answers from memory, learns of every change within
milliseconds through one watch, and says when it is stale instead of guessing.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from etcd3 import events as etcd_events

from agent.etcd.client import EtcdClient, EtcdError

log = logging.getLogger(__name__)

_RESYNC_PAUSE_S = 0.25


@dataclass(frozen=True)
class Entry:
    value: bytes
    mod_revision: int
    create_revision: int
    lease: int


class PrefixMirror:
    """``entries()`` is the prefix as of ``revision``; ``wait(after, timeout)`` blocks for news.

    While the watch is broken (etcd down, network cut) ``healthy`` is False and the
    entries are frozen at the last known revision; callers must not read a missing
    node into a frozen picture. On reconnection the mirror re-reads the whole prefix,
    so nothing that happened meanwhile is missed, compacted history or not.
    """

    def __init__(self, client: EtcdClient, prefix: str) -> None:
        self.client, self.prefix = client, prefix
        self._cond = threading.Condition()
        self._entries: dict[str, Entry] = {}
        self.revision = 0
        self.healthy = False
        self._watch_id: Any = None
        self._closed = False
        self._resyncing = False
        self._nudges = 0
        self.listeners: list[Callable[[], None]] = []  # called after every change; must not block

    def start(self, deadline: float | None = None) -> "PrefixMirror":
        self._sync(deadline)
        return self

    def entries(self) -> tuple[dict[str, Entry], int]:
        with self._cond:
            return dict(self._entries), self.revision

    def wait(self, after_revision: int, timeout: float) -> bool:
        """True once the mirror is past ``after_revision`` (or its health changed)."""
        end = time.monotonic() + timeout
        with self._cond:
            nudges = self._nudges
            while self.revision <= after_revision and not self._closed and self._nudges == nudges:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def notify(self) -> None:
        """Wake waiters, e.g. when a local decision changed what they wait for."""
        with self._cond:
            self._nudges += 1
            self._cond.notify_all()

    def _sync(self, deadline: float | None = None) -> None:
        reply = self.client.call(lambda c: c.get_prefix_response(self.prefix), deadline=deadline)
        entries = {
            kv.key.decode(): Entry(kv.value, kv.mod_revision, kv.create_revision, kv.lease) for kv in reply.kvs
        }
        revision = reply.header.revision
        with self._cond:
            self._entries, self.revision, self.healthy = entries, revision, True
            self._cond.notify_all()
        self._tell_listeners()
        self._watch_id = self.client.call(
            lambda c: c.add_watch_prefix_callback(self.prefix, self._on_watch, start_revision=revision + 1),
            deadline=deadline,
        )

    def _on_watch(self, response: Any) -> None:
        if isinstance(response, BaseException):
            self._broken(response)
            return
        with self._cond:
            for event in response.events:
                key = event.key.decode()
                if isinstance(event, etcd_events.DeleteEvent):
                    self._entries.pop(key, None)
                else:
                    self._entries[key] = Entry(event.value, event.mod_revision, event.create_revision, event.lease)
            self.revision = max(self.revision, response.header.revision)
            self._cond.notify_all()
        self._tell_listeners()

    def _tell_listeners(self) -> None:
        for listener in list(self.listeners):
            try:
                listener()
            except Exception:  # noqa: BLE001 - a listener's bug must not break the watch
                log.exception("mirror listener failed")

    def _broken(self, error: BaseException) -> None:
        with self._cond:
            if self._closed or self._resyncing:
                return
            self.healthy, self._resyncing = False, True
            self._cond.notify_all()
        self._tell_listeners()
        log.debug("watch on %s broke (%s); resyncing", self.prefix, error)
        threading.Thread(target=self._resync, name="elastic-mirror-resync", daemon=True).start()

    def _resync(self) -> None:
        while not self._closed:
            time.sleep(_RESYNC_PAUSE_S)
            try:
                self._sync(deadline=2.0)
            except EtcdError as exc:
                log.debug("resync of %s failed: %s", self.prefix, exc)
                continue
            with self._cond:
                self._resyncing = False
            log.info("watch on %s restored at revision %d", self.prefix, self.revision)
            return

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._watch_id is not None:
            try:
                self.client.call(lambda c: c.cancel_watch(self._watch_id), deadline=1.0)
            except EtcdError:
                pass
