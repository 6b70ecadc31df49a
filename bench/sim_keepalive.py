"""One keep-alive stream per simulation host process, for every participant's lease.

An agent holds one lease and keeps it alive from a thread of its own
(:meth:`agent.rendezvous.registry.NodeLease.start`). A simulation host holds hundreds: a
thread each, waking every TTL/4 and each sending a stream of its own, starved on 2 cores at
1,024 participants (keep-alives late past the TTL, leases gone, the first round's requests
timed out). etcd's ``LeaseKeepAlive`` is a bidirectional stream that carries any number of
lease ids, which is how etcd's own clients keep many leases: here one such stream per host
process refreshes all of its participants' leases every TTL/4, and its replies confirm
each lease as :meth:`NodeLease.refresh` would (the same bookkeeping: confirmed at the send
time, a missed reply recorded as a failure, TTL 0 handled by the lease's own ``_lost``).

Everything else of a participant is the real handler: its lease, keys, watches, steward.
A participant's lease still dies exactly as an agent's does when its process is SIGKILLed:
the stream goes with the process, and etcd expires the lease after its TTL.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import time
from typing import Any, Iterator

from etcd3 import etcdrpc

from agent.rendezvous import registry

log = logging.getLogger(__name__)

_DONE = object()


class HostKeepAlive:
    """Every lease of this process on a few ``LeaseKeepAlive`` streams, refreshed each TTL/4."""

    def __init__(self, channel: Any, metadata: Any, credentials: Any, ttl: float, streams: int = 1) -> None:
        self._channel, self._metadata, self._credentials = channel, metadata, credentials
        self.interval = ttl / 4
        self._lock = threading.Lock()
        self._leases: dict[int, tuple[registry.NodeLease, Any]] = {}  # id(lease) -> (lease, counter)
        self._sent: dict[int, tuple[registry.NodeLease, float]] = {}  # lease id -> (lease, send time) unanswered
        # a few streams, each lease always on the same one (tried against late replies with 128
        # leases on one stream; they came late with 8 a stream too: the machine's load, not the
        # stream, see docs/BENCHMARKS.md), so that one slow stream does not hold every lease
        self._queues: list[queue.Queue[Any]] = [queue.Queue() for _ in range(streams)]
        self._stop = threading.Event()
        self.sent = self.replies = self.streams = self.missed = 0
        for q in self._queues:
            threading.Thread(target=self._stream_loop, args=(q,), name="sim-keepalive-stream", daemon=True).start()
        threading.Thread(target=self._tick_loop, name="sim-keepalive-tick", daemon=True).start()

    def add(self, lease: registry.NodeLease, counter: Any) -> None:
        with self._lock:
            self._leases[id(lease)] = (lease, counter)

    def close(self) -> None:
        self._stop.set()
        for q in self._queues:
            q.put(_DONE)

    # ------------------------------------------------------------------ sending

    def _tick_loop(self) -> None:
        next_tick = time.monotonic()
        while True:
            next_tick = max(next_tick + self.interval, time.monotonic())
            if self._stop.wait(next_tick - time.monotonic()):
                return
            now = time.monotonic()
            with self._lock:
                leases = list(self._leases.values())
                missed = list(self._sent.values())
                self._sent.clear()
            for lease, sent in missed:  # no answer within a tick: a failed attempt, as NodeLease.refresh records
                lease._failed(sent)
            if missed:
                self.missed += len(missed)
                print(f"sim keep-alive (pid {os.getpid()}): {len(missed)} of {len(leases)} leases unanswered "
                      f"within {self.interval:.1f} s", file=sys.stderr, flush=True)
            for lease, counter in leases:
                if lease.closed:
                    continue
                lease._last_tick = now  # the freeze clock: this process ran its keep-alive tick
                lease_id = lease._lease_id
                if lease_id is None:  # lost and not yet granted again: the lease's own path grants it
                    threading.Thread(target=lease.refresh, args=(self.interval,), daemon=True).start()
                    continue
                counter.add(keepalives=1)
                with self._lock:
                    self._sent[lease_id] = (lease, now)
                self.sent += 1
                self._queues[lease_id % len(self._queues)].put(etcdrpc.LeaseKeepAliveRequest(ID=lease_id))

    def _feed(self, requests: "queue.Queue[Any]") -> Iterator[Any]:
        while True:
            request = requests.get()
            if request is _DONE:
                return
            yield request

    # ------------------------------------------------------------------ receiving

    def _stream_loop(self, requests: "queue.Queue[Any]") -> None:
        while not self._stop.is_set():
            self.streams += 1
            try:
                call = etcdrpc.LeaseStub(self._channel).LeaseKeepAlive(
                    self._feed(requests), metadata=self._metadata, credentials=self._credentials)
                for reply in call:
                    self._answer(int(reply.ID), int(reply.TTL))
            except Exception as exc:  # noqa: BLE001 - the stream broke: unanswered leases fail at the next tick
                if self._stop.is_set():
                    return
                log.warning("host keep-alive stream broke (%s); reopening", exc)
                self._stop.wait(0.5)

    def _answer(self, lease_id: int, ttl: int) -> None:
        with self._lock:
            entry = self._sent.pop(lease_id, None)
        self.replies += 1
        if entry is None:
            return  # answered after its tick ended (already recorded as failed), or a lease gone
        lease, sent = entry
        if ttl > 0:
            lease._confirmed(sent)
        else:  # etcd no longer has it: the lease's own handling (a new lease, the record rewritten)
            threading.Thread(target=lease._lost, args=(lease_id,), daemon=True).start()


_host: HostKeepAlive | None = None


def install(keepalive: HostKeepAlive) -> None:
    """From now on, a started :class:`NodeLease` in this process is kept alive by ``keepalive``
    instead of a thread of its own (the claim, the grant and everything else unchanged)."""
    global _host
    _host = keepalive

    def start(self: registry.NodeLease, patience: float | None = None) -> registry.NodeLease:
        self._claim(self.ttl + 1.0 if patience is None else patience)
        self._last_tick = time.monotonic()
        self._thread = threading.current_thread()  # not None: ``suspect_lost`` looks at _last_tick
        assert _host is not None
        _host.add(self, getattr(self.client, "counter", None) or _NoCounter())
        return self

    registry.NodeLease.start = start  # type: ignore[method-assign]


class _NoCounter:
    def add(self, **_: int) -> None:
        pass
