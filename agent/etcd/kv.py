"""Two etcd v3 idioms the rendezvous needs and python3-etcd3 does not offer directly.

* :func:`transact` returns the transaction's header revision, which is the new mod
  revision of every key the transaction wrote: the fencing token, without a second read.
* :class:`ExpiringLease` gives keys a time to live without a keep-alive thread: each write
  attaches a lease granted at most ``ttl/2`` ago, so a key outlives its last write by
  between ``ttl/2`` and ``ttl`` seconds, and state left by a dead job cleans itself up.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence, TypeVar

import etcd3
from etcd3.client import KVMetadata
import grpc
from etcd3 import etcdrpc

from agent.etcd.client import EtcdClient, EtcdError
from agent.etcd.grpc_untyped import lease_not_found

T = TypeVar("T")


@dataclass(frozen=True)
class TxnResult:
    succeeded: bool
    revision: int
    responses: list[Any]


def transact(
    client: EtcdClient,
    compare: Sequence[Any],
    success: Sequence[Any] = (),
    failure: Sequence[Any] = (),
    *,
    deadline: float | None = None,
) -> TxnResult:
    """One etcd transaction; range responses come back as ``[(value, KVMetadata)]``."""

    def request(c: etcd3.MultiEndpointEtcd3Client) -> TxnResult:
        txn = etcdrpc.TxnRequest(
            compare=[cmp.build_message() for cmp in compare],
            success=c._ops_to_requests(list(success)),
            failure=c._ops_to_requests(list(failure)),
        )
        # one attempt never outlives the caller's deadline: a proposal stuck on a member whose
        # leader just died would otherwise hold it for the whole request timeout
        timeout = c.timeout if deadline is None else min(c.timeout or deadline, deadline)
        try:
            reply = c.kvstub.Txn(
                txn, timeout, credentials=c.call_credentials, metadata=c.metadata
            )
        except grpc.RpcError as exc:
            c._manage_grpc_errors(exc)  # maps to etcd3's exception types, marks the endpoint
            raise
        responses: list[Any] = []
        for op in reply.responses:
            kind = op.WhichOneof("response")
            if kind == "response_range":
                responses.append(
                    [(kv.value, KVMetadata(kv, reply.header)) for kv in op.response_range.kvs]
                )
            else:
                responses.append(op)
        return TxnResult(reply.succeeded, reply.header.revision, responses)

    return client.call(request, deadline=deadline)


def refresh_lease(client: EtcdClient, lease_id: int, timeout: float) -> int:
    """One keep-alive of ``lease_id`` through the shared client; its remaining TTL (0: etcd
    no longer has it). :class:`.keepalive.KeepAlive` falls back to it for answers only
    :class:`EtcdClient` handles (an expired token, a TLS or permission error).

    etcd3's own ``refresh_lease`` waits up to the client's request timeout (5 s) for an
    answer, longer than a short lease lives: here the whole refresh takes at most ``timeout``.
    """

    def request(c: etcd3.MultiEndpointEtcd3Client) -> int:
        keep_alive = etcdrpc.LeaseKeepAliveRequest(ID=lease_id)
        # A raw gRPC error reaches EtcdClient.call, which rebuilds the channel instead of
        # letting it sit in gRPC's reconnect back-off after etcd returns.
        for reply in c.leasestub.LeaseKeepAlive(
            iter([keep_alive]), timeout, credentials=c.call_credentials, metadata=c.metadata
        ):
            return int(reply.TTL)
        return 0

    return client.call(request, deadline=timeout)


class ExpiringLease:
    """A lease renewed by replacement, never by keep-alive (see module docstring)."""

    def __init__(self, client: EtcdClient, ttl: int) -> None:
        if ttl < 2:
            raise ValueError("a lease TTL must be at least 2 seconds")
        self._client = client
        self._ttl = ttl
        self._lock = threading.Lock()
        self._lease_id: int | None = None
        self._granted_at = 0.0

    def current(self) -> int:
        """A lease id with at least ``ttl/2`` seconds left."""
        with self._lock:
            if self._lease_id is None or time.monotonic() - self._granted_at > self._ttl / 2:
                lease = self._client.call(lambda c: c.lease(self._ttl))
                self._lease_id, self._granted_at = lease.id, time.monotonic()
            return self._lease_id

    def write(self, put: Callable[[int], T]) -> T:
        """Run ``put(lease_id)``; if etcd no longer knows the lease (revoked, or lost in
        a restore), grant a fresh one and run it once more."""
        try:
            return put(self.current())
        except EtcdError as exc:
            if not is_lease_not_found(exc):
                raise
            with self._lock:
                self._lease_id = None
            return put(self.current())


def is_lease_not_found(exc: BaseException) -> bool:
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, grpc.RpcError) and lease_not_found(cause.details() or ""):  # agent/etcd/grpc_untyped.py
            return True
        cause = cause.__cause__
    return False
