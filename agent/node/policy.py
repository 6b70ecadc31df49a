"""What the node agent does next: a pure decision over what it has observed.

The agent's loop only observes (worker exits, the rendezvous' verdict on membership,
the hang watchdog, requests from workers that run in place) and then carries out the
:class:`Decision` this module returns. Keeping the rules here, free of processes, etcd
and clocks, lets every case be unit-tested in milliseconds, as ``rounds.py`` does for
the rendezvous.

Two kinds of worker group:

* **restart** (any script): a membership change or a failure stops every local worker
  and starts a new group after the next rendezvous round, as torchrun does.
* **in place** (``ElasticRun`` on a torch that can reconfigure a live process group):
  survivors keep their processes. The agent takes part in the new round and hands it to
  its workers; it starts again only the local workers that died or hung.

Restarts caused by this node (a worker failed or hung) spend one of ``--max-restarts``;
restarts caused by other machines (a peer lost, a node joining) or by this node's own
lease loss do not, so a long job does not run out of restarts because others died.

**A crash loop ends after three tries.** A node whose workers fail on their own (not
because a peer's connection broke) right after each of :data:`CRASH_LOOP_TRIES` starts or
heals in a row is not restarted again: it is kept out of the job's rounds for the
back-off unreachable nodes get (:mod:`agent.rendezvous.keepout`), so the other nodes
stop standing still for it and train on; it comes back afterwards as a newcomer, and is
kept out again, for twice as long, at its next such failure. The job fails for it only
when the others cannot go on without it (fewer than ``--nnodes MIN``).

**Every decision is made here.** The straggler watch (:mod:`agent.node.pace`: the straggler
every agent names, its ratio), the SDC watch (:mod:`agent.node.sdc`: when replica votes named this
node the outlier), the health watch (its verdict), the freeze watch (:mod:`agent.node.freeze`)
and the agent's own acts (a rejoin that got no round its in-place workers can take) only feed
facts into the :class:`Observation`; :func:`decide` weighs them against the workers and the
round (:func:`straggler_out`, :func:`sdc_keep_out`), and the agent's act step carries out what it
returns, nothing else. What a round says after a restart (:func:`after_round`, :func:`formed_afresh`)
and the crash streak's accounting (:func:`next_streak`, :func:`streak_acted_on`, :func:`settled`)
are decided here too, as pure functions.

**The same failure on every node is the script's.** Keep-out is for a node that fails
where the others do not. A node whose own workers fail right after their start says so,
with the error's last line, in its registry record (:func:`crash_report`); a node that
fails so while every other node of its round says the same words fails the job at once
(:data:`Reason.SCRIPT_ERROR`): no restart and no back-off fixes a ``NameError``.
"""

from __future__ import annotations

import enum
import signal
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from elastic import contract

from agent.node.stragglers import Straggler, eviction

USER_ERROR_EXIT = contract.USAGE_ERROR_EXIT  # a usage error (bad flags, a snapshot from another model): retrying cannot fix it
FINAL_SNAPSHOT_LOST_EXIT = contract.FINAL_SNAPSHOT_LOST_EXIT  # trained to the end, its final snapshot unwritable
CRASH_LOOP_TRIES = 3  # own failures in a row, each right after a start or heal, that make a crash loop
# the words of the job-wide verdict that the script itself is broken (elastic local prefers it
# to a peer's "no restarts left" given up at the same moment: it names the cause)
PEER_WORDS_GRACE_S = 2.0  # a crash loop or out of restarts: how long to wait for the round's other members to say they failed too
SCRIPT_ERROR_WORDS = "failed right after their start with the same error, the script's own"
CRASH_WINDOW_S = 60.0  # "right after": a worker that fails this soon after it started
SDC_STRIKES = 2  # times a node is named the outlier by a replica vote before it is suspect hardware
SDC_WINDOW_S = 86400.0  # ... within this many seconds (ELASTIC_SDC_WINDOW_S)

class Reason(str, enum.Enum):
    WORKER_FAILED = "worker_failed"
    HANG = "hang"
    PEER_LOST = "peer_lost"
    LEASE_LOST = "lease_lost"
    SCALE_UP = "scale_up"  # another node opened a new round (joined or came back)
    REFORM = "reform"  # an in-place worker's collective failed with nobody's lease lost
    CRASH_LOOP = "crash_loop"  # this node's workers fail right after every start
    STRAGGLER = "straggler"  # this node trains persistently slower than the others (agent.node.stragglers)
    FROZEN = "frozen"  # a peer's agent did not answer while a collective waited on it (agent.node.freeze)
    SCRIPT_ERROR = "script_error"  # every node's workers failed right after their start with the same error
    ETCD_LOST = "etcd_lost"  # the snapshot directory's fence stands above every round etcd holds now
    SDC = "sdc"  # replica votes named this node the outlier twice within a window (sdc_keep_out)
    HEALTH = "health"  # this node failed a health check (agent.node.health): a full disk, a skewed clock...
    JOB_ENDED = "job_ended"  # another node ended the job (its rendezvous is closed) while this node's workers run

    @property
    def counted(self) -> bool:
        """Whether a restart for this reason spends one of ``--max-restarts``."""
        return self in (Reason.WORKER_FAILED, Reason.HANG)

    @property
    def abrupt(self) -> bool:
        """The world is broken: there is nothing to flush, so workers get SIGKILL."""
        return self is not Reason.SCALE_UP


class Action(str, enum.Enum):
    CONTINUE = "continue"
    SUCCEED = "succeed"  # every local worker exited 0
    FAIL = "fail"  # give up: a usage error, or no restarts left
    RESTART = "restart"  # stop every local worker, rendezvous, start a new group
    REJOIN = "rejoin"  # in place: keep the workers, rendezvous, hand them the new round
    REPLACE = "replace"  # in place: start again only ``ranks``, then rendezvous as in REJOIN
    KEEP_OUT = "keep_out"  # stop every local worker, stay out of rounds for a back-off, then join again
    END = "end"  # the job ended elsewhere: stop every local worker and leave as the job did


@dataclass(frozen=True)
class Failure:
    """One failed local worker, as the agent saw it: its exit code, how long it ran, the
    last line of its traceback and its kind (torchrun's error file, which the worker writes:
    :mod:`elastic.failure_record`; None where it wrote none: killed, or an older build), and
    whether it made progress since it started (None: this node never saw any)."""

    code: int
    ran_for: float
    message: str = ""
    progressed: bool | None = None
    kind: contract.FailureKind | None = None
    cause: contract.FaultCause | None = None  # what ended it, by the error's type (named for people, never decides)

    @property
    def peer_caused(self) -> bool:
        """Its collective broke because a peer died or cut it off: not this node's doing. The
        worker said so by the error's kind; its words never decide (a script's own
        ``RuntimeError("timeout")`` is the script's)."""
        return self.kind is not None and self.kind.world_broke

    @property
    def abandoned(self) -> bool:
        """Its group was given up for a newer round (its fence refused it): nothing to report."""
        return self.kind is contract.FailureKind.ABANDONED

    @property
    def right_after_start(self) -> bool:
        return self.ran_for < CRASH_WINDOW_S or self.progressed is False


def next_streak(streak: int, failures: Iterable[Failure]) -> int:
    """This node's own failures in a row, each right after a start or heal, once these are
    counted. A failure a peer caused changes nothing; one after a good run ends the streak."""
    own = [f for f in failures if not f.peer_caused]
    if not own:
        return streak
    return streak + 1 if any(f.right_after_start for f in own) else 0


def crash_report(failures: Mapping[int, Failure]) -> str:
    """What this node tells the others of its failure ('' for none to tell): the last line of
    its own workers' error (a peer's doing or a failure after a good run tells nothing)."""
    own = {r: f for r, f in failures.items()
           if not f.peer_caused and f.right_after_start and f.message and not f.abandoned}
    return last_words(own)[:300] if own else ""


def etcd_lost(fence: Mapping[str, object] | None, run_id: str, current_round: int) -> str:
    """Why every group of this job would be refused, in one line with the fix, or ''.

    ``fence``: what rank 0 said of the fence that refused its group (the snapshot directory,
    the fence's run and round). A fence of this run above the round etcd holds now cannot
    be a newer group's (etcd would hold that round too): etcd lost the job's state, its
    rounds started again below the fence, and without ``--snapshot-dir`` the agents cannot
    start them above it. (A fence at or below the current round is a stale group's own
    doing: it rejoins, as before.)"""
    if not fence or fence.get("run") != run_id:
        return ""
    fence_round, directory = fence.get("round"), fence.get("snapshot_dir")
    if not isinstance(fence_round, int) or isinstance(fence_round, bool) or fence_round <= current_round:
        return ""
    return (f"etcd lost this job's state: its rounds start again at {current_round}, below the fence at round "
            f"{fence_round} in the snapshot directory {directory}, so every new group is refused as stale; start "
            f"the agents again with --snapshot-dir {directory} (their rounds then start above the fence, and the job "
            "resumes from its newest snapshot)")


def script_error(report: str, peers: Mapping[str, str] | None) -> str | None:
    """The error every node of the round failed with right after its start, if they all did
    with the same words: the script's bug, not a node's. None while any node differs, says
    nothing or cannot be heard (``peers`` None), and for a node alone (nothing to compare)."""
    if not report or not peers or any(words != report for words in peers.values()):
        return None
    return report


def peers_still_silent(peers: Mapping[str, str] | None) -> bool:
    """Some other member of the round has said no crash yet (None: they cannot be heard, so
    nothing is worth waiting for)."""
    return peers is not None and any(not words for words in peers.values())


def settled(streak: int, youngest_ran_for: float) -> int:
    """The streak once every local worker has run ``youngest_ran_for`` seconds: a group that
    outlived the window has shown this node can train, and ends it."""
    return 0 if youngest_ran_for >= CRASH_WINDOW_S else streak


def last_words(failures: Mapping[int, Failure]) -> str:
    """The cause to print: the last line of a failed worker's traceback, its own first."""
    ordered = sorted(failures.items(), key=lambda item: (item[1].peer_caused, item[0]))
    for _rank, failure in ordered:
        if failure.message:
            return failure.message
    return ", ".join(f"exit {f.code}" for _, f in ordered) or "unknown"


@dataclass(frozen=True)
class Observation:
    """One look at the node, taken by the agent's loop.

    ``exits`` maps every local rank to its exit code, or None while it runs.
    ``membership`` is the rendezvous' reason to act (peer lost, own lease lost, a new
    round), or None. ``stalled_for`` is the hang watchdog's verdict. ``in_place`` is true
    when every local worker said it runs in place; ``reform_requested`` when one of them
    asked for a new round because a collective failed.
    """

    exits: Mapping[int, int | None]
    membership: Reason | None = None
    stalled_for: float | None = None
    in_place: bool = False
    reform_requested: bool = False
    restarts_left: int = 0
    failures: Mapping[int, Failure] = field(default_factory=dict)  # the failed ranks of ``exits``, in detail
    crash_streak: int = 0  # :func:`next_streak`, this look's failures included
    nodes_without_us: int | None = None  # the round's other nodes (None: this node cannot be kept out)
    min_nodes: int = 1
    peer_crashes: Mapping[str, str] | None = None  # the round's other nodes -> their crash_report ('' for none)
    etcd_lost: str = ""  # :func:`etcd_lost`'s line: every group of this job would be refused
    health: str = ""  # agent.node.health.verdict: the failed checks with their fixes ('' for a healthy node)
    # The watches' facts, which the decision weighs (each None, '' or () while it has nothing to say):
    pace: PaceFacts | None = None  # agent.node.pace: the straggler every agent names, at a window it judged
    sdc: SdcFacts | None = None  # agent.node.sdc: when replica votes named this node the outlier
    spares_waiting: int = 0  # live nodes outside the round, one of which would take an SDC suspect's place
    written_off: str = ""  # agent.node.freeze, thawed side: its peers wrote this node off as frozen; why
    frozen: tuple[str, ...] = ()  # agent.node.freeze, survivor side: peers whose agents did not answer
    frozen_detail: str = ""  # ... and what the log line says about them
    unusable_round: Reason | None = None  # the last rejoin or replace (for this reason) got no round to hand over
    whole_node: bool = False  # a worker said its node's ranks are one unit of state (HSDP): replaced together
    # The job's end as another node said it (its closed rendezvous, read from the watch, never
    # from a request), and where this node's workers stand: in a formed world taking steps, or
    # every script returned (they are exiting).
    job_ended: JobEnd | None = None
    in_world: bool = False
    scripts_returned: bool = False
    failed_for: float = 0.0  # seconds since this look's failed workers were first seen failed (0: none failed)


@dataclass(frozen=True)
class PaceFacts:
    """What the straggler watch (agent.node.pace) found at a window it judged: the node every
    agent names (:class:`~agent.node.stragglers.Straggler`, its ratio to the others), whether it
    is this node, the round's size, the spares waiting outside it, and whether evictions are on
    (``ELASTIC_STRAGGLER_EVICT``)."""

    straggler: Straggler
    mine: bool
    world: int
    spares: int = 0
    evict: bool = True


@dataclass(frozen=True)
class SdcFacts:
    """What the SDC watch (agent.node.sdc) read: when replica votes named this node the outlier."""

    outlier_at: tuple[float, ...]
    now: float
    window_s: float = SDC_WINDOW_S

    @property
    def suspect(self) -> str:
        """:func:`sdc_keep_out`'s line ('' : not suspect hardware)."""
        return sdc_keep_out(self.outlier_at, self.now, self.window_s) or ""


def straggler_out(pace: PaceFacts | None, min_nodes: int) -> str:
    """Why this node goes as the straggler ('' : it stays): only the straggler's own agent evicts
    it, when evictions are on and :func:`agent.node.stragglers.eviction` says the job gains."""
    if pace is None or not pace.mine or not pace.evict:
        return ""
    why = eviction(pace.straggler, pace.world, min_nodes, pace.spares)
    return "" if why is None else f"{pace.straggler.describe()}; evicted: {why}"


@dataclass(frozen=True)
class JobEnd:
    """How another node ended the job: ``failed`` unless it trained its last step; ``line`` says
    who ended it and why (agent.rendezvous.ended.JobEnded.line)."""

    failed: bool
    line: str


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: Reason | None = None
    ranks: tuple[int, ...] = ()  # REPLACE: the local ranks to start again
    dump_stacks: bool = False  # a hang: SIGUSR1 first, so the log shows where it hung
    detail: str = ""
    failed: Mapping[int, int] = field(default_factory=dict)  # local rank -> exit code, for FAIL's report
    nodes: tuple[str, ...] = ()  # REJOIN for FROZEN: the peers to write off
    unheeded: str = ""  # a finding not acted on (an SDC suspect the job cannot spare): log it, drop its strikes

    @property
    def counted(self) -> bool:
        return self.reason is not None and self.reason.counted and self.action in (Action.RESTART, Action.REPLACE)

    @property
    def final_snapshot_lost(self) -> bool:
        """FAIL because the final snapshot could not be written: the agent exits 74 as well."""
        return self.action is Action.FAIL and bool(self.failed) and all(
            code == FINAL_SNAPSHOT_LOST_EXIT for code in self.failed.values())

    @property
    def usage_error(self) -> bool:
        """FAIL because of a usage error: the agent exits 2 as well (``podFailurePolicy``, systemd)."""
        return self.action is Action.FAIL and bool(self.failed) and all(
            code == USER_ERROR_EXIT for code in self.failed.values())


CONTINUE = Decision(Action.CONTINUE)


def decide(obs: Observation) -> Decision:
    """The agent's next step: every decision the agent takes is made here.

    The rules about the workers and the round come first (:func:`_workers_and_round`, in
    order of precedence); then, while they say continue, a straggler and an SDC suspect go
    out (keep-out); last the freeze watch: a node its peers wrote off as frozen stops its
    stale workers (as after a lost lease) whatever else was decided, short of the end of the
    job; a survivor whose worker waits on silent peers writes them off and rejoins."""
    decision = _workers_and_round(obs)
    straggler = straggler_out(obs.pace, obs.min_nodes)
    if decision.action is Action.CONTINUE and straggler:
        decision = Decision(Action.KEEP_OUT, Reason.STRAGGLER, detail=straggler)
    suspect = obs.sdc.suspect if obs.sdc is not None else ""
    if decision.action is Action.CONTINUE and suspect and obs.nodes_without_us is not None:
        if obs.nodes_without_us + obs.spares_waiting < obs.min_nodes:  # a warm spare waiting takes its place
            decision = Decision(Action.CONTINUE, unheeded=(
                f"{suspect}; not kept out: without it {obs.nodes_without_us} node(s) would remain, fewer "
                f"than the {obs.min_nodes} the job needs"))
        else:
            decision = Decision(Action.KEEP_OUT, Reason.SDC, detail=suspect)
    if decision.action in (Action.SUCCEED, Action.FAIL, Action.END) or decision.reason is Reason.LEASE_LOST:
        return decision
    if obs.written_off:
        return Decision(Action.RESTART, Reason.LEASE_LOST, detail=obs.written_off, unheeded=decision.unheeded)
    if decision.action is Action.CONTINUE and obs.frozen:
        return Decision(Action.REJOIN, Reason.FROZEN, detail=obs.frozen_detail, nodes=obs.frozen,
                        unheeded=decision.unheeded)
    return decision


def _workers_and_round(obs: Observation) -> Decision:
    """The rules about the workers and the round, in order of precedence."""
    failed = {rank: code for rank, code in obs.exits.items() if code not in (None, 0)}

    # 1. Our own lease is gone: the world moved on without us. Whatever our workers hold
    #    belongs to an old round, in either mode; they must die before they act.
    if obs.membership is Reason.LEASE_LOST:
        return Decision(Action.RESTART, Reason.LEASE_LOST, detail="this node's etcd lease was lost")

    # 1b. The round the last rejoin or replace took part in cannot be handed to in-place
    #     workers (no offer came): they cannot follow it, so they start again in it.
    if obs.unusable_round is not None:
        return Decision(Action.RESTART, obs.unusable_round, detail="no usable round for in-place workers; restarting "
                                                                   "them")

    # 2. A usage error: a worker exited with 2, and retrying cannot fix it. Its siblings
    #    may have failed with it (their collective with it broke: an ordinary exit code), and
    #    still nothing a restart would change; a death by a signal beside it is a crash.
    usage = {rank: code for rank, code in failed.items() if code == USER_ERROR_EXIT}
    if usage and all(code > 0 for code in failed.values()):
        return Decision(Action.FAIL, Reason.WORKER_FAILED, failed=usage,
                        detail=f"local worker(s) {sorted(usage)} exited with code 2 (a usage error, which would "
                               "come back at every start); not restarting")

    # 2b. The job trained its last step, but rank 0 could not write its final snapshot (a full
    #     or read-only directory): no restart frees a disk, and the worker said it in one line.
    lost = {rank: code for rank, code in failed.items() if code == FINAL_SNAPSHOT_LOST_EXIT}
    if lost and len(lost) == len(failed):
        return Decision(Action.FAIL, Reason.WORKER_FAILED, failed=lost,
                        detail=f"local worker(s) {sorted(lost)} trained the last step but could not write the final "
                               f"snapshot (exit {FINAL_SNAPSHOT_LOST_EXIT}; its line above names the directory and "
                               "the newest intact snapshot); not restarting: no restart frees a disk")

    # 3. Done: every local worker exited cleanly.
    if obs.exits and all(code == 0 for code in obs.exits.values()):
        return Decision(Action.SUCCEED)

    # 3a. Another node ended the job while this node's in-place workers were joining a round
    #     (none in a formed world): the round will never complete, and they waited for its 30 s
    #     timeout before (a node back just after the last step; a node whose peer failed the job
    #     with a usage error). They stop now and the node leaves as the job did. Workers in a
    #     formed world are left to end by themselves: they trained the last step with it, or
    #     they are about to say why the job failed in their own words (a rank 0 that found the
    #     training diverged exits 2 a moment after its peer gave up).
    if (obs.job_ended is not None and not obs.scripts_returned and obs.in_place and not obs.in_world
            and (obs.job_ended.failed or not failed)):
        return Decision(Action.END, Reason.JOB_ENDED, detail=obs.job_ended.line)

    # 3b. A failed health check (agent.node.health) while training: kept out while the others can
    #     train on without it (it rejoins once the checks pass, agent.node.health_watch); where
    #     they cannot, it trains on and the line and the metric say it is sick.
    if obs.health and obs.nodes_without_us is not None and obs.nodes_without_us >= obs.min_nodes:
        return Decision(Action.KEEP_OUT, Reason.HEALTH, failed=failed, detail=obs.health)

    # 4. Local failures: a crash loop first (see the module's doc), then ours to count. Only
    #    a failure of its own extends a streak: one a peer caused never keeps a node out.
    if failed and obs.etcd_lost:  # no restart can help: every group would be refused, here and elsewhere
        return Decision(Action.FAIL, Reason.ETCD_LOST, failed=failed, detail=obs.etcd_lost)
    own_quick = any(not f.peer_caused and f.right_after_start for r, f in obs.failures.items() if r in failed)
    shared = script_error(crash_report(obs.failures), obs.peer_crashes) if own_quick else None
    if shared is not None:
        return Decision(Action.FAIL, Reason.SCRIPT_ERROR, failed=failed,
                        detail=f"the workers of every node ({len(obs.peer_crashes or ()) + 1}) {SCRIPT_ERROR_WORDS} "
                               f"(no restart or keep-out can fix it): {shared}")
    if own_quick and obs.crash_streak >= CRASH_LOOP_TRIES and obs.nodes_without_us is not None:
        # As out of restarts below: a peer that crashed the same way a moment later makes this the
        # script's error, not this node's crash loop (a whole suite under load kept a node out so).
        if obs.failed_for < PEER_WORDS_GRACE_S and peers_still_silent(obs.peer_crashes):
            return Decision(Action.CONTINUE)
        ranks = sorted(failed)
        cause = last_words({r: f for r, f in obs.failures.items() if r in failed})
        loop = (f"local rank(s) {ranks} failed right after each of the last {obs.crash_streak} starts "
                f"(a crash loop)")
        if obs.nodes_without_us >= obs.min_nodes:
            return Decision(Action.KEEP_OUT, Reason.CRASH_LOOP, failed=failed, detail=f"{loop}: {cause}")
        return Decision(Action.FAIL, Reason.CRASH_LOOP, failed=failed,
                        detail=f"{loop}, and without this node {obs.nodes_without_us} node(s) would remain, fewer "
                               f"than the {obs.min_nodes} the job needs (--nnodes); the cause: {cause}")
    if failed:
        if obs.restarts_left <= 0:
            # The last restart is spent, but a peer that failed with this node (the same bug at the same
            # step) may not have said so yet: its words a moment later make this the script's error,
            # said as such on every node, not "no restarts left" here and the script's error there.
            if own_quick and obs.failed_for < PEER_WORDS_GRACE_S and peers_still_silent(obs.peer_crashes):
                return Decision(Action.CONTINUE)
            return Decision(Action.FAIL, Reason.WORKER_FAILED, failed=failed, detail="no restarts left")
        if obs.in_place:
            return Decision(Action.REPLACE, Reason.WORKER_FAILED, ranks=_replaced(obs, failed), failed=failed)
        return Decision(Action.RESTART, Reason.WORKER_FAILED, failed=failed)

    # 5. Someone else's doing: a peer lost or a node joining. Never counted.
    if obs.membership in (Reason.PEER_LOST, Reason.SCALE_UP):
        return Decision(Action.REJOIN if obs.in_place else Action.RESTART, obs.membership)

    # 6. An in-place worker's collective failed while every lease held (a frozen worker,
    #    a reset connection): the same members form a new round, which is cheap.
    if obs.reform_requested and obs.in_place:
        return Decision(Action.REJOIN, Reason.REFORM)

    # 7. No local rank made progress for the hang timeout.
    if obs.stalled_for is not None:
        if obs.restarts_left <= 0:
            return Decision(Action.FAIL, Reason.HANG, dump_stacks=True, detail="hung, and no restarts left")
        running = tuple(sorted(rank for rank, code in obs.exits.items() if code is None))
        if obs.in_place:
            return Decision(Action.REPLACE, Reason.HANG, ranks=_replaced(obs, running), dump_stacks=True)
        return Decision(Action.RESTART, Reason.HANG, dump_stacks=True)

    return CONTINUE


def _replaced(obs: Observation, ranks: Iterable[int]) -> tuple[int, ...]:
    """The local ranks a replace starts again: ``ranks``, or every one of the node when its
    ranks hold one unit of state (HSDP: a lone new rank cannot build the node's shard group,
    and its node's others lose their peer in FSDP2's collectives anyway)."""
    return tuple(sorted(obs.exits)) if obs.whole_node else tuple(sorted(ranks))


def stop_signal(reason: Reason | None, progressed: bool) -> int:
    """How to stop a worker group: SIGTERM (rank 0 flushes its snapshot) only when the
    world is healthy and the group has made progress; otherwise SIGKILL at once, since a
    worker blocked in process-group set-up would never run a SIGTERM handler."""
    if reason is None or reason.abrupt or not progressed:
        return signal.SIGKILL
    return signal.SIGTERM


def refunded(reason: Reason, previous: Iterable[str], current: Iterable[str]) -> bool:
    """A worker failure that the next round explains as a peer's death is not ours.

    A SIGKILLed peer makes our worker's collective fail at once, usually before its lease
    expires; only the next round shows that the peer is gone.
    """
    previous_set = set(previous)
    return reason is Reason.WORKER_FAILED and bool(previous_set) and not previous_set <= set(current)


# ---------------------------------------------------------------------- the crash streak, as acts go

@dataclass(frozen=True)
class Streak:
    """This node's crash streak (:func:`next_streak`) and what it was before the failure now
    being acted on (``before``: what a refund restores)."""

    current: int = 0
    before: int = 0


def streak_acted_on(streak: Streak, decision: Decision, observed: int) -> Streak:
    """The streak once ``decision`` is carried out: a failure of the workers acted on (a restart,
    a replace, a keep-out or the end for it) counts as :func:`next_streak` saw it (``observed``);
    any other decision leaves the streak as it was."""
    if decision.failed and decision.reason in (Reason.WORKER_FAILED, Reason.CRASH_LOOP):
        return Streak(observed, streak.current)
    return streak


@dataclass(frozen=True)
class AfterRound:
    """What the round a restart took part in says of the failure it restarted for."""

    reason: Reason  # the restart's reason as counted and reported
    refund: bool = False  # give back the restart it spent
    streak: Streak | None = None  # the crash streak from now on (None: unchanged)


def after_round(reason: Reason, previous: Iterable[str], current: Iterable[str], streak: Streak) -> AfterRound:
    """A worker failure the new round explains as a peer's death (:func:`refunded`) is refunded:
    reported as a peer lost, its restart given back, and no step of a crash loop of this node's."""
    if refunded(reason, previous, current):
        return AfterRound(Reason.PEER_LOST, refund=True, streak=Streak(streak.before, streak.before))
    return AfterRound(reason)


def formed_afresh(reason: Reason | None, fresh_world: bool) -> Decision | None:
    """After an in-place rejoin or replace: a round that closed while no member's workers ran in
    place forms afresh, every member starting its workers anew, as its closer recorded for all of
    them alike. This node's in-place workers cannot follow it: they start again in it, a restart
    for a node joining (when that was the cause) or for a peer lost, never counted. None: the
    round is one the workers can take in place."""
    if not fresh_world:
        return None
    return Decision(Action.RESTART, Reason.SCALE_UP if reason is Reason.SCALE_UP else Reason.PEER_LOST)


def before_joining(health: str) -> Decision | None:
    """Before a round this node would join (at its start, after a restart or a keep-out):
    a node that fails a health check (``health``: :func:`agent.node.health.verdict`'s line) stays
    out, kept out as for any other cause, until every check passes
    (:meth:`agent.node.health_watch.HealthWatch.gate` carries it out). Unlike 3b, whether the
    others could train without it is not asked: a node not yet in a round holds nothing up.
    None: it joins."""
    return Decision(Action.KEEP_OUT, Reason.HEALTH, detail=health) if health else None




def sdc_keep_out(outlier_at: Iterable[float], now: float, window_s: float = SDC_WINDOW_S,
                 strikes: int = SDC_STRIKES) -> str | None:
    """Silent data corruption (``elastic.consistency``): a node that a majority of replicas
    named the outlier ``strikes`` times within ``window_s`` is suspect hardware, kept out
    with the crash loop's back-off (a spare takes its place where one waits). Returns the
    detail line, or None. Being one of two suspects (two replicas, no majority) never
    counts: nothing says which side was wrong."""
    recent = sorted(t for t in outlier_at if now - window_s <= t <= now)
    if len(recent) < strikes:
        return None
    return (f"suspect hardware: named the outlier by the replica vote {len(recent)} times within "
            f"{window_s:.0f} s (silent data corruption of its state; see docs/reliability.md)")
