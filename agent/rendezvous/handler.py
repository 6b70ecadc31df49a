"""The ``etcd-v3`` rendezvous: watch-driven and lease-aware, on torch's ``RendezvousHandler``.

torch's ``DynamicRendezvousHandler`` polls its backend once a second and can only learn
that a node is dead by missing its heartbeats; a node loss costs seconds in rendezvous
alone. This handler keeps per-node keys under short etcd leases and a round record
updated by transaction (JSON, HMAC-sealed), and learns of every change through one watch:

* ``{run}/nodes/{node}``: the node registry (:mod:`.registry`), one key per live agent.
* ``{run}/rdzv/round``: the current round: number, ``open``/``closed``, participants.
* ``{run}/rdzv/join/{round}/{node}``: "this node wants to be in that round", under the
  node's lease, so a node that dies while joining leaves no ghost.
* ``{run}/rdzv/closed``: the job is over (:meth:`set_closed`), and how it ended: a
  ``succeeded`` or ``failed`` outcome and its cause, so every agent exits as the job did.

A later round closes the moment every surviving member has joined; only a member that
looks alive but has not moved (its lease outlives a SIGKILL by up to the TTL) costs a
short ``rejoin_timeout``. ``num_nodes_waiting`` answers from memory, so torch's monitor
loop sees a new round, a lost peer or a lost own lease within one monitor interval, and
an etcd outage cannot stall or kill a healthy job.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from typing import Callable

import torch.distributed as dist
from etcd3 import transactions as tx
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)

from agent.etcd import EtcdClient, EtcdError
from agent.etcd.kv import transact
from agent.etcd.mirror import Entry, PrefixMirror

from agent.rendezvous.ended import JobEnded
from agent.rendezvous.freshness import lease_stale, round_order, round_stale
from agent.rendezvous.last_good import LastGood
from agent.rendezvous.lease_clock import Verdict, still_reaches_etcd
from agent.rendezvous.lease_watch import LeaseWatch
from agent.rendezvous.memo import DecodeMemo
from agent.rendezvous.options import RendezvousOptions, connect
from agent.rendezvous.probe import DeathProbe
from agent.rendezvous.reachability import Reachability
from agent.rendezvous.registry import (
    NodeLease,
    NodeNameInUseError,
    NodeRecord,
    decode_node,
    default_node_name,
    nodes_prefix,
    run_prefix,
)
from agent.rendezvous.rounds import (CLOSED, FAILURE, JOIN, OPEN, RoundRecord, Timings, lost_members, missing_members, rank_order,
                     should_close, waits_as_spare)
from agent.rendezvous.signing import SignatureError, StateSigner
from agent.rendezvous.store import EtcdV3Store
from agent.rendezvous.witness import PeerAsker

log = logging.getLogger(__name__)

_TICK_S = 0.1  # re-check time-based close rules at least this often
_VOUCH_TIMEOUT_S = 0.3  # a late member's witness answers well within the rejoin timeout, or not at all
_FORGERY_WARN_EVERY_S = 30.0  # one WARNING per forged key in this long, however often it is rewritten

# Why num_nodes_waiting asked for a restart; the agent exports and logs it.
PEER_LOST, LEASE_LOST, NEW_ROUND = "peer_lost", "lease_lost", "scale_up"


class RendezvousStateError(RendezvousError):
    """The job's round record cannot be verified and no member puts a good one back: this
    agent cannot join (a different job key, or forged state). Never "finished": the agent
    exits non-zero."""


class EtcdV3RendezvousHandler(RendezvousHandler):
    """One node's view of the job's rounds. Thread-safe for torch's agent and our watchdog."""

    def __init__(
        self,
        run_id: str,
        options: RendezvousOptions,
        client: EtcdClient,
        signer: StateSigner,
        min_nodes: int,
        max_nodes: int,
        local_addr: str | None,
        node_name: str,
    ) -> None:
        if not 1 <= min_nodes <= max_nodes:
            raise ValueError(f"--nnodes {min_nodes}:{max_nodes}: need 1 <= MIN <= MAX")
        self.run_id, self.options, self.client, self.signer = run_id, options, client, signer
        self.node, self.local_addr = node_name, local_addr
        self.timings = Timings(min_nodes, max_nodes, options.last_call, options.rejoin_timeout)
        prefix = run_prefix(options.key_prefix, run_id)
        self._round_key = f"{prefix}/rdzv/round"
        self._join_prefix = f"{prefix}/rdzv/join/"
        self._closed_key = f"{prefix}/rdzv/closed"
        self._nodes_prefix = nodes_prefix(options.key_prefix, run_id)
        self._store_prefix = f"{prefix}/store"
        self._store = EtcdV3Store(client, self._store_prefix, signer, ttl=options.state_ttl)
        self.lease = NodeLease(
            client, options.key_prefix, run_id,
            NodeRecord(node=node_name, host=socket.gethostname(), pid=os.getpid(), addr=local_addr),
            signer, options.lease_ttl,
        )
        self.mirror = PrefixMirror(client, prefix + "/")
        self._nodes_memo = DecodeMemo(lambda key, value: decode_node(signer, key, value, quiet=True))
        # a value that fails verification is never acted on, nor read as absent at once (last_good.py)
        self._round_good: LastGood[RoundRecord] = LastGood(grace=float("inf"))  # a member's memory stands
        self._nodes_good: LastGood[NodeRecord] = LastGood(grace=float(options.lease_ttl))
        self._forgeries_seen: set[tuple[str, int]] = set()  # (key, mod revision) already answered
        self._forgery_warned_at: dict[str, float] = {}
        self._joins_memo: DecodeMemo[bool] = DecodeMemo(self._open_join)
        self._lock = threading.Lock()
        self.round: RoundRecord | None = None  # the round our current workers belong to
        self._lease_generation = 0
        self._started = False
        self._joined_once = False
        self._warned: set[str] = set()
        self.on_round: list[Callable[[RoundRecord], None]] = []
        # told True when this node starts waiting as a spare (a full world without it), False when it
        # leaves that wait (admitted, or the round it joined); the agent exports it as a gauge
        self.on_spare: list[Callable[[bool], None]] = []
        # called at each look while this node waits as a spare (on an etcd change, at least once a
        # second): the agent starts its workers ahead once the world it would join trains in place
        self.while_spare: list[Callable[[], None]] = []
        self.spare_since: float | None = None  # monotonic; while this node waits as a spare
        self._spare_from: float | None = None  # when this rendezvous first found this node a spare
        self._joined_at = 0.0  # monotonic: when this node joined the round it is in the rendezvous for
        # why this node may open a round; set by our agent before next_rendezvous. Under torchrun's
        # agent (None): a newcomer joins, a member asking again had its workers fail
        self.next_cause: str | None = None
        # False when this node's workers go on in place: they never read MASTER_ADDR, and a
        # non-zero rank would otherwise wait for a dead rank 0 to publish it. Rank 0 always
        # publishes (one put): a joiner does not know yet whether its workers will need it.
        self.bootstrap = True
        # Asked for the round just closed when ``bootstrap`` is on: False if this node's workers
        # will not need MASTER_ADDR either (the agent's answer: they join a world that trains in
        # place). A non-zero rank's read of it waits for rank 0's put, which a rank 0 frozen as
        # the round closed never makes (issue 39: a joiner's agent stood still 60 s).
        self.bootstrap_needed: Callable[[RoundRecord], bool] | None = None
        self._probe = DeathProbe(on_death=lambda: self.mirror.notify())
        self._vouch = PeerAsker(signer, timeout=_VOUCH_TIMEOUT_S)  # late members' witnesses, after a failure
        self.advertise_host = local_addr  # where peers reach this node's witness (the agent may set it)
        # The number a job's first round takes. Rounds are the snapshot directory's fence tokens,
        # so after etcd loses its state they must go on above the fence, or every new group's
        # rank 0 would be refused as stale; the agent sets it from --snapshot-dir.
        self.first_round = 0
        self.lease_watch = LeaseWatch(node_name, self.lease, signer)
        self.reachability = Reachability(node_name, client, signer, self.lease, prefix)

    # --------------------------------------------------------------- torch's ABC

    def get_backend(self) -> str:
        return "etcd-v3"

    def get_run_id(self) -> str:
        return self.run_id

    @property
    def use_agent_store(self) -> bool:
        return False  # workers bootstrap their own TCPStore on rank 0; nothing to keep alive here

    def _cause(self) -> str:
        if self.next_cause is not None:
            return self.next_cause
        return FAILURE if self._joined_once else JOIN

    def next_rendezvous(self) -> RendezvousInfo:
        self._start()
        with self._lock:
            self.round = None
        self.lease.update(state="rendezvous", round=None, rank=None, world=None)
        started = time.monotonic()
        self._spare_from = None
        try:
            record = self._join_until_closed(started + self.options.timings["join_timeout"])
        finally:
            self._mark_spare(False, write=False)  # "running" (or leaving) is written next
        if self.lease_watch.past_deadline():
            self.lease.refresh(timeout=self.lease.ttl / 4)  # judged by its clock, a stale lease would stop us again
        rank, world = record.participants.index(self.node), len(record.participants)
        with self._lock:
            self.round, self._lease_generation = record, self.lease.generation
            self._joined_once = True
        self.lease.update(state="running", round=record.round, rank=rank, world=world)
        # A spare's wait began long before the round (it waited beside a full world): its
        # "closed in" counts from its join of this round, or it reads as a slow close.
        since = self._joined_at if self._spare_from is not None and self._joined_at > started else started
        log.info("[%s] round %d closed in %.2f s: rank %d of %d (%s)", self.node, record.round,
                 time.monotonic() - since, rank, world, ", ".join(record.participants))
        if self._spare_from is not None:
            replaced = [n for n in record.previous if n not in record.participants]
            log.info("[%s] a spare for %.1f s: admitted to round %d in the place of %s, world size unchanged",
                     self.node, time.monotonic() - self._spare_from, record.round,
                     ", ".join(replaced) or "a lost member")
        store = dist.PrefixStore(f"round/{record.round}", self._store)
        needed = self.bootstrap and (self.bootstrap_needed is None or self.bootstrap_needed(record))
        bootstrap = RendezvousStoreInfo.build(rank, store, self.local_addr) if needed or rank == 0 else None
        for callback in list(self.on_round):
            callback(record)
        return RendezvousInfo(store, rank, world, bootstrap)

    def is_closed(self) -> bool:
        entries, _ = self.mirror.entries() if self._started else ({}, 0)
        if self._closed_in(entries):
            return True
        try:
            value = self.client.call(lambda c: c.get(self._closed_key), deadline=2.0)[0]
        except EtcdError:
            return False
        return value is not None and self._signed(self._closed_key, value)

    def set_closed(self, outcome: str = "", cause: str = "") -> None:
        """Mark the job over; ``outcome`` (``succeeded``/``failed``) and ``cause`` travel with it."""
        ended = {"by": self.node, **({"outcome": outcome} if outcome else {}), **({"cause": cause} if cause else {})}
        value = self.signer.seal(self._closed_key.encode(), json.dumps(ended).encode())
        self.client.call(lambda c: c.put(self._closed_key, value))

    def closed_outcome(self) -> JobEnded | None:
        """How the job ended, as the node that closed its rendezvous said (None: not closed,
        or a value that fails verification, which is never acted on)."""
        entry = self.mirror.entries()[0].get(self._closed_key) if self._started else None
        value = entry.value if entry is not None else None
        if value is None:
            try:
                value = self.client.call(lambda c: c.get(self._closed_key), deadline=2.0)[0]
            except EtcdError:
                return None
        if value is None:
            return None
        try:
            data = json.loads(self.signer.open(self._closed_key.encode(), value))
        except (SignatureError, ValueError):
            return None
        return JobEnded.from_dict(data) if isinstance(data, dict) else None

    def num_nodes_waiting(self) -> int:
        reason = self.restart_reason()
        return 1 if reason else 0

    def shutdown(self, outcome: str = "", cause: str = "") -> bool:
        """Close the job's rendezvous (torch's contract) and leave at once rather than at TTL.
        ``outcome`` and ``cause`` (our agent gives them; torch's gives neither) tell the
        other agents how the job ended (:meth:`closed_outcome`).

        A node that never got into a round (a wrong job key, bad config) only leaves: its
        failure says nothing about the job, so it must not end it for everyone else.
        """
        if not self._joined_once:
            self.close()
            return True
        try:
            self.set_closed(outcome, cause)
        except EtcdError as exc:
            log.warning("could not mark the rendezvous closed: %s", exc)
            return False
        finally:
            self.close()
        return True

    # --------------------------------------------------------------- beyond the ABC

    def restart_reason(self) -> str | None:
        """Why this node's workers should stop now (None: they should not).

        Answered from the watch-fed mirror, so it costs no etcd request and cannot hang.
        While the watch is broken (etcd unreachable) the answer is "no reason": a silent
        etcd says nothing about our peers, who keep training.
        """
        with self._lock:
            current, generation = self.round, self._lease_generation
        if current is None:
            return None
        if self.lease.generation != generation or self.lease.suspect_lost():
            return LEASE_LOST
        if self.lease_watch.verdict([n for n in current.participants if n != self.node]) is Verdict.CUT_OFF:
            return LEASE_LOST
        if not self.mirror.healthy:
            return None
        entries, _ = self.mirror.entries()
        if self._closed_in(entries):
            return None
        record = self._decode_round(entries)
        if record is not None and record.round > current.round:
            return NEW_ROUND
        live = self._live(entries)
        if any(node not in live for node in current.participants):
            return PEER_LOST
        return None

    def report_unreachable(self) -> list[str]:
        """After the current round failed with every lease held: probe its other members and
        record in etcd those this node cannot reach, so the next round can leave them out."""
        with self._lock:
            current = self.round
        if current is None or len(current.participants) < 2:
            return []
        return self.reachability.report(current.round, current.participants, self.node_records())

    def close(self) -> None:
        """Leave: revoke the lease (peers notice now, not at TTL) and stop watching."""
        self.lease_watch.close()
        self.lease.close()
        self.mirror.close()

    def _round_peers(self) -> dict[str, str | None] | None:
        """The current round's other members and their witnesses, from the mirror (no etcd request)."""
        with self._lock:
            current = self.round
        if current is None:
            return None
        records = self._records(self.mirror.entries()[0])
        return {n: (records[n].witness_addr if n in records else None)
                for n in current.participants if n != self.node}

    # --------------------------------------------------------------- the protocol

    def _start(self) -> None:
        if self._started:
            return
        self.lease.update(witness_addr=self.lease_watch.start(self.advertise_host, self._round_peers))
        try:
            self.lease.start()
        except NodeNameInUseError as exc:
            raise RendezvousStateError(str(exc)) from None
        self.mirror.start(deadline=self.options.connect_timeout)
        self._started = True

    def _join_until_closed(self, deadline: float) -> RoundRecord:
        joined_round: int | None = None
        join_revision = 0
        first_seen: dict[int, float] = {}  # round -> when the close clock started, locally
        while True:
            if time.monotonic() > deadline:
                raise RendezvousTimeoutError(
                    f"rendezvous for run {self.run_id!r} did not complete within "
                    f"{self.options.timings['join_timeout']} s (min {self.timings.min_nodes} nodes); "
                    "start more agents or raise --rdzv-conf join_timeout"
                )
            entries, revision = self.mirror.entries()
            if self._closed_in(entries):
                raise RendezvousClosedError(f"run {self.run_id!r} has ended (its rendezvous was closed); "
                                             "a new job needs a new --rdzv-id")
            if not self.mirror.healthy:
                self.mirror.wait(revision, _TICK_S * 5)
                continue
            record = self._decode_round(entries)
            round_rev = entries[self._round_key].mod_revision if self._round_key in entries else 0
            if record is not None and self.reachability.must_stay_out(record, entries):
                self.reachability.stay_out(record, entries, self.node_records,
                                           lambda: self._closed_in(self.mirror.entries()[0]))
                joined_round = None
                continue
            if self._spare_now(record, entries, joined_round):
                self._mark_spare(True, record)
                deadline = max(deadline, time.monotonic() + self.options.timings["join_timeout"])  # not a stuck join
            elif self.spare_since is not None and record is not None and record.state == OPEN \
                    and joined_round == record.round:
                self._mark_spare(False)  # joined the round a loss opened; its close says whether we are in
            if record is None and self._round_key in entries:
                self._await_good_round(revision)  # forged, and this node remembers no good one
                continue
            if record is None:
                if self.first_round:
                    log.info("[%s] no round record in etcd: this job's rounds start at %d, above its snapshot "
                             "directory's fence (a new etcd, or one that lost its data)", self.node, self.first_round)
                self._swap_round(0, RoundRecord(self.first_round, OPEN))
            elif record.state == CLOSED:
                if joined_round == record.round and self.node in record.participants:
                    return record
                if joined_round == record.round + 1:
                    self.mirror.wait(revision, _TICK_S)  # we opened the next one; the mirror lags behind
                elif self.node in record.participants or len(record.participants) < self.timings.max_nodes:
                    opened = self._open_and_join(round_rev, record.next_open(self._cause()), joined_round)
                    if opened is not None:  # our join is in the same transaction: the round cannot close without us
                        joined_round, join_revision = record.round + 1, opened
                        self._joined_at = time.monotonic()
                elif lost_members(record, self._live(entries)):  # a full world lost a member: a spare steps in
                    opened = self._open_and_join(round_rev, record.next_open(FAILURE), joined_round)
                    if opened is not None:
                        joined_round, join_revision = record.round + 1, opened
                        self._joined_at = time.monotonic()
                else:
                    for callback in list(self.while_spare):
                        try:
                            callback()
                        except Exception:  # noqa: BLE001 - a spare's extra must never break its rendezvous
                            log.exception("[%s] while waiting as a spare", self.node)
                    self.mirror.wait(revision, 1.0)  # a full world: wait as a spare for the next round
            elif joined_round != record.round:
                join_revision = self._join(record.round, joined_round)
                joined_round = record.round
                self._joined_at = time.monotonic()
            else:
                excluded = self.reachability.excluded(record, entries)
                joined = {n: rev for n, rev in self._joined(entries, record.round).items() if n not in excluded}
                live = self._live(entries)
                if self.node not in joined and revision >= join_revision:
                    # our join key went with a lost lease (a freeze, a starved keep-alive)
                    log.warning("[%s] our join of round %d vanished with our lease; joining again",
                                self.node, record.round)
                    join_revision = self._join(record.round, None)
                    continue
                if len(joined) >= self.timings.min_nodes or record.previous:
                    first_seen.setdefault(record.round, time.monotonic())
                waited = time.monotonic() - first_seen.get(record.round, time.monotonic())
                dead = self._proven_dead(record, joined, entries) | excluded  # neither is waited for
                vouched = self._vouched(record, joined, entries, live, dead, first_seen.get(record.round))
                if self.node in joined and should_close(record, joined, live, self.timings, waited, dead, vouched):
                    participants = rank_order(joined, record.previous, self.timings.max_nodes)
                    if self._swap_round(round_rev, record.closed_with(participants)):
                        self._forget_round(record.round - 2)
                    continue
                self.mirror.wait(revision, _TICK_S)
                continue
            self.mirror.wait(revision, _TICK_S)

    def _spare_now(self, record: RoundRecord | None, entries: dict,  # type: ignore[type-arg]
                   joined_round: int | None) -> bool:
        """Whether this node waits as a spare now (a round it opened itself may not show yet)."""
        if record is None or record.state != CLOSED or self.node in record.participants \
                or len(record.participants) < self.timings.max_nodes or joined_round == record.round + 1:
            return False  # the cheap checks first: the registry is read only beside a full world
        return waits_as_spare(record, self.node, self.timings.max_nodes, self._live(entries))

    def _mark_spare(self, spare: bool, record: RoundRecord | None = None, write: bool = True) -> None:
        """Say (registry state ``spare``, log, ``on_spare``) that this node waits as a spare, or
        no longer does; only on a change."""
        if spare == (self.spare_since is not None):
            return
        self.spare_since = time.monotonic() if spare else None
        if spare and self._spare_from is None:
            self._spare_from = self.spare_since
        if spare and record is not None:
            log.info("[%s] round %d is full (%s; --nnodes max %d): waiting as a spare, to take the place of "
                     "the next member lost", self.node, record.round, ", ".join(record.participants),
                     self.timings.max_nodes)
        if write:
            self.lease.update(state="spare" if spare else "rendezvous")
        for callback in list(self.on_spare):
            callback(spare)

    def _await_good_round(self, revision: int) -> None:
        """Wait for a member to put a good round record back over one that does not verify;
        past two lease TTLs nobody alive remembers one (or our key is not the job's): stop."""
        forged_for = self._round_good.forged_for(self._round_key, time.monotonic()) or 0.0
        patience = 2.0 * self.lease.ttl
        if forged_for > patience:
            raise RendezvousStateError(
                f"the round record {self._round_key} of run {self.run_id!r} does not verify with this agent's "
                f"job key, and no running member put a good one back within {patience:.0f} s: give every agent "
                f"the same HMAC key (hmac_key_file=); if the keys agree, somebody else wrote it: delete it "
                f"(etcdctl del {self._round_key}) and start the agents again"
            )
        self.mirror.wait(revision, _TICK_S * 5)

    def _vouched(self, record: RoundRecord, joined: dict[str, int], entries: dict,  # type: ignore[type-arg]
                 live: dict[str, str], dead: set[str], since: float | None) -> set[str]:
        """Previous members still running, not joined, whose witness answered since the round
        opened and who still reach etcd: alive, only late (asked in the background, so an
        answer is in before the rejoin timeout runs out; a frozen or partitioned agent never
        answers)."""
        if record.cause == JOIN or since is None:
            return set()
        missing = missing_members(record, joined, live, dead)
        if not missing:
            return set()
        words = self._vouch.words()
        vouched = {n for n in missing
                   if n in words and words[n].asked_at >= since and still_reaches_etcd(words[n], self.lease.ttl)}
        records = self._records(entries)
        self._vouch.ask_all({n: records[n].witness_addr if n in records else None
                             for n in missing if n not in vouched})
        return vouched

    def _proven_dead(self, record: RoundRecord, joined: dict[str, int], entries: dict) -> set[str]:  # type: ignore[type-arg]
        """Previous members that have not joined and whose agent's port refuses connects."""
        records = self._records(entries)
        missing = {n: records[n].store_addr for n in record.previous if n in records and n not in joined}
        return self._probe.dead(missing) if missing else set()

    def _swap_round(self, expected_mod_revision: int, record: RoundRecord) -> bool:
        """Replace the round record if nobody else did since we read it."""
        key = self._round_key
        value = self.signer.seal(key.encode(), record.to_json())
        guard = tx.Version(key) == 0 if expected_mod_revision == 0 else tx.Mod(key) == expected_mod_revision
        return transact(self.client, [guard], [tx.Put(key, value)]).succeeded

    def _open_and_join(self, expected_mod_revision: int, record: RoundRecord, previous_round: int | None) -> int | None:
        """Open ``record`` and put our join key in one transaction; the revision, or None if
        someone else changed the round record first."""
        key = self._round_key
        value = self.signer.seal(key.encode(), record.to_json())
        join_key = f"{self._join_prefix}{record.round}/{self.node}"
        join_value = self.signer.seal(join_key.encode(), json.dumps({"node": self.node, "t": time.time()}).encode())
        stale = f"{self._join_prefix}{previous_round}/{self.node}" if previous_round is not None else None
        stale = None if stale == join_key else stale

        def put(lease_id: int) -> int | None:
            ops = [tx.Put(key, value), tx.Put(join_key, join_value, lease=lease_id)]
            if stale:
                ops.append(tx.Delete(stale))
            result = transact(self.client, [tx.Mod(key) == expected_mod_revision], ops)
            return result.revision if result.succeeded else None

        return self.lease.write(put)

    def _join(self, round_number: int, previous_round: int | None) -> int:
        """Put our join key (dropping the previous round's); returns the revision of the put."""
        key = f"{self._join_prefix}{round_number}/{self.node}"
        value = self.signer.seal(key.encode(), json.dumps({"node": self.node, "t": time.time()}).encode())
        stale = f"{self._join_prefix}{previous_round}/{self.node}" if previous_round is not None else None

        def put(lease_id: int) -> int:
            ops = [tx.Put(key, value, lease=lease_id)]
            if stale:
                ops.append(tx.Delete(stale))
            return transact(self.client, [], ops).revision

        return self.lease.write(put)

    def _forget_round(self, round_number: int) -> None:
        """Old rounds' store keys: nobody reads them two rounds later."""
        if round_number < 0:
            return
        try:
            self.client.call(lambda c: c.delete_prefix(f"{self._store_prefix}/round/{round_number}/"), deadline=1.0)
            self.client.call(lambda c: c.delete_prefix(f"{self._join_prefix}{round_number}/"), deadline=1.0)
        except EtcdError:
            pass

    # --------------------------------------------------------------- reading the mirror

    def _signed(self, key: str, value: bytes) -> bool:
        try:
            self.signer.open(key.encode(), value)
            return True
        except SignatureError:
            if key not in self._warned:
                self._warned.add(key)
                log.warning("ignoring forged %s (written with another job key?)", key)
            return False

    def _closed_in(self, entries: dict) -> bool:  # type: ignore[type-arg]
        entry = entries.get(self._closed_key)
        return entry is not None and self._signed(self._closed_key, entry.value)

    def _decode_round(self, entries: dict) -> RoundRecord | None:  # type: ignore[type-arg]
        """The round record to act on: the one in etcd if it verifies, else the last good one
        this node saw (None if it saw none: see :meth:`_await_good_round`)."""
        entry = entries.get(self._round_key)
        if entry is None:
            return None
        record: RoundRecord | None = None
        try:
            record = RoundRecord.from_json(self.signer.open(self._round_key.encode(), entry.value))
        except (SignatureError, ValueError, KeyError, TypeError) as exc:
            self._answer_forgery(self._round_key, entry.mod_revision, str(exc) or type(exc).__name__,
                                 self._put_round_back)
        last = self._round_good.last(self._round_key)
        if record is not None and last is not None and round_stale(
                round_order(last.round, last.state == CLOSED), round_order(record.round, record.state == CLOSED)):
            self._answer_forgery(self._round_key, entry.mod_revision,
                                 f"it is signed but stale: round {record.round} ({record.state}) after round "
                                 f"{last.round} ({last.state}), an older record put back", self._put_round_back)
            record = None
        return self._round_good.resolve(self._round_key, record, time.monotonic())

    def _put_round_back(self, forged_revision: int) -> None:
        """Replace a round record that does not verify with the last good one, unless somebody
        (a member racing us, the protocol moving on) replaced it first."""
        good = self._round_good.last(self._round_key)
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

    def _joined(self, entries: dict, round_number: int) -> dict[str, int]:  # type: ignore[type-arg]
        """The nodes joined to ``round_number``: join keys that verify and are held by a lease
        (a join is put under its node's lease: one put back without a lease is a replay)."""
        prefix = f"{self._join_prefix}{round_number}/"
        ours = [(key, entry.value) for key, entry in entries.items()
                if key.startswith(prefix) and self._current(key, entry)]
        return {key[len(prefix):]: entries[key].create_revision for key, _ in self._joins_memo.decode(ours)}

    def _records(self, entries: dict) -> dict[str, NodeRecord]:  # type: ignore[type-arg]
        """Every registered node's record. A key whose value does not verify keeps its last
        good record for a lease TTL (its agent, if alive, rewrites it at once): a forgery is
        never read as a node's death, nor as a new node."""
        ours = [(key, entry.value) for key, entry in entries.items() if key.startswith(self._nodes_prefix)]
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
        self._nodes_good.keep_only([key for key, _ in ours])
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

    def _live(self, entries: dict) -> dict[str, str]:  # type: ignore[type-arg]
        return {node: record.state for node, record in self._records(entries).items()}

    def newest_round(self) -> int | None:
        """The round number etcd's round record holds now (read from etcd, before any mirror),
        or None if there is none or it does not verify."""
        raw, _ = self.client.call(lambda c: c.get(self._round_key))
        if raw is None:
            return None
        try:
            return RoundRecord.from_json(self.signer.open(self._round_key.encode(), raw)).round
        except (SignatureError, ValueError, KeyError, TypeError):
            return None

    def node_records(self) -> dict[str, NodeRecord]:
        """Every live node's registry record, from the mirror (no etcd request)."""
        entries, _ = self.mirror.entries()
        return self._records(entries)


def create_handler(params: RendezvousParameters) -> EtcdV3RendezvousHandler:
    """Build the handler, checking etcd is reachable and lets us in before returning.

    Raises :class:`EtcdConfigError`, :class:`HmacKeyError` or :class:`EtcdError` with
    one line a user can act on.
    """
    options, signer, client = connect(params)
    return EtcdV3RendezvousHandler(
        params.run_id, options, client, signer, params.min_nodes, params.max_nodes, params.local_addr,
        options.node_name or default_node_name(),
    )
