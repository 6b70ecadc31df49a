"""The node registry: one key per live agent, ``{prefix}/{run_id}/nodes/{node}``.

Each key lives under its node's lease (TTL of a few seconds, refreshed about four times
per TTL), so a killed, frozen or partitioned node drops out of the registry on its own,
without anyone having to notice it first. The value is a signed JSON :class:`NodeRecord`
that tells tools (``elastic kill``, ``elastic top``, ``elastic sd``) where the node is
and what it is doing; the rendezvous uses the key's mere presence as "this node is alive".
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, TypeVar

from etcd3 import transactions as tx

from elastic import contract
from agent.etcd import EtcdClient, EtcdError
from agent.etcd.keepalive import KeepAlive
from agent.etcd.kv import is_lease_not_found, transact

from agent.rendezvous.lease_clock import LeaseClock
from agent.rendezvous.signing import HmacKeyError, SignatureError, StateSigner
from agent.rendezvous.states import NodeState

log = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_LEASE_TTL = 3  # seconds: how long a frozen or cut-off node keeps its place


def run_prefix(key_prefix: str, run_id: str) -> str:
    return f"{key_prefix.rstrip('/')}/{run_id}"


def nodes_prefix(key_prefix: str, run_id: str) -> str:
    return f"{run_prefix(key_prefix, run_id)}/nodes/"


def default_node_name() -> str:
    """Host name, plus the pid where several agents share a host (``elastic local``)."""
    return os.environ.get(contract.NODE_NAME_ENV) or f"{socket.gethostname()}-{os.getpid()}"


@dataclass(frozen=True)
class NodeRecord:
    """What a node says about itself. ``state`` is the agent's worker-group state."""

    node: str
    host: str
    pid: int
    addr: str | None = None
    metrics_url: str | None = None
    state: str = NodeState.STARTING.value
    round: int | None = None
    rank: int | None = None
    world: int | None = None
    started_at: float = field(default_factory=time.time)
    store_addr: str | None = None  # host:port of the agent's round store (in-place recovery)
    witness_addr: str | None = None  # host:port where peers ask how this node's keep-alives fare
    nproc: int | None = None  # local workers: ranks are assigned node by node
    pace: float | None = None  # its slowest rank's median compute seconds per step (agent.node.pace: stragglers)
    pace_step: int | None = None  # the job step its workers had reached when ``pace`` was read
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "NodeRecord":
        """Raises ValueError on anything that is not a record :meth:`to_json` wrote: a field
        of the wrong type (a pid that is text, say) would reach ``elastic kill`` or the
        rendezvous as if it were one. Fields it does not know are ignored."""
        try:
            data = json.loads(raw)
        except RecursionError:
            raise ValueError("not a node record: nested too deeply") from None
        if not isinstance(data, dict):
            raise ValueError("not a node record: not a JSON object")
        missing = [k for k in ("node", "host", "pid") if k not in data]
        if missing:
            raise ValueError(f"not a node record: no {', '.join(missing)}")
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        for name, value in known.items():
            kinds = _FIELD_TYPES[name]
            if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
                raise ValueError(f"node record field {name}={value!r:.40} has the wrong type")
        started_at = known.get("started_at", 0.0)
        if not -1e300 < started_at < 1e300:
            raise ValueError(f"node record started_at={started_at!r:.40} is not a time")
        if "started_at" in known:
            known["started_at"] = float(started_at)
        return cls(**known)


_OPT_STR, _OPT_INT = (str, type(None)), (int, type(None))
_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "node": (str,), "host": (str,), "pid": (int,), "addr": _OPT_STR, "metrics_url": _OPT_STR, "state": (str,),
    "round": _OPT_INT, "rank": _OPT_INT, "world": _OPT_INT, "started_at": (int, float), "store_addr": _OPT_STR,
    "witness_addr": _OPT_STR, "nproc": _OPT_INT, "extra": (dict,), "pace": (int, float, type(None)),
    "pace_step": _OPT_INT,
}


def decode_node(signer: StateSigner, key: bytes | str, value: bytes, quiet: bool = False) -> NodeRecord | None:
    """A registry value, or None if it is forged, from another key, or not ours at all
    (``quiet``: the caller says so itself, once per key)."""
    key_bytes = key.encode() if isinstance(key, str) else key
    try:
        return NodeRecord.from_json(signer.open(key_bytes, value))
    except (SignatureError, ValueError, TypeError, KeyError) as exc:
        log.log(logging.DEBUG if quiet else logging.WARNING, "ignoring registry entry %s: %s",
                key_bytes.decode(errors="replace"), exc)
        return None


def list_nodes(client: EtcdClient, run_id: str, signer: StateSigner, key_prefix: str = "/elastic",
               strict: bool = False) -> list[NodeRecord]:
    """Every node that holds a live lease in ``run_id``, in name order.

    ``strict`` (a tool about to act): raises :class:`HmacKeyError` if the records are signed
    and ``signer`` has no key, since an unsigned forgery among them would pass for real."""
    prefix = nodes_prefix(key_prefix, run_id)
    rows = client.call(lambda c: list(c.get_prefix(prefix)))
    if strict and any(signer.lacks_key_for(value) for value, _ in rows):
        raise HmacKeyError(
            f"run {run_id!r}'s registry is signed with a job key this tool does not have, so it cannot tell a "
            f"forged record from a real one and does nothing: give it the key ({contract.HMAC_KEY_FILE_ENV}=PATH or "
            "--rdzv-conf hmac_key_file=PATH)"
        )
    records = []
    for value, meta in rows:
        if meta.lease_id == 0:  # an agent's record lives under its lease: this one is older bytes put back
            log.warning("ignoring registry entry %s: held by no lease, so no live agent's (a replay)",
                        meta.key.decode(errors="replace"))
            continue
        records.append(decode_node(signer, meta.key, value))
    return sorted((r for r in records if r is not None), key=lambda r: r.node)


class NodeNameInUseError(RuntimeError):
    """Another live agent of this job registered under this node's name."""


class NodeLease:
    """This node's lease and registry key, kept alive by a daemon thread.

    If the lease is lost (the process was frozen past the TTL, or etcd lost it), a new
    lease is granted and the key rewritten; ``generation`` counts those losses so the
    rendezvous can tell that this node's place in its round is void.
    """

    def __init__(self, client: EtcdClient, key_prefix: str, run_id: str, record: NodeRecord,
                 signer: StateSigner, ttl: int) -> None:
        if ttl < 2:
            raise ValueError("the node lease TTL must be at least 2 seconds (etcd's minimum)")
        self.client, self.signer, self.ttl = client, signer, ttl
        self.key = nodes_prefix(key_prefix, run_id) + record.node
        self._record = record
        self._lock = threading.Lock()  # the lease id and the record; never held across a request but a grant
        self._put_lock = threading.Lock()  # record writes, one at a time
        # (etcd revision, bytes) of this node's last confirmed record write, and the bytes being
        # written now: a value of its key after that revision that is neither was put there by
        # somebody else (an older record of its own put back: ``ours``)
        self._last_write: tuple[int, bytes] = (0, b"")
        self._writing: bytes = b""
        self._lease_id: int | None = None
        self.generation = 0
        self.on_lost: list[Callable[[], None]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_tick = time.monotonic()
        self._confirmed_at: float | None = None  # send time of the last keep-alive (or grant) etcd confirmed
        self._failing_since: float | None = None  # send time of the first failed attempt after it
        self._keep_alive_sender = KeepAlive(client)

    @property
    def record(self) -> NodeRecord:
        return self._record

    @property
    def closed(self) -> bool:
        """Closed (or stopped): the lease is never granted again, by any thread of this node."""
        return self._stop.is_set()

    def ours(self, mod_revision: int, value: bytes) -> bool:
        """Whether ``value`` at ``mod_revision`` of this node's key is its own latest write (or one
        in flight); False for anything written there since by somebody else, e.g. an older
        signed record of this node put back under its live lease."""
        revision, written = self._last_write
        return mod_revision <= revision or value in (written, self._writing)

    def lease_id(self) -> int:
        known = self._lease_id
        if known is not None:
            return known  # no lock: the keep-alive must never wait behind another thread's request
        with self._lock:
            if self._lease_id is None:
                if self._stop.is_set():
                    raise EtcdError(f"node {self._record.node}'s lease was closed; it is not granted again")
                self._grant()
            assert self._lease_id is not None
            return self._lease_id

    def _grant(self, guard: Any = None) -> bool:
        """A new lease and the record under it; with ``guard``, only if it holds (else the
        lease is revoked and False returned)."""
        sent = time.monotonic()
        lease = self.client.call(lambda c: c.lease(self.ttl))
        if guard is not None:
            value = self.signer.seal(self.key.encode(), self._record.to_json())
            self._writing = value
            result = transact(self.client, [guard], [tx.Put(self.key, value, lease=lease.id)])
            if not result.succeeded:
                self.client.call(lambda c: c.revoke_lease(lease.id), deadline=2.0)
                return False
            self._last_write = (result.revision, value)
        self._lease_id = lease.id
        self._confirmed(sent)
        if guard is None:
            self._put()
        return True

    def _claim(self, patience: float) -> None:
        """Register under this node's name only if no live agent of the job holds it.

        Two agents under one name would be one member to the rendezvous and two to
        training (a split job). A record that verifies, held under a lease by another
        process, is a live agent's, or a previous incarnation's whose lease runs out
        within a TTL (a quick restart): wait that long, then refuse. A value that does not
        verify, or has no lease, is no agent's: take it over. The put is a transaction on
        what was read, so two agents starting at once cannot both win.
        """
        deadline = time.monotonic() + patience
        while True:
            value, meta = self.client.call(lambda c: c.get(self.key))
            holder = decode_node(self.signer, self.key, value, quiet=True) if value is not None else None
            live = holder is not None and meta.lease_id != 0 and (holder.host, holder.pid, holder.started_at) != (
                self._record.host, self._record.pid, self._record.started_at)
            if live:
                assert holder is not None
                if time.monotonic() >= deadline:
                    raise NodeNameInUseError(
                        f"node name {self._record.node!r} is in use by a live agent of this job (host {holder.host}, "
                        f"pid {holder.pid}); give every agent its own --node-name, or leave it unset "
                        "(hostname-pid)")
                time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
                continue
            guard = tx.Version(self.key) == 0 if value is None else tx.Mod(self.key) == meta.mod_revision
            if self._grant(guard):
                return

    def _confirmed(self, sent: float) -> None:
        if self._confirmed_at is None or sent > self._confirmed_at:
            self._confirmed_at = sent
        self._failing_since = None

    def _failed(self, sent: float) -> None:
        if self._failing_since is None:
            self._failing_since = sent

    @property
    def keep_alive_member(self) -> str:
        """The etcd member (``host:port``) the next keep-alive goes to first."""
        return self._keep_alive_sender.preferred

    def clock(self) -> LeaseClock:
        """What this node knows of its lease, for :func:`.lease_clock.judge`."""
        return LeaseClock(float(self.ttl), self._confirmed_at, self._failing_since)

    def _put(self, deadline: float | None = None) -> None:
        """Write the record (the newest one when several threads update it at once)."""
        with self._put_lock:
            lease_id, record = self._lease_id, self._record
            if lease_id is None:
                return
            value = self.signer.seal(self.key.encode(), record.to_json())
            self._writing = value
            result = transact(self.client, [], [tx.Put(self.key, value, lease=lease_id)], deadline=deadline)
            self._last_write = (result.revision, value)

    def start(self, patience: float | None = None) -> "NodeLease":
        """Claim this node's name (see :meth:`_claim`), then keep the lease alive."""
        self._claim(self.ttl + 1.0 if patience is None else patience)
        self._last_tick = time.monotonic()  # the freeze clock starts now, not when we were built
        self._thread = threading.Thread(target=self._keep_alive, name="elastic-node-lease", daemon=True)
        self._thread.start()
        return self

    def update(self, **changes: Any) -> None:
        """Rewrite the record (state, round, rank...); best effort while etcd is away."""
        with self._lock:
            self._record = replace(self._record, **changes)
            if self._lease_id is None:
                return
        try:
            with self.client.deadline(1.0):
                self._put(deadline=1.0)
        except EtcdError as exc:
            log.debug("registry update deferred: %s", exc)

    def suspect_lost(self) -> bool:
        """True right after this process was frozen (SIGSTOP, a VM pause) for over the TTL.

        The keep-alive thread ticks every TTL/4 whether or not etcd answers, so a gap
        longer than the TTL means nobody was running here: peers have already written
        us off, before the first refresh after thawing can confirm it. An etcd outage
        leaves no gap, and so is never mistaken for our own loss.
        """
        return self._thread is not None and time.monotonic() - self._last_tick > self.ttl

    def _keep_alive(self) -> None:
        """Refresh every TTL/4 on a fixed schedule; after a failed attempt, again after a
        fifth of that. The node judges its lease by its own clock (the last confirmed
        keep-alive), so while etcd elects a leader (every member answers "no leader" at
        once) the first keep-alive that can succeed must not wait for the next tick: at a
        3 s TTL an election can otherwise use up the whole margin and the node fences
        itself for nothing. Each keep-alive asks every member when the one in use is slow
        (:mod:`agent.etcd.keepalive`)."""
        interval = self.ttl / 4
        next_tick = time.monotonic()
        while True:
            next_tick = max(next_tick + interval, time.monotonic())
            if self._stop.wait(next_tick - time.monotonic()):
                return
            confirmed = self.refresh(interval)
            self._last_tick = time.monotonic()
            if not confirmed:
                next_tick = min(next_tick, self._last_tick + interval / 5 - interval)

    def refresh(self, timeout: float) -> bool:
        """One keep-alive now; True if etcd confirmed the lease (or granted a new one).

        A failure is not a verdict on us (etcd may be down for everyone, and then it
        extends every lease when it returns); it is recorded, and the rendezvous judges it
        by this node's clock and its peers' word (:mod:`.lease_clock`).
        """
        sent = time.monotonic()
        try:
            lease_id = self.lease_id()
            ttl = self._keep_alive_sender.refresh(lease_id, timeout=timeout, attempt=timeout / 2)
        except EtcdError as exc:
            log.debug("lease refresh failed (etcd unreachable?): %s", exc)
            self._failed(sent)
            return False
        if ttl <= 0:
            self._lost(lease_id)
            return self._lease_id is not None
        self._confirmed(sent)
        return True

    def _lost(self, lost_id: int | None) -> None:
        with self._lock:
            if lost_id is not None and self._lease_id not in (lost_id, None):
                return  # another thread already replaced it
            self.generation += 1
            self._lease_id = None
            if self._stop.is_set():
                return  # closed (or stopped, as a frozen agent's): no thread of ours brings it back
            log.warning("node %s lost its etcd lease (frozen or cut off for over %d s); rejoining",
                        self._record.node, self.ttl)
            self._record = replace(self._record, state=NodeState.REJOINING.value, round=None, rank=None, world=None)
            try:
                self._grant()
            except EtcdError as exc:
                log.warning("could not re-register yet: %s", exc)
        for callback in list(self.on_lost):
            callback()

    def write(self, put: Callable[[int], T]) -> T:
        """``put(lease_id)`` for a key that must live and die with this node; if etcd says
        the lease is gone, the loss is handled here and the put made under the new one."""
        lease_id = self.lease_id()
        try:
            return put(lease_id)
        except EtcdError as exc:
            if not is_lease_not_found(exc):
                raise
            self._lost(lease_id)
            return put(self.lease_id())

    def close(self) -> None:
        """Revoke the lease: peers see this node leave at once instead of after the TTL."""
        self._stop.set()
        self._keep_alive_sender.close()
        with self._lock:
            lease_id, self._lease_id = self._lease_id, None
        if lease_id is not None:
            try:
                self.client.call(lambda c: c.revoke_lease(lease_id), deadline=2.0)
            except EtcdError:
                pass
