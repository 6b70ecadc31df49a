"""torch's ``RendezvousBackend`` on etcd v3: one key, compare-and-set by transaction.

The fencing token is the key's mod revision. A transaction compares it and writes in one
round trip, and on a mismatch returns the current value in the same reply, so a losing
writer learns the winner's state without a second read.

:func:`create_backend` is torch's backend-factory contract (``(params) -> (backend, store)``,
as in ``etcd_rendezvous_backend.create_backend``), for users who build torch's
``DynamicRendezvousHandler`` themselves.
"""

from __future__ import annotations

import logging
from typing import Callable, TypeVar

from etcd3 import transactions as tx
from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousParameters,
    RendezvousStateError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, Token

from agent.etcd import EtcdClient, EtcdError
from agent.etcd.kv import ExpiringLease, transact

from agent.rendezvous.options import DEFAULT_STATE_TTL, connect
from agent.rendezvous.signing import SignatureError, StateSigner
from agent.rendezvous.store import EtcdV3Store

log = logging.getLogger(__name__)

T = TypeVar("T")


def state_key(key_prefix: str, run_id: str) -> str:
    return f"{key_prefix.rstrip('/')}/{run_id}/rdzv/state"


class EtcdV3RendezvousBackend(RendezvousBackend):
    """Holds the rendezvous state in ``{prefix}/{run_id}/rdzv/state``."""

    def __init__(
        self,
        client: EtcdClient,
        run_id: str,
        signer: StateSigner,
        key_prefix: str = "/elastic",
        ttl: int = DEFAULT_STATE_TTL,
    ) -> None:
        if not run_id:
            raise ValueError("The run id must be a non-empty string.")
        self._client = client
        self._signer = signer
        self._key = state_key(key_prefix, run_id)
        self._key_bytes = self._key.encode()
        self._lease = ExpiringLease(client, ttl)

    @property
    def name(self) -> str:
        return "etcd-v3"

    @property
    def key(self) -> str:
        return self._key

    def get_state(self) -> tuple[bytes, Token] | None:
        value, meta = self._guard(lambda: self._client.call(lambda c: c.get(self._key)))
        if value is None:
            return None
        return self._open(value), meta.mod_revision

    def set_state(self, state: bytes, token: Token | None = None) -> tuple[bytes, Token, bool] | None:
        if token is None:
            guard = tx.Version(self._key) == 0  # only if no state exists yet
        else:
            revision = _parse_token(token)
            if revision is None:
                return self._current_with(False)
            guard = tx.Mod(self._key) == revision

        sealed = self._signer.seal(self._key_bytes, state)
        result = self._guard(lambda: self._write(guard, sealed))
        if result.succeeded:
            return state, result.revision, True
        current = result.responses[0]
        if not current:
            return None  # the state vanished (TTL) between our read and this write
        value, meta = current[0]
        return self._open(value), meta.mod_revision, False

    def _write(self, guard: object, sealed: bytes):
        return self._lease.write(
            lambda lease: transact(
                self._client,
                [guard],
                success=[tx.Put(self._key, sealed, lease=lease)],
                failure=[tx.Get(self._key)],
            )
        )

    def _current_with(self, succeeded: bool) -> tuple[bytes, Token, bool] | None:
        current = self.get_state()
        if current is None:
            return None
        return current[0], current[1], succeeded

    def _open(self, value: bytes) -> bytes:
        try:
            return self._signer.open(self._key_bytes, value)
        except SignatureError as exc:
            log.error("refusing rendezvous state at %s: %s", self._key, exc)
            raise RendezvousStateError(f"The rendezvous state at {self._key} is corrupt: {exc}") from exc

    def _guard(self, call: Callable[[], T]) -> T:
        try:
            return call()
        except EtcdError as exc:
            raise RendezvousConnectionError(str(exc)) from exc


def create_backend(params: RendezvousParameters) -> tuple[EtcdV3RendezvousBackend, EtcdV3Store]:
    """The backend and the store for ``params``, after one read proves etcd answers.

    Raises torch's :class:`RendezvousConnectionError` when etcd is unreachable or refuses
    us, with our one-line message and the :class:`EtcdError` as its cause: torch's callers
    catch that type. Bad settings raise :class:`EtcdConfigError` / :class:`HmacKeyError`.
    """
    try:
        options, signer, client = connect(params)
    except EtcdError as exc:
        raise RendezvousConnectionError(str(exc)) from exc
    backend = EtcdV3RendezvousBackend(
        client, params.run_id, signer, key_prefix=options.key_prefix, ttl=options.state_ttl
    )
    store = EtcdV3Store(client, f"{options.key_prefix}/{params.run_id}/store", signer, ttl=options.state_ttl)
    return backend, store


def _parse_token(token: Token) -> int | None:
    """A positive revision, or ``None`` for a token no write could have produced."""
    if isinstance(token, bool):
        return None
    try:
        revision = int(token)
    except (TypeError, ValueError):
        return None
    return revision if revision > 0 else None
