"""Stewards: the few nodes that hear every peer, so that the others need not.

Every node used to watch its run's whole prefix and could close a round itself: each
heard every peer's registry writes and joins, O(N) events per node and O(N^2) through etcd
per round. Only the node that closes a round needs the whole join set, and only someone
who watches the registry learns of a peer's lost lease. A **steward** holds one of a few
slots, ``{run}/rdzv/steward/{i}`` (``i < slots``, 3 by default), under its own lease, and
does both for everyone:

* an open round: it closes it when :func:`.rounds.should_close` says so (the same rule,
  proofs of death and vouching as before), writing the participants, which ran in place,
  and their witness addresses in the round record (one transaction on the revision read:
  of two stewards racing, one wins);
* a closed round with a member whose lease is gone: it opens the next round, cause
  ``failure``, naming the lost members (``lost``), which is how every other member, who
  watches only the round record, learns that a peer was lost.

No single host stalls a round: the slots are several, each lives under its holder's lease,
so a dead or frozen steward's slot frees itself within the TTL, and every node (spares,
too) takes a free slot when it sees one; until then the other stewards act. A steward
that is a member of the previous round and has not joined yet does not close a round (it
would close it without itself); one that is not (a spare, a node kept out) closes on the
others' behalf.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from typing import Callable

from etcd3 import transactions as tx

from agent.etcd import EtcdClient, EtcdError
from agent.etcd.kv import transact
from agent.etcd.mirror import LazyPrefixMirror, PrefixMirror

from agent.rendezvous.late_members import LateMembers
from agent.rendezvous.mirror_view import MirrorView, RoundKeys
from agent.rendezvous.reachability import Reachability
from agent.rendezvous.registry import NodeLease
from agent.rendezvous.round_writes import RoundWriter
from agent.rendezvous.rounds import CLOSED, FAILURE, OPEN, RoundRecord, Timings, lost_members, rank_order, \
    should_close
from agent.rendezvous.signing import SignatureError, StateSigner

log = logging.getLogger(__name__)

DEFAULT_SLOTS = 3
_TICK_S = 0.1  # re-check time-based close rules at least this often
_IDLE_S = 1.0  # a node without a slot looks again at least this often
# A free slot is taken by the first node to see it: each waits a random moment up to this
# long and looks again, so a thousand nodes do not all race for it (a few do).
CLAIM_SPREAD_S = 0.5
# A steward acts on what it sees only once it has stood this long for each steward in a
# slot before its own that could act on it too (alive, and for a close: joined or not
# expected back): at once if none, as their backup otherwise.
BACKUP_AFTER_S = 0.3


def slot_prefix(keys: RoundKeys) -> str:
    return keys.round.rsplit("/", 1)[0] + "/steward/"


class Steward:
    """This node's claim on a steward slot and, while it holds one, the closer's pass.

    ``narrow`` is the node's own small mirror (it shows the slots); ``full`` the run's whole
    prefix, read only while this node stewards.
    """

    def __init__(self, node: str, client: EtcdClient, signer: StateSigner, keys: RoundKeys, lease: NodeLease,
                 narrow: PrefixMirror, full: LazyPrefixMirror, view: MirrorView, writer: RoundWriter,
                 late: LateMembers, reachability: Reachability, timings: Timings, slots: int = DEFAULT_SLOTS) -> None:
        self.node, self.client, self.signer, self.keys, self.lease = node, client, signer, keys, lease
        self.narrow, self.full, self.view, self.writer = narrow, full, view, writer
        self.late, self.reachability, self.timings = late, reachability, timings
        self.slots, self.prefix = slots, slot_prefix(keys)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._first_seen: dict[int, float] = {}  # round -> when its close clock started, here
        self.on_change: list[Callable[[bool], None]] = []  # told when this node starts/stops stewarding
        self._held: str | None = None
        self._seen: tuple[int, float] | None = None  # (round record revision, when first seen) in step

    # ------------------------------------------------------------------ the slots

    def _holder(self, entries: dict, key: str) -> str | None:
        """The node a slot names, if its value verifies and a lease holds it (else: free)."""
        entry = entries.get(key)
        if entry is None or entry.lease == 0:
            return None
        try:
            return str(json.loads(self.signer.open(key.encode(), entry.value))["node"])
        except (SignatureError, ValueError, KeyError, TypeError):
            return None

    def holders(self) -> list[str]:
        """The nodes holding the slots now, as the narrow mirror shows them (no etcd request)."""
        entries = self.narrow.entries()[0]
        return [n for n in (self._holder(entries, f"{self.prefix}{i}") for i in range(self.slots)) if n is not None]

    def holding(self, entries: dict | None = None) -> str | None:
        """The slot key this node holds under its current lease, as the narrow mirror shows it."""
        entries = self.narrow.entries()[0] if entries is None else entries
        lease_id = self.lease._lease_id
        for i in range(self.slots):
            key = f"{self.prefix}{i}"
            entry = entries.get(key)
            if entry is not None and entry.lease == lease_id and self._holder(entries, key) == self.node:
                return key
        return None

    def _free(self, entries: dict) -> bool:
        return any(self._holder(entries, f"{self.prefix}{i}") is None for i in range(self.slots))

    def _claim(self, entries: dict) -> bool:
        """Take the first free slot (one transaction on what was read; False if none was free or
        another node took it first)."""
        free = [i for i in range(self.slots) if self._holder(entries, f"{self.prefix}{i}") is None]
        if not free:
            return False
        key = f"{self.prefix}{free[0]}"
        entry = entries.get(key)
        guard = tx.Version(key) == 0 if entry is None else tx.Mod(key) == entry.mod_revision
        value = self.signer.seal(key.encode(), json.dumps({"node": self.node}).encode())
        try:
            result = self.lease.write(lambda lease_id: transact(
                self.client, [guard], [tx.Put(key, value, lease=lease_id)], deadline=2.0))
        except EtcdError as exc:
            log.debug("[%s] could not take steward slot %s: %s", self.node, key, exc)
            return False
        if result.succeeded:
            log.info("[%s] stewards the rendezvous (slot %d of %d)", self.node, free[0], self.slots)
        return result.succeeded  # False: someone else took it; look again at the next change

    # ------------------------------------------------------------------ the thread

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="elastic-steward", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self.narrow.notify()

    def _run(self) -> None:
        while not self._stop.is_set() and not self.lease.closed:  # a closed lease's node stewards nothing
            try:
                entries, revision = self.narrow.entries()
                held = self.holding(entries) if self.narrow.healthy else self._held
                if held != self._held:
                    self._held = held
                    for callback in list(self.on_change):
                        callback(held is not None)
                if held is None:
                    if self.narrow.healthy and self._free(entries):
                        if self._stop.wait(random.uniform(0.0, CLAIM_SPREAD_S)):
                            return
                        entries, revision = self.narrow.entries()  # taken meanwhile, most likely
                        if self._free(entries) and self._claim(entries):
                            self.narrow.wait(revision, _TICK_S)  # until the mirror shows our slot
                            continue
                    self.narrow.wait(revision, _IDLE_S)
                    continue
                self.full.ensure()
                full_revision = self.full.entries()[1]
                self.step()
                self.full.wait(full_revision, _TICK_S)
            except EtcdError as exc:
                log.debug("[%s] steward: %s", self.node, exc)
                self._stop.wait(_TICK_S)
            except Exception:  # a bug here must not end the node's rendezvous
                log.exception("[%s] steward pass failed", self.node)
                self._stop.wait(1.0)

    # ------------------------------------------------------------------ the closer's pass

    def step(self) -> None:
        """One look at the run, as of the full mirror: close an open round, or open the next
        one after a member's loss."""
        if not self.full.healthy:
            return
        entries, _ = self.full.entries()
        if self.view.closed_in(entries):
            return
        record = self.view.decode_round(entries)
        if record is None or self.keys.round not in entries:
            return
        round_rev = entries[self.keys.round].mod_revision
        if record.state == CLOSED:
            self._after_loss(record, round_rev, entries)
        elif record.state == OPEN:
            self._close(record, round_rev, entries)

    def _ahead(self) -> list[str]:
        """The nodes holding the slots before this node's (the stewards it backs up)."""
        held = self._held or ""
        index = int(held.rsplit("/", 1)[1]) if held.rsplit("/", 1)[-1].isdigit() else 0
        entries = self.narrow.entries()[0]
        return [n for n in (self._holder(entries, f"{self.prefix}{i}") for i in range(index)) if n is not None]

    def _standing(self, round_rev: int, ahead: int) -> bool:
        """Whether the round record as of ``round_rev`` has stood long enough for this node to
        act with ``ahead`` stewards before it that could act too: at once if none, else after
        ``ahead`` x BACKUP_AFTER_S (one write per change, not one per steward racing for it)."""
        now = time.monotonic()
        if self._seen is None or self._seen[0] != round_rev:
            self._seen = (round_rev, now)
        return now - self._seen[1] >= ahead * BACKUP_AFTER_S

    def _after_loss(self, record: RoundRecord, round_rev: int, entries: dict) -> None:
        if self.lease.suspect_lost():
            return  # just thawed: our picture is older than our peers'
        live = self.view.live(entries)
        forged = self.view.forged_lately(entries)  # a forgery over a live member's key is no death
        lost = [n for n in lost_members(record, live) if n not in forged]
        if not lost or not self._standing(round_rev, len([n for n in self._ahead() if n in live and n not in lost])):
            return
        if self.writer.swap(round_rev, record.next_open(FAILURE, lost)):
            log.info("[%s] opened round %d: %s lost %s lease", self.node, record.round + 1, ", ".join(lost),
                     "its" if len(lost) == 1 else "their")

    def _close(self, record: RoundRecord, round_rev: int, entries: dict) -> None:
        excluded = self.reachability.excluded(record, entries)
        keys = self.view.joined(entries, record.round)
        joined = {n: rev for n, rev in keys.items() if n not in excluded}
        if self.node in record.previous and self.node not in joined:
            return  # we are expected back ourselves: a member that has joined closes it
        live = self.view.live(entries)
        if len(joined) >= self.timings.min_nodes or record.previous:
            self._first_seen.setdefault(record.round, time.monotonic())
        since = self._first_seen.get(record.round)
        waited = time.monotonic() - since if since is not None else 0.0
        dead = self.late.proven_dead(record, joined, entries) | excluded  # neither is waited for
        vouched = self.late.vouched(record, joined, entries, live, dead, since)
        if not should_close(record, joined, live, self.timings, waited, dead, vouched):
            return
        able = [n for n in self._ahead() if n not in dead and (n in joined or n not in record.previous)]
        if not self._standing(round_rev, len(able)):  # a steward before us can close it: ours is the backup
            return
        participants = rank_order(joined, record.previous, self.timings.max_nodes)
        records = self.view.records(entries)
        running = [n for n, r in records.items() if r.extra.get("in_place")]
        witnesses = {n: records[n].witness_addr if n in records else None for n in participants}
        if self.writer.swap(round_rev, record.closed_with(participants, running, witnesses)):
            self.writer.forget(record.round - 2)
            for old in [r for r in self._first_seen if r < record.round]:
                del self._first_seen[old]
