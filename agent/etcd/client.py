"""A python3-etcd3 client that survives etcd blips and fails with one clear line.

python3-etcd3 leaves these things to its caller, and each matters for fault tolerance:

* It marks a failed endpoint unusable for ``time_retry`` seconds (300 by default), so one
  restart of a one-member etcd would lock every agent out for five minutes. We build the
  endpoints ourselves with a sub-second retry window.
* It never retries. We retry transient errors (unavailable, deadline, no server) with
  bounded, jittered backoff through ``tenacity`` and then give up with
  :class:`EtcdUnavailableError`, so callers can tell "etcd unreachable" from a real answer.
* Its auth token is fetched once. etcd expires simple tokens (5 minutes by default), so
  a long-running agent must re-authenticate when it is told the token is invalid.
* A member cut off from the rest of its cluster still accepts connections: unary requests
  hang until their timeout and a watch on it stays open but silent, a stale picture that
  looks healthy. Every request here carries etcd's ``hasleader`` metadata, so such a member
  answers "no leader" at once and cancels our watches, and a channel rebuilt after a
  failure starts on another member.
* It does not say which etcd it talks to. After the first answer we read every member's
  version and warn once per process if one is older than docs/deploy.md recommends
  (:mod:`.version`); that check never fails a request.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, TypeVar

import etcd3
import etcd3.exceptions as etcd_exc
import etcd3.watch
import grpc
from tenacity import (
    RetryError,
    Retrying,
    retry_if_exception,
    stop_before_delay,
    wait_random_exponential,
)

from agent.etcd.chain import raised_from
from agent.etcd.grpc_untyped import channel_closed, credentials_refused, tls_refused, token_expired
from agent.etcd.settings import EtcdSettings
from agent.etcd.version import warn_if_old
from agent.etcd.watches import OwnWatch

log = logging.getLogger(__name__)

T = TypeVar("T")


class _SixShim:
    """python3-etcd3 0.13's watch thread calls ``six.itervalues`` without importing six,
    so every ended watch stream crashed that thread before pending watchers heard of the
    error. This is the one function it needs."""

    @staticmethod
    def itervalues(mapping: dict[Any, Any]) -> Any:
        return iter(list(mapping.values()))


if not hasattr(etcd3.watch, "six"):
    etcd3.watch.six = _SixShim

_TRANSIENT_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
_TRANSIENT_TYPES = (
    etcd_exc.ConnectionFailedError,
    etcd_exc.ConnectionTimeoutError,
    etcd_exc.NoServerAvailableError,
    etcd_exc.InternalServerError,
    etcd_exc.WatchTimedOut,  # etcd did not confirm a new watch in time (seen at 128 nodes on 2 cores)
)
# An endpoint that failed is skipped only this long; etcd restarts must not lock us out.
_ENDPOINT_RETRY_S = 0.3
# After a failure, a rebuilt channel starts on another member for this long: long for a
# member that let a request hang (cut off from its peers, it cannot confirm its leadership),
# short for one that answered at once (down, or between leaders: it may be the first to
# have one again).
_AVOID_HUNG_S = 2.0
_AVOID_ANSWERED_S = 0.3
# etcd rejects a request carrying this (and cancels such a watch) on a member that has no
# leader, instead of letting it wait for a quorum it cannot reach (etcd's rpctypes).
REQUIRE_LEADER = ("hasleader", "true")


class EtcdError(RuntimeError):
    """Base class; the message is one line a user can act on."""


class EtcdUnavailableError(EtcdError):
    """No endpoint answered within the retry budget."""


class EtcdAccessError(EtcdError):
    """etcd answered but refused us: bad credentials, bad certificate or missing permission."""


def _rpc_error(exc: BaseException | None) -> grpc.RpcError | None:
    """The gRPC error behind ``exc``: etcd3 re-raises its own types and drops the details."""
    return raised_from(exc, grpc.RpcError)


def _is_tls_failure(exc: BaseException) -> bool:
    rpc = _rpc_error(exc)
    if rpc is None or rpc.code() not in _TRANSIENT_CODES:
        return False
    return tls_refused(rpc.details() or "")  # gRPC's words, read in agent/etcd/grpc_untyped.py alone


def _is_closed_channel(exc: BaseException) -> bool:
    """The request's channel was closed under it: another thread of this node rebuilt the
    shared channel after a failure of its own. Retrying uses the new channel."""
    if isinstance(exc, ValueError):  # grpc refuses to start a call on a closed channel
        return channel_closed(str(exc))
    rpc = _rpc_error(exc)
    return rpc is not None and rpc.code() == grpc.StatusCode.CANCELLED and channel_closed(rpc.details() or "")


def _is_transient(exc: BaseException) -> bool:
    if _is_tls_failure(exc):
        return False  # a certificate does not get better by asking again
    if _is_closed_channel(exc):
        return True
    if isinstance(exc, _TRANSIENT_TYPES):
        return True
    return isinstance(exc, grpc.RpcError) and exc.code() in _TRANSIENT_CODES


_FINAL_CODES = {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.INVALID_ARGUMENT}


def is_final(exc: BaseException) -> bool:
    """An answer that asking again, here or on another member, cannot change (auth, TLS,
    permission). Anything else, etcd's own "context deadline exceeded" included, may."""
    if _is_tls_failure(exc):
        return True
    rpc = _rpc_error(exc)
    return rpc is not None and rpc.code() in _FINAL_CODES


def _is_expired_token(exc: BaseException) -> bool:
    return (
        isinstance(exc, grpc.RpcError)
        and exc.code() == grpc.StatusCode.UNAUTHENTICATED
        and token_expired(exc.details() or "")
    )


class EtcdClient:
    """A thread-safe handle on an etcd cluster with retries and re-authentication.

    Use :meth:`call` for every request: ``client.call(lambda c: c.get(key))``. The
    lambda receives the underlying ``etcd3`` client, so the full v3 API stays available.
    """

    def __init__(self, settings: EtcdSettings, retry_deadline: float = 10.0) -> None:
        self.settings = settings
        self.retry_deadline = retry_deadline
        self._lock = threading.Lock()
        self._client: etcd3.MultiEndpointEtcd3Client | None = None
        self._avoid: dict[str, float] = {}  # netloc -> monotonic time until which a rebuild avoids it
        self._local = threading.local()
        # Called with "unavailable", "denied" or "refused" whenever a request fails for
        # good; the agent counts them (elastic_agent_etcd_errors_total).
        self.error_listeners: list[Callable[[str], None]] = []
        self._version_checked = False  # etcd's version is read after the first answer

    @contextmanager
    def deadline(self, seconds: float) -> Iterator[None]:
        """Cap the retry budget of this thread's requests, e.g. in a monitoring loop that
        must keep its pace while etcd is away."""
        previous = getattr(self._local, "deadline", None)
        self._local.deadline = seconds
        try:
            yield
        finally:
            self._local.deadline = previous

    # -- connection -------------------------------------------------------------------
    def _credentials(self) -> grpc.ChannelCredentials | None:
        s = self.settings
        if not s.secure:
            return None
        assert s.cacert is not None
        try:
            return etcd3.MultiEndpointEtcd3Client.get_secure_creds(
                str(s.cacert),
                str(s.key) if s.key else None,
                str(s.cert) if s.cert else None,
            )
        except OSError as exc:
            raise EtcdAccessError(f"cannot read etcd TLS file: {exc}") from exc

    def _build(self) -> etcd3.MultiEndpointEtcd3Client:
        creds = self._credentials()
        endpoints = [
            etcd3.Endpoint(
                host,
                port,
                secure=creds is not None,
                creds=creds,
                time_retry=_ENDPOINT_RETRY_S,
                opts=[("grpc.enable_retries", 0)],
            )
            for host, port in self.settings.endpoints
        ]
        client = etcd3.MultiEndpointEtcd3Client(
            endpoints=endpoints,
            timeout=self.settings.request_timeout,
            user=self.settings.user,
            password=self.settings.password,
            failover=True,
        )
        if creds is None:
            # gRPC refuses call credentials on a plaintext channel ("insufficient security
            # level"); etcd also reads the token from the metadata etcd3 sends anyway.
            client.call_credentials = None
        client.metadata = tuple(client.metadata or ()) + (REQUIRE_LEADER,)
        now = time.monotonic()
        usable = [label for label in client.endpoints if self._avoid.get(label, 0.0) <= now]
        if usable and client._current_endpoint_label not in usable:
            client._current_endpoint_label = random.choice(usable)
        return client

    def _raw(self) -> etcd3.MultiEndpointEtcd3Client:
        with self._lock:
            if self._client is None:
                self._client = self._build()
            return self._client

    def _reset(self, failed: etcd3.MultiEndpointEtcd3Client | None = None, error: BaseException | None = None) -> None:
        """Close the channel (``failed``: only if it is still the current one, so a late
        failure on an old channel does not close the one another thread just rebuilt)."""
        with self._lock:
            if failed is not None and len(self.settings.endpoints) > 1:
                label = getattr(failed, "_current_endpoint_label", None)
                hung = isinstance(error, grpc.RpcError) and error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                if label:
                    self._avoid[label] = time.monotonic() + (_AVOID_HUNG_S if hung else _AVOID_ANSWERED_S)
            if self._client is not None and (failed is None or self._client is failed):
                try:
                    self._client.close()
                except Exception:  # noqa: BLE001 - closing a broken channel must not mask the real error
                    pass
                self._client = None

    def close(self) -> None:
        self._reset()

    def drop_channel(self) -> None:
        """Close the shared channel; the next request builds a new one. For a caller that
        learned that no member answers (a lease keep-alive, on channels of its own): the
        other threads' requests then fail at once on a fresh connection (a cut-off route
        refuses it) instead of waiting out etcd3's 5 s timeout on a connection that is gone."""
        self._reset()

    # -- for callers that address members one by one (lease keep-alives) ---------------
    def member_channel(self, host: str, port: int) -> grpc.Channel:
        """A channel of its own to one member, with this client's TLS settings (the caller
        replaces it after a failed connection rather than wait out gRPC's reconnect back-off)."""
        creds = self._credentials()
        target = f"{host}:{port}"
        options = [("grpc.enable_retries", 0)]
        if creds is None:
            return grpc.insecure_channel(target, options=options)
        return grpc.secure_channel(target, creds, options=options)

    def request_metadata(self, deadline: float) -> tuple[tuple[tuple[str, str], ...], grpc.CallCredentials | None]:
        """What every request must carry: the auth token (if any) and ``hasleader``."""
        return self.call(lambda c: (tuple(c.metadata or ()), c.call_credentials), deadline=deadline)

    # -- requests ---------------------------------------------------------------------
    def call(self, request: Callable[[etcd3.MultiEndpointEtcd3Client], T], *, deadline: float | None = None) -> T:
        try:
            result = self._call(request, deadline)
        except EtcdError as exc:
            kind = ("unavailable" if isinstance(exc, EtcdUnavailableError)
                    else "denied" if isinstance(exc, EtcdAccessError) else "refused")
            for listener in list(self.error_listeners):
                listener(kind)
            raise
        if not self._version_checked:
            self._version_checked = True
            warn_if_old(self)  # once per process: a WARNING if a member runs an etcd not for production
        return result

    def _call(self, request: Callable[[etcd3.MultiEndpointEtcd3Client], T], deadline: float | None) -> T:
        """Run ``request`` with bounded retries of transient failures.

        Raises :class:`EtcdUnavailableError` once ``deadline`` seconds (default
        ``retry_deadline``) have passed without an answer, and :class:`EtcdAccessError`
        at once for answers that retrying cannot change (auth, TLS, permissions).
        """
        if deadline is None:
            deadline = getattr(self._local, "deadline", None)
        budget = self.retry_deadline if deadline is None else deadline
        reauthenticated = False
        retrying = Retrying(
            retry=retry_if_exception(_is_transient),
            stop=stop_before_delay(budget),
            wait=wait_random_exponential(multiplier=0.05, max=1.0),
            reraise=False,
        )
        while True:
            try:
                for attempt in retrying:
                    with attempt:
                        raw = self._raw()
                        try:
                            return request(raw)
                        except BaseException as exc:
                            if _is_transient(exc) and isinstance(exc, grpc.RpcError):
                                self._reset(raw, exc)  # raw gRPC errors bypass etcd3's failover
                            raise
            except RetryError as exc:
                last = exc.last_attempt.exception()
                raise EtcdUnavailableError(
                    f"etcd at {self.settings.describe()} did not answer for {budget:.0f} s "
                    f"({describe_error(last)}); check that etcd is running and reachable"
                ) from last
            except _TRANSIENT_TYPES as exc:
                if _is_tls_failure(exc):
                    raise self._access_error(_rpc_error(exc)) from exc
                raise
            except grpc.RpcError as exc:
                if _is_expired_token(exc) and not reauthenticated:
                    log.info("etcd auth token expired; re-authenticating")
                    self._reset()
                    reauthenticated = True
                    continue
                raise self._access_error(exc) from exc

    def _access_error(self, exc: grpc.RpcError) -> EtcdError:
        code, details = exc.code(), (exc.details() or "").strip()
        where = self.settings.describe()
        if credentials_refused(details):  # etcd's words (agent/etcd/grpc_untyped.py)
            return EtcdAccessError(
                f"etcd at {where} rejected user {self.settings.user!r}: wrong user or password; "
                "check ELASTIC_ETCD_PASSWORD / password_file"
            )
        if code == grpc.StatusCode.PERMISSION_DENIED:
            return EtcdAccessError(
                f"etcd at {where} denied user {self.settings.user!r} access to the job's keys; "
                "grant its role readwrite on the key prefix"
            )
        if code in _TRANSIENT_CODES and _is_tls_failure(exc):
            return EtcdAccessError(
                f"TLS handshake with etcd at {where} failed ({details}); "
                "check cacert/cert/key and that etcd serves https"
            )
        return EtcdError(f"etcd at {where} refused the request: {code.name}: {details}")

    def wait_for_event(
        self,
        key: bytes | str,
        timeout: float,
        start_revision: int,
        range_end: bytes | str | None = None,
    ) -> bool:
        """Block until ``key`` (or the range) changes after ``start_revision``.

        Returns ``False`` on timeout, and ``True`` also when the watch broke: either way the
        caller re-reads. Watching from a revision misses nothing that happened between the
        caller's read and this call, so callers never need to poll.
        """
        events: queue.Queue[Any] = queue.Queue()
        kwargs: dict[str, Any] = {"start_revision": start_revision}
        if range_end is not None:
            kwargs["range_end"] = range_end
        watch = OwnWatch(self, key, events.put, **kwargs)
        try:
            item = events.get(timeout=max(timeout, 0.0))
        except queue.Empty:
            return False
        finally:
            watch.cancel()  # on its own stream only: its number may be another watch's on a new one
        if isinstance(item, BaseException):
            if isinstance(item, etcd_exc.RevisionCompactedError):
                return True  # history is gone; the caller re-reads the current value
            if _is_transient(item):
                # the stream broke (etcd restarting, or another thread rebuilt the channel):
                # the caller re-reads, and that read's retries say whether etcd is really away
                return True
            raise EtcdUnavailableError(f"etcd watch failed: {describe_error(item)}") from item
        return True


def describe_error(exc: BaseException | None) -> str:
    """One line for an etcd failure: the gRPC code and details, else the exception's text."""
    if exc is None:
        return "no error"
    if isinstance(exc, grpc.RpcError):
        return f"{exc.code().name}: {exc.details()}"
    return str(exc) or type(exc).__name__
