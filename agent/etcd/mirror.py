"""A local, watch-fed copy of every key under one etcd prefix.

The rendezvous and the agent ask "who is alive, which round is open" many times a
second. Asking etcd each time would put an etcd round trip (and an etcd outage) on the
training hot path; a mirror answers from memory, learns of every change within
milliseconds through one watch, and says when it is stale instead of guessing.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from etcd3 import events as etcd_events
from etcd3.utils import prefix_range_end, to_bytes

from agent.etcd.client import EtcdClient, EtcdError
from agent.etcd.watches import OwnWatch, is_compacted, resume_plan

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
    node into a frozen picture. On reconnection each watch resumes from the revision
    after the last one it applied, so nothing that happened meanwhile is missed; where
    etcd compacted that history the mirror re-reads everything instead
    (:func:`.watches.resume_plan`).
    """

    def __init__(self, client: EtcdClient, prefix: str) -> None:
        self.client, self.prefix = client, prefix
        self._cond = threading.Condition()
        self._entries: dict[str, Entry] = {}
        self.revision = 0
        self.healthy = False
        self._watches: list[OwnWatch] = []
        self._generation = 0  # one per read: responses of an older read's watches are ignored
        self._closed = False
        self._resyncing = False
        self._broke_again = False  # a watch of the read being resynced broke before it was done
        self._seen: list[int] = []  # per watch range: the last revision applied from it (0: never read)
        self._compacted = False  # a watch was told its history is gone: the next resync reads afresh
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

    # --------------------------------------------------------------- what is read and watched

    def _read(self, deadline: float | None) -> tuple[dict[str, Entry], int]:
        reply = self.client.call(lambda c: c.get_prefix_response(self.prefix), deadline=deadline)
        entries = {
            kv.key.decode(): Entry(kv.value, kv.mod_revision, kv.create_revision, kv.lease) for kv in reply.kvs
        }
        return entries, reply.header.revision

    def _watch_ranges(self) -> list[tuple[str, bytes | None]]:
        """``(key, range_end)`` of each watch; None: that one key."""
        return [(self.prefix, prefix_range_end(to_bytes(self.prefix)))]

    def _sync(self, deadline: float | None = None) -> None:
        """Read everything, then watch it from the revision after the read (nothing missed)."""
        self._retire()
        entries, revision = self._read(deadline)
        with self._cond:
            self._generation += 1
            generation = self._generation
            self._entries, self.revision, self.healthy = entries, revision, True
            self._seen = [revision] * len(self._watch_ranges())
            self._compacted = False
            self._cond.notify_all()
        self._tell_listeners()
        self._watch(generation, [revision + 1] * len(self._seen), deadline)

    def _resume(self, deadline: float | None = None) -> None:
        """Re-make every watch from the revision after the last one it applied; a read
        afresh where that history is gone or there is none (:func:`.watches.resume_plan`)."""
        self._retire()
        with self._cond:
            starts = resume_plan(self._seen, self._compacted)
            if starts is None:
                generation = 0
            else:
                self._generation += 1  # responses of the broken watches still on their way are dropped
                generation = self._generation
        if starts is None:
            self._sync(deadline)
            return
        try:
            self._watch(generation, starts, deadline)
        except Exception as exc:
            if not is_compacted(exc):
                raise
            with self._cond:
                self._compacted = True
            self._sync(deadline)  # etcd no longer has the history to replay: read it afresh
            return
        with self._cond:
            if generation == self._generation:
                self.healthy = True
                self._cond.notify_all()
        self._tell_listeners()

    def _watch(self, generation: int, starts: list[int], deadline: float | None) -> None:
        for index, ((key, end), start) in enumerate(zip(self._watch_ranges(), starts)):
            kwargs: dict[str, Any] = {"start_revision": start}
            if end is not None:
                kwargs["range_end"] = end
            self._watches.append(OwnWatch(self.client, key, functools.partial(self._on_watch, generation, index),
                                          deadline, **kwargs))

    def _retire(self) -> None:
        """Cancel the previous read's watches that still live (each on its own stream)."""
        watches, self._watches = self._watches, []
        for watch in watches:
            try:
                watch.cancel()
            except Exception:  # a watch that cannot be cancelled is ignored anyway
                log.debug("could not cancel a watch on %s", self.prefix, exc_info=True)

    def _on_watch(self, generation: int, index: int, response: Any) -> None:
        if response is None or isinstance(response, BaseException):
            if is_compacted(response):
                with self._cond:
                    if generation == self._generation:
                        self._compacted = True
            self._broken(response or EtcdError("the watch stream ended"), generation)
            return
        with self._cond:
            if generation != self._generation:
                return  # an older read's watch, still alive on an old stream: its news may be older
            # a watch's events come in revision order, every event of a revision in one response:
            # a resumed watch starts after the last one applied, missing nothing. Not after the
            # response's own revision: etcd sends a watch catching up over more than 1,000
            # revisions in parts, each part stamped with the current revision. An empty response
            # (a progress notice, sent only to a watch that is caught up) covers its revision.
            last = response.events[-1].mod_revision if response.events else response.header.revision
            self._seen[index] = max(self._seen[index], last)
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
            except Exception:  # a listener's bug must not break the watch
                log.exception("mirror listener failed")

    def _broken(self, error: BaseException, generation: int | None = None) -> None:
        with self._cond:
            if self._closed or (generation is not None and generation != self._generation):
                return  # an older read's watch: the read that replaced it stands
            self.healthy = False
            if self._resyncing:
                # broke while the resync was still making its watches (each a round trip): that
                # resync must not end as if it were whole, or its dead watches look healthy
                self._broke_again = True
                self._cond.notify_all()
                return
            self._resyncing = True
            self._cond.notify_all()
        self._tell_listeners()
        log.debug("watch on %s broke (%s); resyncing", self.prefix, error)
        threading.Thread(target=self._resync, name="elastic-mirror-resync", daemon=True).start()

    def _resync(self) -> None:
        while not self._closed:
            time.sleep(_RESYNC_PAUSE_S)
            with self._cond:
                self._broke_again = False
            try:
                self._resume(deadline=2.0)
            except Exception as exc:  # this thread is the mirror's only way back: it must not die
                with self._cond:
                    self.healthy = False
                log.debug("resync of %s failed: %s", self.prefix, exc, exc_info=not isinstance(exc, EtcdError))
                continue
            with self._cond:
                if self._broke_again:
                    self.healthy = False
                    continue
                self._resyncing = False
            log.info("watch on %s restored at revision %d", self.prefix, self.revision)
            return

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        try:
            self._retire()
        except EtcdError:
            pass


class LazyPrefixMirror(PrefixMirror):
    """A :class:`PrefixMirror` that reads and watches its prefix only once something asks it
    (``entries``, ``wait``, ``healthy``, ``start``) once its owner called :meth:`allow`: a node
    that never needs every peer's keys never hears them, and none reads them before it may
    (the rendezvous: before its node holds its name, its key may still be a previous
    incarnation's). Until then it is empty and not healthy, as an unstarted mirror. A first
    read that fails is retried in the background, as after a broken watch."""

    def __init__(self, client: EtcdClient, prefix: str, deadline: float | None = None) -> None:
        self._begun = False
        self._healthy = False
        super().__init__(client, prefix)
        self._deadline = deadline
        self._begin_lock = threading.Lock()
        self._allowed = False

    @property
    def healthy(self) -> bool:
        self.ensure()
        return self._healthy

    @healthy.setter
    def healthy(self, value: bool) -> None:
        self._healthy = value

    @property
    def begun(self) -> bool:
        return self._begun

    def allow(self) -> None:
        self._allowed = True

    def ensure(self) -> None:
        if self._begun or not self._allowed:
            return
        with self._begin_lock:
            if self._begun:
                return
            self._begun = True
            try:
                self._sync(self._deadline)
            except EtcdError as exc:
                self._broken(exc)

    def start(self, deadline: float | None = None) -> "PrefixMirror":
        if deadline is not None:
            self._deadline = deadline
        self.allow()
        self.ensure()
        return self

    def entries(self) -> tuple[dict[str, Entry], int]:
        self.ensure()
        return super().entries()

    def wait(self, after_revision: int, timeout: float) -> bool:
        self.ensure()
        return super().wait(after_revision, timeout)

    def close(self) -> None:
        with self._begin_lock:
            self._begun = True  # never read after closing
        super().close()
