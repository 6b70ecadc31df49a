"""``etcd-v3-dynamic``: torch's own ``DynamicRendezvousHandler`` over our v3 backend and store.

``etcd-v3`` (:mod:`.handler`) is the watch-driven, lease-aware rendezvous and the one to
use. This one stays for comparison (``bench/recovery.py``) and for users who want torch's
exact round semantics on etcd v3. It carries two fixes for node loss:

* torch caches the address of the TCPStore that rank 0's agent hosts after the first
  round. If rank 0's node dies, a survivor that stays non-zero keeps sending its workers
  to the dead store. We rebuild that address every round.
* torch's monitor loop calls ``num_nodes_waiting`` unguarded, so one failed etcd read
  would end a healthy job. We treat "etcd unreachable" as "nobody waiting" and keep
  training; a real peer loss still surfaces through the workers and the agent.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta

from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousInfo,
    RendezvousParameters,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousTimeout,
)

from agent.etcd import EtcdClient, EtcdUnavailableError

from agent.rendezvous.backend import EtcdV3RendezvousBackend
from agent.rendezvous.options import connect
from agent.rendezvous.store import EtcdV3Store

log = logging.getLogger(__name__)

# While etcd is away, the monitor loop asks again at most this often.
_UNREACHABLE_BACKOFF_S = 1.0
_MONITOR_DEADLINE_S = 0.5


class EtcdV3DynamicHandler(DynamicRendezvousHandler):
    """``DynamicRendezvousHandler`` made safe for losing rank 0's node and etcd blips."""

    _etcd: EtcdClient
    _unreachable_since: float | None = None

    def get_backend(self) -> str:
        return "etcd-v3-dynamic"

    def next_rendezvous(self) -> RendezvousInfo:
        self._bootstrap_store_info = None  # re-read this round's MASTER_ADDR/PORT
        return super().next_rendezvous()

    def num_nodes_waiting(self) -> int:
        now = time.monotonic()
        if self._unreachable_since is not None and now - self._unreachable_since < _UNREACHABLE_BACKOFF_S:
            return 0
        try:
            with self._etcd.deadline(_MONITOR_DEADLINE_S):
                waiting = super().num_nodes_waiting()
        except RendezvousConnectionError as exc:
            if self._unreachable_since is None:
                log.warning("etcd unreachable; training goes on, will retry: %s", exc)
            self._unreachable_since = now
            return 0
        if self._unreachable_since is not None:
            log.info("etcd reachable again after %.1f s", now - self._unreachable_since)
            self._unreachable_since = None
        return waiting


def create_dynamic_handler(params: RendezvousParameters) -> EtcdV3DynamicHandler:
    """Build the handler, checking etcd is reachable and lets us in before returning.

    Raises :class:`EtcdConfigError`, :class:`HmacKeyError` or :class:`EtcdError` with
    one line a user can act on; torch's :class:`RendezvousConnectionError` (that line, the
    :class:`EtcdUnavailableError` as its cause) when etcd does not answer, as torch's own
    factories do.
    """
    try:
        options, signer, client = connect(params)
    except EtcdUnavailableError as exc:
        raise RendezvousConnectionError(str(exc)) from exc
    backend = EtcdV3RendezvousBackend(
        client, params.run_id, signer, key_prefix=options.key_prefix, ttl=options.state_ttl
    )

    store = EtcdV3Store(
        client,
        f"{options.key_prefix}/{params.run_id}/store",
        signer,
        ttl=options.state_ttl,
    )
    t = options.timings
    handler = EtcdV3DynamicHandler.from_backend(
        params.run_id,
        store,
        backend,
        params.min_nodes,
        params.max_nodes,
        params.local_addr,
        RendezvousTimeout(
            join=timedelta(seconds=t["join_timeout"]),
            last_call=timedelta(seconds=t["last_call_timeout"]),
            close=timedelta(seconds=t["close_timeout"]),
            heartbeat=_optional_seconds(params, "heartbeat_timeout"),
        ),
        keep_alive_interval=t["keep_alive_interval"],
        keep_alive_max_attempt=t["keep_alive_max_attempt"],
    )
    handler._etcd = client
    return handler


def _optional_seconds(params: RendezvousParameters, key: str) -> timedelta | None:
    value = params.get_as_int(key)
    return None if value is None else timedelta(seconds=value)
