"""The ``etcd-v3`` rendezvous: watch-driven and lease-aware, on torch's ``RendezvousHandler``.

torch's ``DynamicRendezvousHandler`` polls its backend once a second and can only learn
that a node is dead by missing its heartbeats; a node loss costs seconds in rendezvous
alone. This handler keeps per-node keys under short etcd leases and a round record
updated by transaction (JSON, HMAC-sealed), and learns of what concerns it through watches:

* ``{run}/nodes/{node}``: the node registry (:mod:`.registry`), one key per live agent.
* ``{run}/rdzv/round``: the current round: number, ``open``/``closed``, participants.
* ``{run}/rdzv/join/{round}/{node}``: "this node wants to be in that round", under the
  node's lease, so a node that dies while joining leaves no ghost.
* ``{run}/rdzv/closed``: the job is over (:meth:`set_closed`), and how it ended: a
  ``succeeded`` or ``failed`` outcome and its cause, so every agent exits as the job did.
* ``{run}/rdzv/steward/{i}``: the few nodes that hear every peer (:mod:`.steward`): they
  close rounds and open the next one after a member's loss, naming it in the record.

A node hears only the round record, the job's end, its own registry key, the steward
slots, and keep-outs and reachability reports (written only after a failure): O(1) events
per round however many peers it has (:mod:`agent.etcd.ranges`). The run's whole prefix
(``mirror``) is read only where something needs every peer's keys: a steward, and the
agent's own features (:mod:`agent.etcd.mirror`'s ``LazyPrefixMirror``).

A later round closes the moment every surviving member has joined; only a member that
looks alive but has not moved (its lease outlives a SIGKILL by up to the TTL) costs a
short ``rejoin_timeout``. ``num_nodes_waiting`` answers from memory, so torch's monitor
loop sees a new round, a lost peer or a lost own lease within one monitor interval, and
an etcd outage cannot stall or kill a healthy job.

The handler keeps torch's ABC and the round loop; its parts, one idea each, are its own:
:class:`.mirror_view.MirrorView` (what the mirror says, verified), :class:`.round_writes.RoundWriter`
(the round record and join keys), :class:`.job_end.JobEnd` (the closed key),
:class:`.late_members.LateMembers` (dead or only late) and :class:`.spare_wait.SpareWait`.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Callable

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousTimeoutError,
)

from agent.etcd import EtcdClient, EtcdError
from agent.etcd.mirror import Entry, LazyPrefixMirror
from agent.etcd.ranges import RangesMirror

from agent.rendezvous.bootstrap import bootstrap_info
from agent.rendezvous.ended import JobEnded
from agent.rendezvous.job_end import JobEnd
from agent.rendezvous.late_members import LateMembers
from agent.rendezvous.lease_clock import Verdict
from agent.rendezvous.lease_watch import LeaseWatch
from agent.rendezvous.mirror_view import MirrorView, RoundKeys
from agent.rendezvous.options import RendezvousOptions, connect
from agent.rendezvous.reachability import Reachability
from agent.rendezvous.registry import NodeLease, NodeNameInUseError, NodeRecord, default_node_name
from agent.rendezvous.round_writes import RoundWriter
from agent.rendezvous.rounds import CLOSED, FAILURE, JOIN, OPEN, RoundRecord, Timings
from agent.rendezvous.signing import StateSigner
from agent.rendezvous.spare_wait import SpareWait
from agent.rendezvous.states import NodeState
from agent.rendezvous.steward import Steward, slot_prefix
from agent.rendezvous.store import EtcdV3Store
from agent.rendezvous.vouchers import vouchers

log = logging.getLogger(__name__)

_TICK_S = 0.1  # re-check time-based close rules at least this often

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
        self.keys = keys = RoundKeys.of(options.key_prefix, run_id)
        self._round_key = keys.round
        self._store = EtcdV3Store(client, keys.store_prefix, signer, ttl=options.state_ttl)
        self.lease = NodeLease(
            client, options.key_prefix, run_id,
            NodeRecord(node=node_name, host=socket.gethostname(), pid=os.getpid(), addr=local_addr),
            signer, options.lease_ttl,
        )
        # every key of the run, read only where something needs every peer's (a steward, the
        # agent's own features); the round protocol itself reads ``narrow``
        self.mirror = LazyPrefixMirror(client, keys.prefix + "/", deadline=options.connect_timeout)
        # the collaborators, one idea each: writes, verified reads, the job's end, late members
        self.writer = RoundWriter(node_name, client, signer, keys, self.lease)
        self.view = MirrorView(node_name, signer, keys, self.lease, float(options.lease_ttl), self.writer.swap)
        self.job_end = JobEnd(node_name, client, signer, keys.closed,
                              lambda: self.narrow.entries()[0] if self._started else {}, self.view.signed)
        # the stewards' reading of the whole run: a view of its own, since the full mirror and the
        # narrow one stand at different revisions (one view fed both took a lagging copy of the
        # round record for an older one put back, and put the newer one "back" over it)
        self.steward_view = MirrorView(node_name, signer, keys, self.lease, float(options.lease_ttl), self.writer.swap)
        self.late = LateMembers(signer, self.lease, self.steward_view.records, lambda: self.mirror.notify())
        self._lock = threading.Lock()
        self.round: RoundRecord | None = None  # the round our current workers belong to
        self._lease_generation = 0
        self._started = False
        self._joined_once = False
        self.on_round: list[Callable[[RoundRecord], None]] = []
        self.spares = SpareWait(node_name, self.lease, max_nodes, self._members_alive)
        self.on_spare, self.while_spare = self.spares.on_spare, self.spares.while_spare  # the same lists
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
        self.advertise_host = local_addr  # where peers reach this node's witness (the agent may set it)
        # The number a job's first round takes. Rounds are the snapshot directory's fence tokens,
        # so after etcd loses its state they must go on above the fence, or every new group's
        # rank 0 would be refused as stale; the agent sets it from --snapshot-dir.
        self.first_round = 0
        self.lease_watch = LeaseWatch(node_name, self.lease, signer)
        self.reachability = Reachability(node_name, client, signer, self.lease, keys.prefix)
        # What this node hears: the round record, the job's end, its own registry key, who
        # stewards, and keep-outs and reachability reports (written only after a failure):
        # O(1) events per round however many peers it has (:mod:`.steward`).
        self.narrow = RangesMirror(client, [keys.round, keys.closed, self.lease.key],
                                   [slot_prefix(keys), self.reachability.reach_prefix,
                                    self.reachability.keepout_prefix])
        self.steward = Steward(node_name, client, signer, keys, self.lease, self.narrow, self.mirror, self.steward_view,
                               self.writer, self.late, self.reachability, self.timings, options.stewards)
        self._join_lease: int | None = None  # the lease our join key of the round we joined lives under
        self._peers: list[str] = []  # the current round's members this node asks while failing

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

    # --------------------------------------------------------------- what our agent says

    def serve_as(self, advertise_host: str | None,
                 bootstrap_needed: Callable[[RoundRecord], bool] | None = None) -> None:
        """Our agent's settings, before its first round: where peers reach this node's witness,
        and (in place) whether its workers will read MASTER_ADDR in a round just closed."""
        self.advertise_host = advertise_host
        if bootstrap_needed is not None:
            self.bootstrap_needed = bootstrap_needed

    def start_rounds_at(self, first: int) -> None:
        """The number this job's first round takes (above a snapshot fence, after etcd lost its state)."""
        self.first_round = first

    def next_rendezvous_for(self, cause: str, bootstrap: bool = True) -> RendezvousInfo:
        """:meth:`next_rendezvous` for our agent, which says why this node opens a round and whether
        its workers need torchrun's bootstrap (MASTER_ADDR) in it: in-place workers do not."""
        self.next_cause, self.bootstrap = cause, bootstrap
        try:
            return self.next_rendezvous()
        finally:
            self.bootstrap = True

    def next_rendezvous(self) -> RendezvousInfo:
        self.start()
        with self._lock:
            self.round = None
        self.lease.update(state=NodeState.RENDEZVOUS.value, round=None, rank=None, world=None)
        started = time.monotonic()
        self.spares.begin()
        try:
            record = self._join_until_closed(started + self.options.timings["join_timeout"])
        finally:
            self.spares.mark(False, write=False)  # "running" (or leaving) is written next
        if self.lease_watch.past_deadline():
            self.lease.refresh(timeout=self.lease.ttl / 4)  # judged by its clock, a stale lease would stop us again
        rank, world = record.participants.index(self.node), len(record.participants)
        with self._lock:
            self.round, self._lease_generation = record, self.lease.generation
            # the members whose word on etcd this node weighs (and asks) while its keep-alives
            # fail: the stewards and a few spread around the round, not all N-1 (:mod:`.vouchers`)
            self._peers = vouchers(record.participants, self.node, self.steward.holders())
            self._joined_once = True
        self.lease.update(state=NodeState.RUNNING.value, round=record.round, rank=rank, world=world)
        # A spare's wait began long before the round (it waited beside a full world): its
        # "closed in" counts from its join of this round, or it reads as a slow close.
        since = self._joined_at if self.spares.first is not None and self._joined_at > started else started
        log.info("[%s] round %d closed in %.2f s: rank %d of %d (%s)", self.node, record.round,
                 time.monotonic() - since, rank, world, ", ".join(record.participants))
        if self.spares.first is not None:
            replaced = [n for n in record.previous if n not in record.participants]
            log.info("[%s] a spare for %.1f s: admitted to round %d in the place of %s, world size unchanged",
                     self.node, time.monotonic() - self.spares.first, record.round,
                     ", ".join(replaced) or "a lost member")
        store = dist.PrefixStore(f"round/{record.round}", self._store)
        # In-place workers that go on need no bootstrap, unless none ran in place at the close:
        # then every member starts its workers afresh, this one's too (agent.node.acts.rejoin).
        needed = (self.bootstrap or not record.in_place) and \
            (self.bootstrap_needed is None or self.bootstrap_needed(record))
        # a read or a few before any watch: N-1 watches on one key at once timed out at 1,024 nodes
        prefix = f"round/{record.round}/"
        bootstrap = bootstrap_info(rank, store, lambda keys: self._store.peek([prefix + k for k in keys]),
                                   self.local_addr) if needed or rank == 0 else None
        for callback in list(self.on_round):
            callback(record)
        return RendezvousInfo(store, rank, world, bootstrap)

    def is_closed(self) -> bool:
        return self.job_end.is_closed()

    def set_closed(self, outcome: str = "", cause: str = "") -> None:
        """Mark the job over; ``outcome`` (``succeeded``/``failed``) and ``cause`` travel with it."""
        self.job_end.set_closed(outcome, cause)

    def closed_outcome(self) -> JobEnded | None:
        """How the job ended (None: not closed, or a value that fails verification)."""
        return self.job_end.outcome()

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

        Answered from the watch-fed narrow mirror (the round record, not every peer's key),
        so it costs no etcd request, cannot hang, and does no work per peer. A peer's lost
        lease reaches it as the next round, which a steward opened naming the lost
        (:mod:`.steward`). While the watch is broken (etcd unreachable) the answer is "no
        reason": a silent etcd says nothing about our peers, who keep training.
        """
        with self._lock:
            current, generation, peers = self.round, self._lease_generation, self._peers
        if current is None:
            return None
        if self.lease.generation != generation or self.lease.suspect_lost():
            return LEASE_LOST
        if self.lease_watch.verdict(peers) is Verdict.CUT_OFF:
            return LEASE_LOST
        if not self.narrow.healthy:
            return None
        entries, _ = self.narrow.entries()
        if self.view.closed_in(entries):
            return None
        record = self._decode_round(entries)
        if record is not None and record.round > current.round:
            return PEER_LOST if record.lost and not set(record.lost).isdisjoint(current.participants) else NEW_ROUND
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
        self.steward.close()
        self.lease_watch.close()
        self.lease.close()
        self.narrow.close()
        self.mirror.close()

    @property
    def spare_since(self) -> float | None:
        """Monotonic: since when this node waits as a spare (None: it does not)."""
        return self.spares.since

    def _round_peers(self) -> dict[str, str | None] | None:
        """The round's members this node asks while its keep-alives fail (:mod:`.vouchers`) and
        their witnesses, from the round record (no etcd request: this is asked while etcd may not
        answer); a record without them (written by an older closer) from the registry's mirror."""
        with self._lock:
            current, peers = self.round, self._peers
        if current is None:
            return None
        if current.witnesses:
            witness = current.witness_of()
            return {n: witness.get(n) for n in peers}
        records = self.view.records(self.mirror.entries()[0])
        return {n: (records[n].witness_addr if n in records else None) for n in peers}

    def _members_alive(self, entries: dict) -> dict[str, str]:
        """The round record's members, taken as alive: a member's loss reaches this node as the
        next round, which a steward opens (so a spare waits for the round record alone)."""
        record = self._decode_round(entries)
        return {n: NodeState.RUNNING.value for n in record.participants} if record is not None else {}

    # --------------------------------------------------------------- the protocol

    def start(self) -> None:
        """Hold this node's name and lease, and follow etcd, before any round (idempotent):
        the first round does it, and the agent before it where a keep-out key needs the lease."""
        if self._started:
            return
        self.lease.update(witness_addr=self.lease_watch.start(self.advertise_host, self._round_peers))
        try:
            self.lease.start()
        except NodeNameInUseError as exc:
            raise RendezvousStateError(str(exc)) from None
        self.narrow.start(deadline=self.options.connect_timeout)
        self.mirror.allow()  # every peer's keys, once asked, now that this node holds its name
        self.steward.start()
        self._started = True

    _start = start  # the name bench/rendezvous_sim.py calls it by

    def _join_until_closed(self, deadline: float) -> RoundRecord:
        joined_round: int | None = None
        join_revision = 0
        while True:
            if time.monotonic() > deadline:
                raise RendezvousTimeoutError(
                    f"rendezvous for run {self.run_id!r} did not complete within "
                    f"{self.options.timings['join_timeout']} s (min {self.timings.min_nodes} nodes); "
                    "start more agents or raise --rdzv-conf join_timeout"
                )
            entries, revision = self.narrow.entries()
            if self.view.closed_in(entries):
                raise RendezvousClosedError(f"run {self.run_id!r} has ended (its rendezvous was closed); "
                                             "a new job needs a new --rdzv-id")
            if not self.narrow.healthy:
                self.narrow.wait(revision, _TICK_S * 5)
                continue
            record = self._decode_round(entries)
            round_rev = entries[self._round_key].mod_revision if self._round_key in entries else 0
            if record is not None and self.reachability.must_stay_out(record, entries):
                self.reachability.stay_out(record, entries, self.node_records,
                                           lambda: self.view.closed_in(self.narrow.entries()[0]))
                joined_round = None
                continue
            if self.spares.now(record, entries, joined_round):
                self.spares.mark(True, record)
                deadline = max(deadline, time.monotonic() + self.options.timings["join_timeout"])  # not a stuck join
            elif self.spares.since is not None and record is not None and record.state == OPEN \
                    and joined_round == record.round:
                self.spares.mark(False)  # joined the round a loss opened; its close says whether we are in
            if record is None and self._round_key in entries:
                self._await_good_round(revision)  # forged, and this node remembers no good one
                continue
            if record is None:
                if self.first_round:
                    log.info("[%s] no round record in etcd: this job's rounds start at %d, above its snapshot "
                             "directory's fence (a new etcd, or one that lost its data)", self.node, self.first_round)
                self.writer.swap(0, RoundRecord(self.first_round, OPEN))
            elif record.state == CLOSED:
                if joined_round == record.round and self.node in record.participants:
                    return record
                if joined_round == record.round + 1:
                    self.narrow.wait(revision, _TICK_S)  # we opened the next one; the mirror lags behind
                elif self.node in record.participants or len(record.participants) < self.timings.max_nodes:
                    opened = self.writer.open_and_join(round_rev, record.next_open(self._cause()), joined_round)
                    if opened is not None:  # our join is in the same transaction: the round cannot close without us
                        joined_round, join_revision = record.round + 1, opened
                        self._joined(time.monotonic())
                else:
                    # a full world: wait as a spare for the next round, which a steward opens
                    # when a member is lost (and a spare, too, takes a steward's free slot)
                    self.spares.tick()
                    self.narrow.wait(revision, 1.0)
            elif joined_round != record.round:
                join_revision = self.writer.join(record.round, joined_round)
                joined_round = record.round
                self._joined(time.monotonic())
            else:
                # Joined: a steward closes the round (:mod:`.steward`). Our join key lives under
                # our lease, like our registry key: that key gone or under another lease means
                # the join went with a lost lease (a freeze, a starved keep-alive).
                own = entries.get(self.lease.key)
                if revision >= join_revision and (own is None or own.lease != self._join_lease):
                    log.warning("[%s] our join of round %d vanished with our lease; joining again",
                                self.node, record.round)
                    join_revision = self.writer.join(record.round, None)
                    self._joined(None)
                    continue
                self.narrow.wait(revision, _TICK_S)
                continue
            self.narrow.wait(revision, _TICK_S)

    def _joined(self, at: float | None) -> None:
        """Our join of a round was just written (``at``: when, for the log; None: a rewrite)."""
        self._join_lease = self.lease._lease_id
        if at is not None:
            self._joined_at = at

    def _await_good_round(self, revision: int) -> None:
        """Wait for a member to put a good round record back over one that does not verify;
        past two lease TTLs nobody alive remembers one (or our key is not the job's): stop."""
        forged_for = self.view.round_good.forged_for(self._round_key, time.monotonic()) or 0.0
        patience = 2.0 * self.lease.ttl
        if forged_for > patience:
            raise RendezvousStateError(
                f"the round record {self._round_key} of run {self.run_id!r} does not verify with this agent's "
                f"job key, and no running member put a good one back within {patience:.0f} s: give every agent "
                f"the same HMAC key (hmac_key_file=); if the keys agree, somebody else wrote it: delete it "
                f"(etcdctl del {self._round_key}) and start the agents again"
            )
        self.narrow.wait(revision, _TICK_S * 5)

    # --------------------------------------------------------------- reading the mirror

    def _decode_round(self, entries: dict) -> RoundRecord | None:
        """The round record to act on (:meth:`.mirror_view.MirrorView.decode_round`)."""
        return self.view.decode_round(entries)

    def newest_round(self) -> int | None:
        """The round number etcd's round record holds now (read from etcd, before any mirror),
        or None if there is none or it does not verify."""
        return self.writer.newest_round()

    def node_records(self) -> dict[str, NodeRecord]:
        """Every live node's registry record, from the mirror (no etcd request)."""
        entries, _ = self.mirror.entries()
        return self.view.records(entries)

    def node_records_now(self, deadline: float = 2.0) -> dict[str, NodeRecord]:
        """Every live node's registry record as etcd holds it now (one request; the mirror's
        picture if etcd does not answer within ``deadline``). For a decision that must not
        rest on a mirror begun on demand, whose first read or watch may still be on its way."""
        try:
            reply = self.client.call(lambda c: c.get_prefix_response(self.keys.nodes_prefix), deadline=deadline)
        except EtcdError:
            return self.node_records()
        return self.view.records({kv.key.decode(): Entry(kv.value, kv.mod_revision, kv.create_revision, kv.lease)
                                  for kv in reply.kvs})


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
