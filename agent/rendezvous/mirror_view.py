"""What the watch-fed mirror says, verified: the round record, joins, the node registry.

The handler's one reader of its run's keys (``RoundKeys``). Every value is opened with the
job key before it is acted on; one that fails, or is signed but stale (an older value put
back), is never read as absent at once: its last good value stands (:mod:`.last_good`), one
WARNING per key is logged (rate-limited), and where this node can it puts a good value back
in the background. Answers come from the ``entries`` the caller passes (no etcd request), so
torch's monitor loop can call it at any time. Thread-safe.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

from agent.etcd import EtcdError
from agent.etcd.mirror import Entry

from agent.rendezvous.freshness import lease_stale, round_order, round_stale
from agent.rendezvous.last_good import LastGood
from agent.rendezvous.memo import DecodeMemo
from agent.rendezvous.registry import NodeLease, NodeRecord, decode_node, nodes_prefix, run_prefix
from agent.rendezvous.rounds import CLOSED, RoundRecord
from agent.rendezvous.signing import SignatureError, StateSigner

log = logging.getLogger(__name__)

_FORGERY_WARN_EVERY_S = 30.0  # one WARNING per forged key in this long, however often it is rewritten


@dataclass(frozen=True)
class RoundKeys:
    """Where one run's rendezvous lives in etcd (see the handler's module docstring)."""

    prefix: str  # the run's root: everything the mirror watches is under it
    round: str
    join_prefix: str  # + "{round}/{node}"
    closed: str
    nodes_prefix: str
    store_prefix: str

    @classmethod
    def of(cls, key_prefix: str, run_id: str) -> RoundKeys:
        prefix = run_prefix(key_prefix, run_id)
        return cls(prefix, f"{prefix}/rdzv/round", f"{prefix}/rdzv/join/", f"{prefix}/rdzv/closed",
                   nodes_prefix(key_prefix, run_id), f"{prefix}/store")

    def join(self, round_number: int, node: str) -> str:
        return f"{self.join_prefix}{round_number}/{node}"


class MirrorView:
    """Decodes mirror entries into the facts the round protocol acts on.

    ``swap_round(expected_mod_revision, record)`` is the one write it makes itself: putting
    the last good round record back over one that does not verify (the handler passes its
    :class:`.round_writes.RoundWriter`'s ``swap``). ``lease`` is this node's own registry
    entry: a stale copy of it is answered by rewriting it.
    """

    def __init__(self, node: str, signer: StateSigner, keys: RoundKeys, lease: NodeLease, lease_ttl: float,
                 swap_round: Callable[[int, RoundRecord], bool]) -> None:
        self.node, self.signer, self.keys, self.lease = node, signer, keys, lease
        self._swap_round = swap_round
        self._nodes_memo = DecodeMemo(lambda key, value: decode_node(signer, key, value, quiet=True))
        self._joins_memo: DecodeMemo[bool] = DecodeMemo(self._open_join)
        # a value that fails verification is never acted on, nor read as absent at once (last_good.py)
        self.round_good: LastGood[RoundRecord] = LastGood(grace=float("inf"))  # a member's memory stands
        self._nodes_good: LastGood[NodeRecord] = LastGood(grace=lease_ttl)
        self._forgeries_seen: set[tuple[str, int]] = set()  # (key, mod revision) already answered
        self._forgery_warned_at: dict[str, float] = {}
        self._warned: set[str] = set()
        self._lock = threading.Lock()
        # (mod revision, record) of the last round record that verified: etcd gives every write
        # of the key a new revision, so one seen before is not opened and parsed again (the
        # record names every member: per monitor tick that was O(N) work on every node)
        self._round_memo: tuple[int, RoundRecord] | None = None

    def signed(self, key: str, value: bytes) -> bool:
        try:
            self.signer.open(key.encode(), value)
            return True
        except SignatureError:
            if key not in self._warned:
                self._warned.add(key)
                log.warning("ignoring forged %s (written with another job key?)", key)
            return False

    def closed_in(self, entries: dict) -> bool:
        entry = entries.get(self.keys.closed)
        return entry is not None and self.signed(self.keys.closed, entry.value)

    def decode_round(self, entries: dict) -> RoundRecord | None:
        """The round record to act on: the one in etcd if it verifies, else the last good one
        this node saw (None if it saw none: the handler then waits for a member to put one back)."""
        key = self.keys.round
        entry = entries.get(key)
        if entry is None:
            return None
        record: RoundRecord | None = None
        memo = self._round_memo
        if memo is not None and memo[0] == entry.mod_revision:
            record = memo[1]
        else:
            try:
                record = RoundRecord.from_json(self.signer.open(key.encode(), entry.value))
                self._round_memo = (entry.mod_revision, record)
            except (SignatureError, ValueError, KeyError, TypeError) as exc:
                self._answer_forgery(key, entry.mod_revision, str(exc) or type(exc).__name__, self._put_round_back)
        last = self.round_good.last(key)
        if record is not None and last is not None and round_stale(
                round_order(last.round, last.state == CLOSED), round_order(record.round, record.state == CLOSED)):
            self._answer_forgery(key, entry.mod_revision,
                                 f"it is signed but stale: round {record.round} ({record.state}) after round "
                                 f"{last.round} ({last.state}), an older record put back", self._put_round_back)
            record = None
        return self.round_good.resolve(key, record, time.monotonic())

    def _put_round_back(self, forged_revision: int) -> None:
        """Replace a round record that does not verify with the last good one, unless somebody
        (a member racing us, the protocol moving on) replaced it first."""
        good = self.round_good.last(self.keys.round)
        if good is not None and self._swap_round(forged_revision, good):
            log.info("[%s] put round %d's record back over one it could not act on (forged or stale)", self.node,
                     good.round)

    def _answer_forgery(self, key: str, mod_revision: int, why: str,
                        repair: Callable[[int], None] | None) -> None:
        """Once per forged value: one WARNING per key (rate-limited) and, where this node
        can, a repair in the background (the callers are the monitor loop and the
        rendezvous; neither may wait on etcd for it)."""
        with self._lock:
            if (key, mod_revision) in self._forgeries_seen:
                return
            self._forgeries_seen.add((key, mod_revision))
            now = time.monotonic()
            warn = now - self._forgery_warned_at.get(key, -_FORGERY_WARN_EVERY_S) >= _FORGERY_WARN_EVERY_S
            if warn:
                self._forgery_warned_at[key] = now
        log.log(logging.WARNING if warn else logging.DEBUG,
                "[%s] ignoring %s: it fails verification (%s); its last good value stands%s", self.node, key, why,
                " and this node puts it back" if repair is not None else "")
        if repair is not None:
            threading.Thread(target=self._repair, args=(repair, mod_revision), name="elastic-repair",
                             daemon=True).start()

    def _repair(self, repair: Callable[[int], None], mod_revision: int) -> None:
        try:
            repair(mod_revision)
        except EtcdError as exc:
            log.warning("[%s] could not put a good value back: %s", self.node, exc)

    def _open_join(self, key: str, value: bytes) -> bool | None:
        try:
            self.signer.open(key.encode(), value)
            return True
        except SignatureError:
            log.warning("ignoring forged join key %s", key)
            return None

    def joined(self, entries: dict, round_number: int) -> dict[str, int]:
        """The nodes joined to ``round_number``: join keys that verify and are held by a lease
        (a join is put under its node's lease: one put back without a lease is a replay)."""
        prefix = f"{self.keys.join_prefix}{round_number}/"
        ours = [(key, entry.value) for key, entry in entries.items()
                if key.startswith(prefix) and self._current(key, entry)]
        return {key[len(prefix):]: entries[key].create_revision for key, _ in self._joins_memo.decode(ours)}

    def records(self, entries: dict) -> dict[str, NodeRecord]:
        """Every registered node's record. A key whose value does not verify keeps its last
        good record for a lease TTL (its agent, if alive, rewrites it at once): a forgery is
        never read as a node's death, nor as a new node."""
        ours = [(key, entry.value) for key, entry in entries.items() if key.startswith(self.keys.nodes_prefix)]
        verified = {key: record for key, record in self._nodes_memo.decode(ours) if self._current(key, entries[key])}
        now, records = time.monotonic(), {}
        for key, _ in ours:
            record = verified.get(key)
            own = key == self.lease.key
            if record is not None and own and not self.lease.ours(entries[key].mod_revision, entries[key].value):
                record = None  # signed, but not what this node last wrote: an older record of its own put back
                self._answer_forgery(key, entries[key].mod_revision, "it is signed but stale: not this agent's "
                                     "last write (an older record put back)", lambda _rev: self.lease.update())
            elif record is None:
                self._answer_forgery(key, entries[key].mod_revision, "not a record signed with the job key",
                                     (lambda _rev: self.lease.update()) if own else None)
            record = self._nodes_good.resolve(key, record, now)
            if record is not None:
                records[record.node] = record
        self._nodes_good.keep_only({key for key, _ in ours})
        return records

    def _current(self, key: str, entry: Entry) -> bool:
        """False (one WARNING per value) for a key that must live under its writer's lease but
        is held by none: signed bytes put back later, never a join nor a live node."""
        stale = lease_stale(entry.lease)
        if stale is None:
            return True
        if (key, entry.mod_revision) not in self._forgeries_seen:
            self._forgeries_seen.add((key, entry.mod_revision))
            log.warning("[%s] ignoring %s: it verifies but is stale, %s", self.node, key, stale)
        return False

    def forged_lately(self, entries: dict) -> set[str]:
        """Nodes whose registry key is there but has failed verification for less than the grace
        (after :meth:`records` read ``entries``): not known dead. A view started after the
        forgery has no last good value to stand in, and its owner, if alive, rewrites the key
        within the grace; until then the node is neither live nor lost."""
        now, prefix = time.monotonic(), self.keys.nodes_prefix
        return {key[len(prefix):] for key in entries if key.startswith(prefix)
                and (age := self._nodes_good.forged_for(key, now)) is not None and age < self._nodes_good.grace}

    def live(self, entries: dict) -> dict[str, str]:
        """Every live node's registry state (``rendezvous``, ``running``, ``spare``...), by name."""
        return {node: record.state for node, record in self.records(entries).items()}
