"""Lease keep-alives that ask every etcd member at once when the one in use is slow.

A node judges its lease by its own clock (:mod:`agent.rendezvous.lease_clock`): at the
default 3 s TTL it stops its workers about 2.25 s after its last confirmed keep-alive. A
keep-alive sent to one member at a time, through the failover channel every other request
shares, lost that race when the etcd leader was cut off from the other two members:

* a follower forwards each renewal to the leader it knows; to the cut-off one that hangs
  until our attempt's deadline, and the follower then answers ``UNKNOWN: context deadline
  exceeded``, which the shared client took as a final answer, or, when the attempt timed
  out on our side, as the follower hanging: it avoided a healthy member for 2 s and went
  to the cut-off one;
* during the election every member answers "no leader" at once, and the first one that
  leads must be asked as soon as it does, not at the next tick.

etcd cannot expire a lease while it has no leader, and a new leader extends every lease
by an election timeout when it takes over, so the only race is to reach the new leader
soon after it exists. :class:`KeepAlive` sends to the member that answered last; if that
one has not answered within ``hedge_after``, or failed, every member is asked at once, on
channels of their own; each member that fails is asked again after a short pause, and the
first answer wins (the others are cancelled). Over a healthy cluster that is one request
per keep-alive, as before. When no member answered, the client's shared channel is
dropped too, as a failed keep-alive on it used to do: a node cut off from etcd must not
have its agent wait 5 s on a dead connection on its way to fencing itself.
"""

from __future__ import annotations

import queue
import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import grpc
from etcd3 import etcdrpc

from agent.etcd.client import EtcdClient, EtcdUnavailableError, describe_error, is_final
from agent.etcd.kv import refresh_lease

# Before asking a member again after it failed: short, since an election ends at an
# unknown moment, and growing, so that an etcd that is down is not asked 20 times a second.
_PAUSES_S = (0.05, 0.1, 0.2)


@dataclass(frozen=True)
class _Attempt:
    member: str
    channel: grpc.Channel
    call: Any  # the gRPC stream call, cancellable


class KeepAlive:
    """Keep-alives of one node's lease; :meth:`refresh` may be called from several threads."""

    def __init__(self, client: EtcdClient, hedge_after: float = 0.1, first: str | None = None) -> None:
        """``first``: the ``host:port`` asked first until another answers instead (default:
        one at random, which spreads a large job's keep-alives over the members)."""
        self._client = client
        self._hedge_after = hedge_after
        self._members = [f"{host}:{port}" for host, port in client.settings.endpoints]
        self._address = dict(zip(self._members, client.settings.endpoints))
        if first is not None and first not in self._members:
            raise ValueError(f"{first} is not one of the etcd endpoints {', '.join(self._members)}")
        self._preferred = first if first is not None else random.choice(self._members)
        self._channels: dict[str, grpc.Channel] = {}
        # one waiter per member in flight, plus a cancelled call or two still returning, from the
        # process's one pool: an agent holds one lease, the simulation hundreds (a pool each was
        # a thread each that mostly slept)
        self._pool = _waiters(2 * len(self._members) + 1)
        self._lock = threading.Lock()
        self._closed = False

    @property
    def preferred(self) -> str:
        """The member asked first: the last one that answered."""
        return self._preferred

    def refresh(self, lease_id: int, timeout: float, attempt: float) -> int:
        """One keep-alive of ``lease_id``; its remaining TTL (0: etcd no longer has it).

        Takes at most ``timeout``; each request to a member at most ``attempt``. Raises
        :class:`EtcdUnavailableError` if no member confirmed the lease in that time. An
        answer that asking again cannot change (an expired token, a TLS or permission
        error) goes through :class:`EtcdClient`, which re-authenticates or says what is wrong.
        """
        start = time.monotonic()
        end = start + timeout
        metadata, credentials = self._client.request_metadata(deadline=timeout)
        request = etcdrpc.LeaseKeepAliveRequest(ID=lease_id)
        results: queue.Queue[tuple[_Attempt, int | BaseException]] = queue.Queue()
        hedge_at = start + min(self._hedge_after, timeout / 4)
        due = {m: start if m == self._preferred else hedge_at for m in self._members}
        failures: dict[str, int] = {}
        in_flight: dict[str, _Attempt] = {}
        last_error: BaseException | None = None
        try:
            while (now := time.monotonic()) < end:
                for member in self._members:
                    if member not in in_flight and due[member] <= now:
                        in_flight[member] = self._send(member, request, min(attempt, end - now),
                                                       metadata, credentials, results)
                next_send = min([due[m] for m in self._members if m not in in_flight] + [end])
                if not in_flight and next_send >= end:
                    break  # every member failed and none can be asked again in time: say so now
                try:
                    done, outcome = results.get(timeout=max(0.0, next_send - now))
                except queue.Empty:
                    continue
                del in_flight[done.member]
                if not isinstance(outcome, BaseException):
                    self._preferred = done.member
                    return outcome
                if is_final(outcome):
                    return refresh_lease(self._client, lease_id, timeout=max(end - time.monotonic(), 0.1))
                last_error = outcome
                if _connection_suspect(outcome):
                    self._forget(done)
                count = failures[done.member] = failures.get(done.member, 0) + 1
                now = time.monotonic()
                due[done.member] = now + _PAUSES_S[min(count, len(_PAUSES_S)) - 1]
                for member in self._members:  # no waiting for the hedge: one has failed already
                    if member not in in_flight and member not in failures:
                        due[member] = min(due[member], now)
        finally:
            for pending in in_flight.values():
                pending.call.cancel()
        self._client.drop_channel()  # the shared channel is no better off: let its users fail fast
        for listener in list(self._client.error_listeners):  # counted as every failed request is
            listener("unavailable")
        raise EtcdUnavailableError(
            f"no etcd member at {self._client.settings.describe()} confirmed the keep-alive within "
            f"{timeout:.2f} s ({describe_error(last_error) if last_error is not None else 'no answer'})"
        )

    def _send(self, member: str, request: Any, timeout: float, metadata: Any, credentials: Any,
              results: "queue.Queue[tuple[_Attempt, int | BaseException]]") -> _Attempt:
        channel = self._channel(member)
        call = etcdrpc.LeaseStub(channel).LeaseKeepAlive(iter([request]), timeout, metadata=metadata,
                                                         credentials=credentials)
        sent = _Attempt(member, channel, call)
        try:
            self._pool.submit(_wait_for_reply, sent, results)
        except RuntimeError as exc:  # closed under us: the lease is being revoked
            call.cancel()
            raise EtcdUnavailableError("the keep-alive sender is closed") from exc
        return sent

    def _channel(self, member: str) -> grpc.Channel:
        with self._lock:
            if self._closed:
                raise EtcdUnavailableError("the keep-alive sender is closed")
            channel = self._channels.get(member)
            if channel is None:
                channel = self._channels[member] = self._client.member_channel(*self._address[member])
            return channel

    def _forget(self, attempt: _Attempt) -> None:
        """A new channel for the next attempt to this member: one that failed to connect
        sits in gRPC's reconnect back-off, and after an etcd outage the node whose channel
        reconnects last could hear its peers reach etcd again before it does, and judge
        itself cut off (:mod:`agent.rendezvous.lease_clock`)."""
        with self._lock:
            if self._channels.get(attempt.member) is not attempt.channel:
                return  # another thread's failure replaced it already
            channel = self._channels.pop(attempt.member)  # attempt.channel (a name mypy has not narrowed)
        channel.close()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            channel.close()  # ends any call still in flight, so its waiter returns


_POOL_LOCK = threading.Lock()
_POOL: ThreadPoolExecutor | None = None
_POOL_SIZE = 0
_SHARED_WAITERS = 64  # enough for hundreds of leases whose replies come in milliseconds


def _waiters(at_least: int) -> ThreadPoolExecutor:
    """The process's keep-alive waiters (threads start only as replies are awaited at once)."""
    global _POOL, _POOL_SIZE
    with _POOL_LOCK:
        if _POOL is None or _POOL_SIZE < at_least:
            _POOL_SIZE = max(at_least, _SHARED_WAITERS)
            _POOL = ThreadPoolExecutor(max_workers=_POOL_SIZE, thread_name_prefix="elastic-keepalive")
        return _POOL


def _after_fork() -> None:  # a forked child has none of the pool's threads: it makes its own
    global _POOL, _POOL_SIZE
    _POOL, _POOL_SIZE = None, 0


os.register_at_fork(after_in_child=_after_fork)


def _wait_for_reply(attempt: _Attempt, results: "queue.Queue[tuple[_Attempt, int | BaseException]]") -> None:
    try:
        for reply in attempt.call:
            results.put((attempt, int(reply.TTL)))
            return
        # etcd answers every keep-alive, with TTL 0 for a lease it does not have; a stream that
        # ends without an answer says nothing about the lease, so it is asked again
        results.put((attempt, EtcdUnavailableError("the keep-alive stream ended without an answer")))
    except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
        results.put((attempt, exc))


def _connection_suspect(exc: BaseException) -> bool:
    """The member could not be reached, or the request hung on its connection."""
    return isinstance(exc, grpc.RpcError) and exc.code() in (grpc.StatusCode.UNAVAILABLE,
                                                              grpc.StatusCode.DEADLINE_EXCEEDED)
