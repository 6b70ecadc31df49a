"""The node agent: one loop that observes its node, decides (:mod:`agent.policy`) and acts.

torch's ``LocalElasticAgent`` only notices trouble when a local worker exits, and it can
only restart every worker at once. This agent owns its loop instead, built on torch's
public pieces: it is an ``ElasticAgent``, it rendezvous through any ``RendezvousHandler``
(torchrun's ``--rdzv-backend``), and it starts workers through :mod:`agent.workers`
(``LogsSpecs``, ``SubprocessHandler``, ``TailLog``), warm from a standby where it can.

The call order, every ``--monitor-interval`` or sooner (etcd news, a worker's request and
signals wake it at once):

1. **observe**: worker exits, the rendezvous' verdict on membership (with ``etcd-v3``: a
   peer's lease gone, our own lease gone, a new round), the hang watchdog, in-place
   workers' statuses, ``elastic kill`` commands through etcd;
2. **decide**: :func:`agent.policy.decide`, a pure function;
3. **act**: continue; succeed (after an exit barrier); fail; restart the group; or, for
   in-place workers, rejoin (rendezvous and hand the round to the running workers) or
   replace (start again only the local ranks that died or hung).

In-place recovery needs the ``etcd-v3`` backend: the agent hosts a small TCPStore for the
rounds in which its node comes first, and advertises it, with its worker count, in the
node registry; its workers learn each round through :mod:`elastic.inplace.channel`.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import socket
import time
from dataclasses import dataclass
from typing import Any, Sequence

from torch.distributed.elastic.agent.server.api import (
    DEFAULT_ROLE,
    ElasticAgent,
    RunResult,
    Worker,
    WorkerGroup,
    WorkerSpec,
    WorkerState,
)
from torch.distributed.elastic.multiprocessing import LogsSpecs
from torch.distributed.elastic.rendezvous import RendezvousClosedError, RendezvousHandler
from torch.distributed.elastic.utils import macros

from elastic import contract
from elastic.goodput.files import GOODPUT_DIR_ENV
from elastic.goodput.recorder import RECOVERY_ENV
from elastic.inplace.channel import CONTROL_DIR_ENV, IN_PLACE, AgentChannel, RoundOffer, assign_ranks, make_offer
from elastic.metrics.export import MULTIPROC_ENV
from elastic.rendezvous.handler import LEASE_LOST, NEW_ROUND, PEER_LOST, EtcdV3RendezvousHandler
from elastic.rendezvous.keepout import KeepOut, backoff, next_strikes
from elastic.rendezvous.lease_clock import Verdict
from elastic.rendezvous.rounds import FAILURE, JOIN
from elastic.worker_env import joins_live_world, setup_world_env

from .commands import CommandWatch
from .goodput import GoodputAccountant, fault_nodes
from .launch import DEFAULT_TERM_GRACE_S
from .metrics import AgentMetrics
from .oom import killed_by, oom_kills
from .fault_cause import attribute, timeline_reason
from .freeze import FreezeWatch
from .health_watch import HealthWatch
from .pace import PaceMonitor
from .policy import (
    Action,
    Decision,
    Failure,
    Observation,
    Reason,
    crash_report,
    decide,
    etcd_lost,
    last_words,
    next_streak,
    refunded,
    settled,
    stop_signal,
)
from .sdc import SdcWatch
from .settings import AgentSettings
from .fork_server import ForkServer, discard_early
from .watchdog import HangWatch
from .worker_boot import AGENT_PID_ENV
from .workers import Launch, LocalWorkers

log = logging.getLogger("elastic.agent")

STANDBY_READY_TIMEOUT_S = 120.0
TERM_GRACE_ENV = contract.TERM_GRACE_ENV  # tells the workers how long they have (elastic.trainer)
_STACK_DUMP_WAIT_S = 1.0
_OFFER_TRIES = 5
_KEEP_OUT_SEEN_S = 5.0  # how long to wait for the rendezvous' mirror to show our keep-out key change
_MEMBERSHIP = {PEER_LOST: Reason.PEER_LOST, LEASE_LOST: Reason.LEASE_LOST, NEW_ROUND: Reason.SCALE_UP}


@dataclass(frozen=True)
class AgentSpec:
    """What every local rank runs, and torchrun's launch settings the loop needs."""

    role: str
    nproc: int
    command: tuple[str, ...]  # ``${local_rank}`` is substituted per rank, as torchrun does
    max_restarts: int
    monitor_interval: float
    run_id: str
    local_addr: str | None = None
    numa_options: Any = None
    log_line_prefix_template: str | None = None
    term_grace: float = DEFAULT_TERM_GRACE_S  # --term-grace: SIGTERM to SIGKILL when the agent is stopped


class JobFinishedError(RendezvousClosedError):
    """The job trained its last step while this node was out: nothing to join, and exit 0."""


class AgentSignal(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(f"agent got signal {signal.Signals(signum).name}")
        self.signum = signum


class NodeAgent(ElasticAgent):
    def __init__(self, spec: AgentSpec, handler: RendezvousHandler, settings: AgentSettings,
                 metrics: AgentMetrics, logs_specs: LogsSpecs) -> None:
        self.spec, self.handler, self.settings, self.metrics = spec, handler, settings, metrics
        self.node = settings.node_name
        self.ours = handler if isinstance(handler, EtcdV3RendezvousHandler) else None
        self.remaining_restarts = spec.max_restarts
        self.restart_count = 0
        self.watch = HangWatch(settings.heartbeat_dir, settings.hang_timeout,
                               settings.hang_startup_timeout, node=self.node)
        self.commands = CommandWatch(self.ours, self.node) if self.ours is not None else None
        if self.commands is not None:
            self.commands.heartbeat_dir = str(settings.heartbeat_dir)  # `elastic inject-sdc`: the request goes there
        self.channel: AgentChannel | None = None
        self.store_server: Any = None
        if self.ours is not None and settings.in_place:
            self.channel = AgentChannel(settings.control_dir)
            self.store_server, store_addr = _start_round_store(settings.store_host or spec.local_addr)
            self.ours.lease.update(store_addr=store_addr)
        if self.ours is not None:
            self.ours.advertise_host = settings.store_host or spec.local_addr  # where peers ask for its witness
            self.ours.lease.update(metrics_url=metrics.url, nproc=spec.nproc)
            self.ours.client.error_listeners.append(lambda kind: metrics.etcd_errors.labels(op=kind).inc())
            self.ours.mirror.listeners.append(self._wake)
            self.ours.reachability.listeners.append(self._on_keep_out)
            if self.channel is not None:
                self.ours.while_spare.append(self._start_ahead)
                self.ours.bootstrap_needed = self._needs_bootstrap
        self.goodput = GoodputAccountant(self.node, settings.goodput_dir, settings.heartbeat_dir, metrics.registry,
                                         self.ours)
        # stragglers: publish this node's pace, name the slow node, evict it (agent/pace.py)
        self.pace = PaceMonitor(self.node, self.ours, metrics, settings.metrics_dir, settings.heartbeat_dir) \
            if self.ours is not None else None
        # silent data corruption: replica votes that named this node (agent/sdc.py)
        self.sdc = SdcWatch(self.node, settings.heartbeat_dir)
        # node health: a sick node does not join, and goes out when it falls sick (agent/health_watch.py)
        self.health = HealthWatch(self.node, settings.snapshot_dir, settings.work_dir, settings.worker_env,
                                  self.ours.client.settings if self.ours is not None else None, metrics.health_failing)
        # freezes: write off a peer whose agent does not answer; stop stale workers once thawed (agent/freeze.py)
        self.freeze = FreezeWatch(self.node, self.ours, self.channel) \
            if self.ours is not None and self.channel is not None else None
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self.pool = ForkServer(spec.nproc, env={**os.environ, **self._node_env()}) if settings.warm_start else None
        if self.pool is not None:
            self.pool.fill()  # the template imports torch while the first rendezvous runs
        else:
            discard_early()  # the template forked at the agent's start, never to be used
        self.workers = LocalWorkers(logs_specs, spec.role, self.pool, spec.numa_options,
                                    on_start=lambda mode: metrics.worker_starts.labels(mode=mode).inc())
        self.group_rank = self.group_world = 0
        self.rank_base, self.world_size = 0, spec.nproc
        self.master_addr, self.master_port = "", 0
        self.round_number, self.participants = -1, ()
        self.offer: RoundOffer | None = None
        self._group_started = time.time()
        self._refilled = False
        self._said_in_place = False
        self._holds_state = False  # what this node's registry record says: its workers train in place
        self._live_world = False  # the round's other members already train in place: ours join them
        self._joiner_pids: set[int] = set()  # workers started into a live in-place world (_in_place_statuses)
        self._prestarted: dict[int, int] = {}  # local rank -> pid: workers started while a spare (_start_ahead)
        self._reform_why = ""  # what the worker asking for a new round said
        self._recovering = False  # the workers started next repair a broken world (goodput)
        self._crash_streak = self._streak_before = 0  # own failures in a row right after a start (policy)
        self._crash_strikes = 0  # keep-outs for a crash loop (elastic.rendezvous.keepout.backoff)
        self._back_in_at: float | None = None  # when this node last came back from such a keep-out
        self._restarted: _Restarted | None = None  # the last restart, until its first progress explains it
        self._kept_out_peers: list[str] = []  # members of this round that went out for a crash loop
        self._seen_failures: dict[int, Failure] = {}  # the last look's failed workers, for the log
        self.failure_line = ""  # why the job failed, in one line, when this agent can say it (launch prints it)
        self._oom_seen = oom_kills()  # the kernel's OOM kill count, to tell an OOM kill from a SIGKILL (agent.oom)
        self._kill_words: dict[int, str] = {}  # pid -> what killed it, judged once
        self._worker_group = WorkerGroup(WorkerSpec(
            role=spec.role, local_world_size=spec.nproc, rdzv_handler=handler, entrypoint=spec.command[0],
            args=spec.command[1:], max_restarts=spec.max_restarts, monitor_interval=spec.monitor_interval,
            local_addr=spec.local_addr))
        metrics.remaining_restarts.set(self.remaining_restarts)

    # ------------------------------------------------------------------ torch's contract

    def get_worker_group(self, role: str = DEFAULT_ROLE) -> WorkerGroup:
        return self._worker_group

    def run(self, role: str = DEFAULT_ROLE) -> RunResult:
        previous = {sig: signal.signal(sig, self._on_signal) for sig in _SIGNALS}
        try:
            self._await_standbys()
            self._rendezvous()
            self._start_group()
            return self._loop()
        except AgentSignal as exc:
            pids = self.workers.pids()
            self._terminate(exc)
            self.goodput.tick(pids, self.rank_base, force=True)  # rank 0's last marks, written as it stopped
            raise
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self._drop_prestarted()
            if self.pool is not None:
                self.pool.close()
            if self.channel is not None:
                self.channel.close()
            for fd in (self._wake_r, self._wake_w):
                os.close(fd)

    # ------------------------------------------------------------------ stopped: a pre-emption

    def _terminate(self, exc: AgentSignal) -> None:
        """The agent was told to stop (Kubernetes evicting the pod, a spot VM reclaimed,
        ``systemctl stop``): pass SIGTERM on to the workers and restart nothing.

        ``ElasticRun`` workers finish the step in flight, write a snapshot of it and exit
        with 143; a plain script does what its SIGTERM handler does. The agent stays in the
        job (its lease held) until they are out, so that its peers form the next round once
        they left at their step boundary rather than in the middle of it, and SIGKILLs
        whatever still runs when ``--term-grace`` is up. A second signal ends the wait at once.
        """
        grace, started = self.spec.term_grace, time.monotonic()
        name = signal.Signals(exc.signum).name
        running = [rank for rank, code in self.workers.exits().items() if code is None]
        self.metrics.set_state("stopped")
        if not running:
            log.warning("[%s] got %s: no local worker is running; exiting", self.node, name)
            self._stop(signal.SIGKILL, 0.0)
            return
        log.warning("[%s] got %s: passing SIGTERM to local rank(s) %s, which stop at a step boundary "
                    "(ElasticRun: after a snapshot of the last step); restarting nothing; SIGKILL in %g s "
                    "(--term-grace)", self.node, name, running, grace)
        hurry: list[int] = []
        previous = {sig: signal.signal(sig, lambda signum, _frame: hurry.append(signum)) for sig in _SIGNALS}
        try:
            self.workers.terminate(signal.SIGTERM)
            deadline = started + grace
            while not hurry and time.monotonic() < deadline and self.workers.running():
                time.sleep(0.02)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        left = self.workers.running()
        waited = time.monotonic() - started
        if left and hurry:
            log.warning("[%s] got %s again: SIGKILL to local rank(s) %s now, %.1f s after the first", self.node,
                        signal.Signals(hurry[0]).name, left, waited)
        elif left:
            log.warning("[%s] local rank(s) %s still running %.1f s after SIGTERM (--term-grace %g s): SIGKILL. "
                        "A snapshot they were still writing is lost, and the job resumes from the newest durable "
                        "one; give them longer with --term-grace (ELASTIC_TERM_GRACE), and on Kubernetes a "
                        "terminationGracePeriodSeconds a few seconds above it", self.node, left, waited, grace)
        else:
            codes = {rank: code for rank, code in self.workers.exits().items() if rank in running}
            log.info("[%s] local workers stopped %.1f s after %s (exit codes %s); leaving the job", self.node,
                     waited, name, ", ".join(f"rank {r}: {c}" for r, c in sorted(codes.items())))
        self._stop(signal.SIGKILL, 0.0)  # what is left, and each worker's whole session (data loaders...)

    # ------------------------------------------------------------------ the loop

    def _loop(self) -> RunResult:
        while True:
            self._wait(self.spec.monitor_interval)
            if self.commands is not None:
                self.commands.poll()  # `elastic kill` of this node from another machine
            self.goodput.tick(self.workers.pids(), self.rank_base)
            observed = self._observe()
            decision = decide(observed)
            if decision.action is Action.CONTINUE and self.pace is not None and self.ours is not None:
                slow = self.pace.look(self.participants, self.ours.timings.min_nodes)
                if slow is not None:  # this node is the straggler, and the others train faster without it
                    decision = Decision(Action.KEEP_OUT, Reason.STRAGGLER, detail=slow)
            if decision.action is Action.CONTINUE:
                decision = self._after_sdc_events()
            if self.freeze is not None:
                decision = self._after_freezes(decision)
            if decision.failed and decision.reason in (Reason.WORKER_FAILED, Reason.CRASH_LOOP):
                # this failure is being acted on: it counts (a refund in _restart takes it back)
                self._streak_before, self._crash_streak = self._crash_streak, observed.crash_streak
            self._export_lease()
            if decision.action is Action.CONTINUE:
                self._while_healthy()
            elif decision.action is Action.SUCCEED:
                return self._succeed()
            elif decision.action is Action.FAIL:
                return self._fail(decision)
            elif decision.action is Action.RESTART:
                self._restart(decision)
            elif decision.action is Action.REJOIN:
                self._rejoin(decision)
            elif decision.action is Action.REPLACE:
                self._replace(decision)
            elif decision.action is Action.KEEP_OUT:
                self._keep_out(decision)

    def _observe(self) -> Observation:
        exits = self.workers.exits()
        membership = None
        if self.ours is not None:
            membership = _MEMBERSHIP.get(self.ours.restart_reason() or "")
            self._kept_out_peers = self._members_kept_out() if membership is None else []
            if self._kept_out_peers:  # it will take part in no collective of this round: a peer lost
                membership = Reason.PEER_LOST
        elif self.handler.num_nodes_waiting() > 0:
            membership = Reason.SCALE_UP
        stalled = self.watch.stalled() if all(code is None for code in exits.values()) else None
        in_place, reform = self._in_place_statuses()
        self._publish_in_place(self._holds_state)
        failures = self._seen_failures = self._failures(exits)
        if failures:
            self._say_fault(last_words(failures))
        others = None if self.ours is None else len([n for n in self.participants if n != self.node])
        peer_crashes = self._peer_crashes(crash_report(failures))
        return Observation(exits=exits, membership=membership, stalled_for=stalled, in_place=in_place,
                           reform_requested=reform, restarts_left=self.remaining_restarts, failures=failures,
                           crash_streak=next_streak(self._crash_streak, failures.values()),
                           nodes_without_us=others, peer_crashes=peer_crashes,
                           etcd_lost=self._etcd_lost() if failures else "", health=self.health.look(),
                           min_nodes=self.ours.timings.min_nodes if self.ours is not None else 1)

    def _peer_crashes(self, report: str) -> dict[str, str] | None:
        """Tell the other nodes (this node's registry record) what its workers failed with right
        after their start, and read what the round's other members said (agent.policy): the
        same words from every node make it the script's error. Written only on a change."""
        if self.ours is None:
            return None
        if report:
            self._say_crash(report)
        records = self.ours.node_records()
        return {n: str(records[n].extra.get("crash", "")) if n in records else ""
                for n in self.participants if n != self.node}

    def _etcd_lost(self) -> str:
        """agent.policy.etcd_lost against the round etcd holds now (a newer group's round is there too)."""
        if self.ours is None:
            return ""
        fence, now = self._stale_fence(), self.ours.newest_round()
        return etcd_lost(fence, self.spec.run_id, now) if fence is not None and now is not None else ""

    def _stale_fence(self) -> dict[str, Any] | None:
        """What rank 0 said of the fence that refused its group (elastic.snapshots), if it did."""
        try:
            data = json.loads((self.settings.heartbeat_dir / contract.STALE_FENCE_FILE).read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def _say_fault(self, words: str) -> None:
        """The last fault of this node, kind first (agent.fault_cause), in its registry record
        for ``elastic top``. Written only on a change."""
        if self.ours is not None and self.ours.lease.record.extra.get("fault") != words[:300]:
            self.ours.lease.update(extra={**self.ours.lease.record.extra, "fault": words[:300]})

    def _say_crash(self, report: str) -> None:
        assert self.ours is not None
        extra = self.ours.lease.record.extra
        if extra.get("crash", "") != report:
            self.ours.lease.update(extra={**extra, "crash": report})

    def _after_sdc_events(self) -> Decision:
        """agent/sdc.py: replica votes named this node the outlier twice within the window:
        suspect hardware, kept out (if the others can train on without it)."""
        suspect = self.sdc.look()
        if suspect is None or self.ours is None:
            return Decision(Action.CONTINUE)
        others = len([n for n in self.participants if n != self.node])
        if others < self.ours.timings.min_nodes:
            log.error("[%s] %s; not kept out: without it %d node(s) would remain, fewer than the %d the job needs",
                      self.node, suspect, others, self.ours.timings.min_nodes)
            self.sdc.forget()
            return Decision(Action.CONTINUE)
        return Decision(Action.KEEP_OUT, Reason.SDC, detail=suspect)

    def _after_freezes(self, decision: Decision) -> Decision:
        """agent/freeze.py: thawed after its peers wrote it off, this node stops its stale workers
        first (as after a lost lease); a survivor whose worker waits on a silent peer writes it off."""
        assert self.freeze is not None
        if decision.action in (Action.SUCCEED, Action.FAIL) or decision.reason is Reason.LEASE_LOST:
            return decision
        stale = self.freeze.written_off(self.round_number, self.participants,
                                        fresh=decision.action is not Action.CONTINUE)
        if stale is not None:
            return Decision(Action.RESTART, Reason.LEASE_LOST, detail=stale)
        if decision.action is Action.CONTINUE:
            frozen = self.freeze.look(self.workers.pids(), self.round_number, self.participants)
            if frozen is not None:
                return Decision(Action.REJOIN, Reason.FROZEN, detail=frozen.detail)
        return decision

    def _members_kept_out(self) -> list[str]:
        """Members of this node's round that hold a keep-out key: one that went out after the
        round closed (a crash loop: ``_keep_out``) keeps its lease, so nothing else says so."""
        assert self.ours is not None
        others = [n for n in self.participants if n != self.node]
        if not others:
            return []
        out = self.ours.reachability.keep_outs(self.ours.mirror.entries()[0])
        return [n for n in others if n in out and out[n].round >= self.round_number]  # older: put back, a replay

    def _failures(self, exits: dict[int, int | None]) -> dict[int, Failure]:
        """The failed local workers in detail: how long each ran and its last words."""
        out = {}
        for rank, code in exits.items():
            worker = self.workers.workers.get(rank)
            if code in (None, 0) or worker is None:
                continue
            message = attribute(worker.error_line())  # "disk full (ENOSPC): OSError: ..." (agent.fault_cause)
            if not message and code < 0:
                message = self._kill_words.get(worker.pid, "")
                if not message:
                    now = oom_kills()
                    message = self._kill_words[worker.pid] = killed_by(-code, self._oom_seen, now)
                    self._oom_seen = now
            out[rank] = Failure(code=int(code), ran_for=worker.ran_for(), message=message,
                                progressed=self.watch.progressed_since_start(rank))
        return out

    def _on_keep_out(self, out: Any) -> None:
        """The rendezvous keeps this node out (``out``: why and how long) or lets it back in (None)."""
        self.metrics.kept_out.set(1 if out is not None else 0)
        self.metrics.keep_out_backoff.set(out.backoff if out is not None else 0)
        if out is not None:
            self.metrics.kept_out_total.inc()

    def _export_lease(self) -> None:
        if self.ours is None:
            return
        age = self.ours.lease.clock().age(time.monotonic())
        self.metrics.keepalive_age.set(age if age is not None else 0.0)
        self.metrics.etcd_outage.set(1 if self.ours.lease_watch.verdict_now is Verdict.OUTAGE else 0)

    def _in_place_statuses(self) -> tuple[bool, bool]:
        """(every running local worker runs in place, one asked for a new round)."""
        self._holds_state = False
        if self.channel is None:
            return False, False
        statuses, starting = [], False
        for rank, pid in self.workers.pids().items():
            status = self.channel.status(rank)
            if status is None or status.pid != pid:
                if pid not in self._joiner_pids:
                    return False, False
                # Started into a world that trains in place, and not heard from yet: it takes
                # the newest offer at its first batch, so a round that comes meanwhile is
                # offered to it (restarting it would throw its start-up away, standby and all).
                starting = True
                continue
            statuses.append(status)
        in_place = (bool(statuses) or starting) and all(s.mode == IN_PLACE for s in statuses)
        self._holds_state = in_place and not starting and all(s.round >= 0 for s in statuses)
        if in_place and not self._said_in_place:
            self._said_in_place = True
            log.info("[%s] workers run in place: a peer lost or a node joining no longer restarts them", self.node)
        asking = [s for s in statuses if s.want_round_after is not None and s.want_round_after >= self.round_number]
        self._reform_why = asking[0].reason if asking else ""
        return in_place, bool(asking)

    def _publish_in_place(self, holds: bool) -> None:
        """Say in this node's registry record whether its workers train in place holding state:
        a node that starts workers into the same round then gives them a set-up world of their
        own (:func:`elastic.worker_env.joins_live_world`). Written only on a change."""
        if self.ours is None:
            return
        extra = self.ours.lease.record.extra
        if bool(extra.get("in_place")) == holds:
            return
        self.ours.lease.update(extra={**extra, "in_place": holds})

    def _wait(self, timeout: float) -> None:
        due = self.ours.lease_watch.seconds_to_deadline() if self.ours is not None else None
        if due is not None:
            timeout = min(timeout, due + 0.01)  # judge the lease on time, not at the next tick
        fds = [self._wake_r] + ([self.channel.wake_fd] if self.channel is not None else [])
        ready, _, _ = select.select(fds, [], [], timeout)
        for fd in ready:
            try:
                while os.read(fd, 4096):
                    pass
            except BlockingIOError:
                pass

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"w")
        except (BlockingIOError, OSError):
            pass

    def _on_signal(self, signum: int, _frame: Any) -> None:
        raise AgentSignal(signum)

    # ------------------------------------------------------------------ healthy

    def _while_healthy(self) -> None:
        self.metrics.set_state("healthy")
        if self._crash_streak:
            youngest = min((w.ran_for() for w in self.workers.workers.values()), default=0.0)
            self._crash_streak = settled(self._crash_streak, youngest)
            if not self._crash_streak and self.ours is not None:
                self._say_crash("")  # it trains: its old failure says nothing about the script any more
        if self._restarted is not None and self.watch.progressed():
            log.info("[%s] %s", self.node, self._restarted.explained(time.time()))
            self._restarted = None
        if self.pool is None:
            return
        if not self._refilled and (self.watch.progressed()
                                   or time.time() - self._group_started >= self.settings.standby_refill_after):
            self._refilled = True  # the group is up: standbys no longer compete with a recovery
        if self._refilled and not self.pool.full:
            self.pool.fill()
        self.metrics.standbys_ready.set(self.pool.ready_count())

    def _await_standbys(self) -> None:
        """Join the job only once this node can start its workers without importing torch.

        A node joining a running job opens a new round; the others would otherwise stand
        still (or, restarting, idle) while this node's workers imported torch.
        """
        deadline = time.monotonic() + STANDBY_READY_TIMEOUT_S
        while self.pool is not None and self.pool.ready_count() < self.pool.size:
            if time.monotonic() > deadline:
                log.warning("[%s] standby workers not ready after %.0f s; joining anyway (cold start)",
                            self.node, STANDBY_READY_TIMEOUT_S)
                return
            time.sleep(0.05)
        if self.pool is not None:  # said before the rendezvous: a spare waits there, its standbys ready
            self.metrics.standbys_ready.set(self.pool.ready_count())

    # ------------------------------------------------------------------ acting

    def _restart(self, decision: Decision) -> None:
        reason = decision.reason or Reason.SCALE_UP
        acted_at = time.time()
        log.warning("[%s] %s: stopping local workers now", self.node, self._describe(decision))
        if decision.dump_stacks:
            self._dump_stacks(list(self.workers.pids()))
        sig = stop_signal(reason, self.watch.progressed())
        grace = min(self.settings.graceful_stop, 30.0)
        pids, rank_base = self.workers.pids(), self.rank_base
        if reason is Reason.LEASE_LOST:
            self._stop(sig, grace)  # first: etcd may be out of reach, and no request may delay the fence
            self._say_fault(f"etcd lease lost: {self._describe(decision)}")  # agent.fault_cause.LEASE
        cause = timeline_reason(reason.value, [f.message for f in self._seen_failures.values()])
        self.goodput.acted(cause, at=acted_at)
        if self.ours is not None:
            self.ours.lease.update(state="stopping")
        self.metrics.set_state("stopped")
        if reason is not Reason.LEASE_LOST:
            self._stop(sig, grace)
        self.goodput.tick(pids, rank_base, force=True)  # what rank 0 marked before it stopped
        self.goodput.workers_stopped()
        if decision.counted:
            self.remaining_restarts -= 1
        self.restart_count += 1
        previous = self.participants
        if reason is Reason.WORKER_FAILED and self.ours is not None:
            self.ours.report_unreachable()  # a peer cut off from us fails our workers, its lease intact
        self._rendezvous(JOIN if reason in (Reason.SCALE_UP, Reason.LEASE_LOST) else FAILURE)
        if refunded(reason, previous, self.participants):
            reason = Reason.PEER_LOST  # our worker died because a peer did; not our failure to count
            self.remaining_restarts += 1
            self._crash_streak = self._streak_before  # nor a step of a crash loop of ours
        rendezvous_done = time.time()
        self.goodput.restarted(cause if reason is Reason.WORKER_FAILED else reason.value, fault_nodes(reason.value, self.node, previous, self.participants),
                               acted_at, rendezvous_done)
        self._recovering = reason is not Reason.LEASE_LOST  # these workers' start-up is the job's
        self._start_group()
        modes = sorted({w.mode for w in self.workers.workers.values()})
        start = "warm (pre-imported)" if modes == ["warm"] else "cold (importing torch)" if modes == ["cold"] \
            else "warm and cold"
        log.info("[%s] restart (%s)%s: world of %d nodes, workers started %s, %d restarts left", self.node,
                 reason.value, _change(previous, self.participants), self.group_world, start,
                 self.remaining_restarts)
        self._restarted = _Restarted(reason.value, _change(previous, self.participants), acted_at,
                                     rendezvous_done, time.time(), start)
        self.metrics.restarts.labels(reason=reason.value).inc()
        self.metrics.remaining_restarts.set(self.remaining_restarts)

    def _rejoin(self, decision: Decision) -> None:
        """In place: the workers keep running while this node takes part in the new round."""
        assert self.channel is not None
        log.info("[%s] %s: rejoining in place (workers keep running)", self.node, self._describe(decision))
        previous, before = self.round_number, self.participants
        if decision.reason is Reason.REFORM and self.ours is not None:
            self.ours.report_unreachable()  # so the next round can leave out a member nobody reaches
        self._rendezvous_for_offer(JOIN if decision.reason is Reason.SCALE_UP else FAILURE)
        if self.offer is None:
            log.warning("[%s] no usable round for in-place workers; restarting them", self.node)
            self._restart(Decision(Action.RESTART, Reason.PEER_LOST))
            return
        self.channel.offer(self.offer)
        self.watch.rejoined()
        assert decision.reason is not None
        self.metrics.reforms.labels(reason=decision.reason.value).inc()
        log.info("[%s] round %d -> %d in place%s: world of %d nodes (%s), %d workers", self.node, previous,
                 self.round_number, _change(before, self.participants), self.group_world,
                 ", ".join(self.participants), self.world_size)

    def _replace(self, decision: Decision) -> None:
        """In place: start again only the local ranks that died or hung."""
        assert self.channel is not None
        ranks = list(decision.ranks)
        acted_at = time.time()
        if decision.reason is not None:
            self.goodput.acted(decision.reason.value)
        log.warning("[%s] %s: starting local rank(s) %s again; the others keep running", self.node,
                    self._describe(decision), ranks)
        if decision.dump_stacks:
            self._dump_stacks(ranks)
        pids = [pid for rank, pid in self.workers.pids().items() if rank in ranks]
        before = self.workers.pids()
        self.workers.stop(signal.SIGKILL, ranks=ranks)
        self.goodput.tick(before, self.rank_base, force=True)  # what rank 0 marked before it died
        self.workers.forget(ranks)
        self.metrics.forget_pids(pids)
        for rank in ranks:
            self.channel.forget(rank)
            self.watch.forget(rank)
        self.goodput.workers_stopped(ranks)
        if decision.counted:
            self.remaining_restarts -= 1
        self._rendezvous_for_offer(FAILURE)
        if self.offer is None:
            self._restart(Decision(Action.RESTART, decision.reason))
            return
        self.channel.offer(self.offer)
        if decision.reason is not None:
            self.goodput.restarted(decision.reason.value, (self.node,), acted_at, time.time())
        if 0 in ranks:
            self.goodput.workers_started(time.time())
        self._recovering = True
        port = _free_port()  # the restarted ranks join a live world: a set-up world of their own first
        started = {rank: self.workers.start_again(rank, Launch(self._command(rank), self._env(rank, ranks, port)))
                   for rank in ranks}
        for worker in self._worker_group.workers:
            if worker.local_rank in started:
                worker.id = started[worker.local_rank]
        self._joiner_pids |= set(started.values())
        self.metrics.workers_started(self._worker_group, started)
        self._group_started, self._refilled = time.time(), False
        assert decision.reason is not None
        self.metrics.restarts.labels(reason=decision.reason.value).inc()
        self.metrics.remaining_restarts.set(self.remaining_restarts)
        modes = sorted({self.workers.workers[rank].mode for rank in started if rank in self.workers.workers})
        log.info("[%s] round %d: local rank(s) %s started again (%s), %d restarts left", self.node,
                 self.round_number, ranks, " and ".join(modes) or "?", self.remaining_restarts)

    def _keep_out(self, decision: Decision) -> None:
        """A crash loop (:mod:`agent.policy`): stop this node's workers and stay out of the
        job's rounds for the back-off an unreachable node gets, so the other nodes stop
        standing still for it and train on; then join again, as a newcomer would.

        The keep-out key goes to etcd first: every closer of the next round leaves out a
        node that holds one (``Reachability.excluded``), so the others' round, which may
        already be open, closes without this node instead of waiting for it."""
        assert self.ours is not None
        back_for = None if self._back_in_at is None else time.monotonic() - self._back_in_at
        self._crash_strikes = next_strikes(self._crash_strikes, back_for)
        out = KeepOut(self.node, self._crash_strikes, backoff(self._crash_strikes), cause=decision.detail,
                      round=self.round_number)
        log.error("[%s] kept out of the job for %.0f s (strike %d), so that the other nodes train on without it: %s",
                  self.node, out.backoff, out.strikes, decision.detail)
        if decision.reason not in (Reason.STRAGGLER, Reason.SDC, Reason.HEALTH):
            self.metrics.crash_loops.inc()
        self.sdc.forget()
        if self.pace is not None:
            self.pace.forget()
        _publish_keep_out(self.ours, out)
        self.goodput.acted(Reason.HEALTH.value if decision.reason is Reason.HEALTH else Reason.WORKER_FAILED.value)
        pids = self.workers.pids()
        self._stop(signal.SIGKILL, 0.0)
        self.goodput.tick(pids, self.rank_base, force=True)
        self.goodput.workers_stopped()
        if self.channel is not None:
            self.channel.withdraw()
        self.metrics.set_state("stopped")
        self._restarted = None
        if self.pool is not None:
            self.pool.fill()  # the standbys import while this node waits: its return starts warm
        deadline = time.monotonic() + out.backoff
        while time.monotonic() < deadline and not self.handler.is_closed():
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
        _publish_keep_out(self.ours, None)
        self._back_in_at = time.monotonic()
        if time.monotonic() >= deadline:  # else the job ended meanwhile, and the rendezvous says so
            again = ("it is still a straggler" if decision.reason is Reason.STRAGGLER
                     else "replica votes name it the outlier twice again" if decision.reason is Reason.SDC
                     else "a health check still fails" if decision.reason is Reason.HEALTH
                     else "its workers fail right after their start once more")
            log.info("[%s] back after %.0f s kept out; joining the job again (kept out again, for longer, if %s)",
                     self.node, out.backoff, again)
        self.restart_count += 1  # a new group: its own attempt directory for logs and error files
        self._rendezvous(JOIN)
        self._recovering = False
        self._start_group()

    def _succeed(self) -> RunResult:
        log.info("[%s] local workers finished", self.node)
        self.goodput.tick(self.workers.pids(), self.rank_base, force=True)  # rank 0's last steps
        if self.ours is not None:
            self.ours.lease.update(state="succeeded")
        self._exit_barrier()
        self.metrics.set_state("succeeded")
        return RunResult(state=WorkerState.SUCCEEDED, return_values={r: None for r in self.workers.pids()})

    def _fail(self, decision: Decision) -> RunResult:
        if decision.reason is Reason.ETCD_LOST:  # the fix is the line: no traceback to point at
            self.failure_line = decision.detail
            log.error("[%s] the job fails: %s", self.node, decision.detail)
        elif decision.reason in (Reason.CRASH_LOOP, Reason.SCRIPT_ERROR):  # one line that ends with the cause
            if decision.reason is Reason.CRASH_LOOP:
                self.metrics.crash_loops.inc()
            self.failure_line = f"{decision.detail}; the traceback: {self._traceback_where(decision.failed)}"
            log.error("[%s] the job fails: %s", self.node, self.failure_line)
        elif decision.final_snapshot_lost:  # the worker's line says it all; no torchrun box after it
            self.failure_line = decision.detail
            log.error("[%s] %s: the job fails", self.node, decision.detail)
        else:
            log.error("[%s] %s: the job fails", self.node, self._describe(decision))
        if decision.dump_stacks:
            self._dump_stacks(list(self.workers.pids()))
        failed_alone = self.workers.failures()  # before the stop adds its own victims
        if decision.usage_error or decision.final_snapshot_lost:  # the ranks that broke with it are not the story
            failed_alone = {rank: f for rank, f in failed_alone.items() if rank in decision.failed}
        pids = self.workers.pids()
        stopped = self._stop(signal.SIGTERM, self.settings.graceful_stop)
        self.goodput.tick(pids, self.rank_base, force=True)
        failures = failed_alone or stopped
        if self.ours is not None:
            self.ours.lease.update(state="failed")
        self.metrics.set_state("failed")
        return RunResult(state=WorkerState.FAILED, failures=failures)

    def _traceback_where(self, failed: Any) -> str:
        """Where a failed worker's traceback is: its stderr file, else this agent's own output."""
        files = sorted({w.stderr for r, w in self.workers.workers.items() if r in failed and w.stderr})
        return ", ".join(files) if files else "above, in this agent's output (stderr)"

    def _stop(self, sig: int, grace: float) -> dict[int, Any]:
        """Stop every local worker; returns torch's failure records of the stopped group."""
        pids = list(self.workers.pids().values())
        self.workers.stop(sig, grace=grace)
        failures = self.workers.failures()
        self.workers.forget()
        self.metrics.forget_pids(pids)
        return failures

    def _describe(self, decision: Decision) -> str:
        reason = decision.reason
        if reason is Reason.HANG:
            last = self.watch.last_progress()
            since = f"for {time.time() - last:.0f} s" if last is not None else "since the group started"
            return (f"no rank on this node made progress {since} (hang timeout {self.watch.describe_timeout()}); "
                    "dumping worker stacks, then restarting")
        if reason is Reason.LEASE_LOST and self.ours is not None and self.ours.lease_watch.verdict_now is Verdict.CUT_OFF:
            return self.ours.lease_watch.detail
        if decision.detail:
            return decision.detail
        return {
            Reason.PEER_LOST: f"{', '.join(self._kept_out_peers)} went out of the job (kept out)"
                              if self._kept_out_peers
                              else "a peer of this round lost its etcd lease (dead, frozen or cut off)",
            Reason.LEASE_LOST: "this node lost its own etcd lease (it was frozen or cut off); its workers are stale",
            Reason.SCALE_UP: "another node opened a new round (a node joined or came back)",
            Reason.REFORM: f"{self._reform_why}: forming the round again without them"
                           if self._reform_why.endswith("(SIGTERM)")  # elastic.trainer: peers left at a boundary
                           else f"a local worker's collective failed{_parenthesised(self._reform_why)} while "
                                "every lease held; forming the round again",
            Reason.WORKER_FAILED: f"local worker(s) {sorted(decision.failed)} failed "
                                  f"(exit {', '.join(str(c) for c in decision.failed.values())})"
                                  f"{self._last_words()}",
        }.get(reason, str(reason))  # type: ignore[arg-type]

    def _last_words(self) -> str:
        """`` with "ValueError: boom"``: what the failed workers' error files say, if anything."""
        words = last_words(self._seen_failures) if self._seen_failures else ""
        return f' with "{words}"' if words and not words.startswith("exit ") else ""

    def _dump_stacks(self, ranks: list[int]) -> None:
        """faulthandler in every agent worker dumps all threads' stacks on SIGUSR1."""
        self.workers.send(signal.SIGUSR1, ranks)
        time.sleep(_STACK_DUMP_WAIT_S)  # let faulthandler's writes land before the kill

    def _exit_barrier(self) -> None:
        """Stay in the registry until every peer has finished too, so that this node
        leaving early is not mistaken for a peer lost (which would restart the others).
        A peer kept out (a crash loop) trains nothing and will not finish: not waited for."""
        if self.ours is None:
            return
        deadline = time.monotonic() + self.settings.exit_barrier_timeout
        while time.monotonic() < deadline:
            records = self.ours.node_records()
            waiting = [n for n in self.participants
                       if n in records and records[n].state not in ("succeeded", "failed", "kept_out")]
            if not waiting:
                return
            entries, revision = self.ours.mirror.entries()
            self.ours.mirror.wait(revision, 0.5)

    # ------------------------------------------------------------------ rounds and groups

    def _refuse_a_finished_job(self) -> None:
        """A node whose workers succeeded trained the job's last step (``ElasticRun``: every
        rank confirmed it), so there is no round left to form: a node back from a keep-out
        or a restart just then would otherwise pull the finished nodes into a round their
        workers never join, and hold them in their exit barrier until it times out."""
        assert self.ours is not None
        done = sorted(n for n, r in self.ours.node_records().items() if r.state == "succeeded" and n != self.node)
        if done:
            raise JobFinishedError(f"the job finished (node {', '.join(done)}: workers succeeded) "
                                        "while this node was out")

    def _health_gate(self) -> None:
        """A node that fails a health check joins no round until it passes (agent.health_watch)."""
        def publish(out: Any) -> None:
            self.metrics.set_state("stopped" if out is not None else "healthy")
            if self.ours is not None:
                self.ours._start()  # the lease and mirror the keep-out key needs
                _publish_keep_out(self.ours, out)
            else:
                self._on_keep_out(out)

        if not self.health.gate(self.round_number, publish, self.handler.is_closed):
            raise RendezvousClosedError("the job ended while this node was kept out by a failed health check")

    def _rendezvous(self, cause: str = JOIN) -> None:
        """Take part in the next round; ``cause`` says why, should this node be the one to open it."""
        if self.ours is not None:
            self.ours.next_cause = cause
            self._refuse_a_finished_job()
        self._health_gate()
        started = time.monotonic()
        try:
            info = self.handler.next_rendezvous()
        except Exception as exc:
            self.metrics.rendezvous.labels(outcome=_outcome(exc)).observe(time.monotonic() - started)
            raise
        self.metrics.rendezvous.labels(outcome="ok").observe(time.monotonic() - started)
        self.group_rank, self.group_world = info.rank, info.world_size
        bootstrap = info.bootstrap_store_info
        if bootstrap is not None:
            self.master_addr, self.master_port = bootstrap.master_addr, bootstrap.master_port
        if self.ours is not None and self.ours.round is not None:
            self.round_number, self.participants = self.ours.round.round, self.ours.round.participants
        else:
            self.round_number += 1
        self.rank_base, self.world_size = self.group_rank * self.spec.nproc, self.group_world * self.spec.nproc
        self.offer, self._live_world = None, False
        if self.ours is not None:
            records = self.ours.node_records()
            nprocs = {n: r.nproc for n, r in records.items()}
            ranks = assign_ranks(self.participants, self.node, nprocs)
            if ranks is not None:
                self.rank_base, self.world_size = ranks
            self._live_world = self.channel is not None and joins_live_world(
                {n: bool(r.extra.get("in_place")) for n, r in records.items() if n in self.participants}, self.node)
            if self.channel is not None:
                cause = self.ours.round.cause if self.ours.round is not None else JOIN
                self.offer = make_offer(self.round_number, self.participants, self.node, nprocs,
                                        {n: r.store_addr for n, r in records.items()}, cause)
        self.metrics.round.set(self.round_number)
        self.metrics.nodes_in_round.set(self.group_world)
        self._write_status()

    def _write_status(self) -> None:
        """``status.json`` in the agent's directory: where this node's workers stand, for tools
        (``elastic local`` follows any script's progress through it and the heartbeats)."""
        status = {"node": self.node, "round": self.round_number, "participants": list(self.participants),
                  "group_rank": self.group_rank, "group_world": self.group_world, "rank_base": self.rank_base,
                  "world_size": self.world_size, "nproc": self.spec.nproc, "time": time.time()}
        path = self.settings.work_dir / "status.json"
        try:
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(status))
            os.replace(tmp, path)
        except OSError as exc:
            log.debug("cannot write %s: %s", path, exc)

    def _rendezvous_for_offer(self, cause: str) -> None:
        """A round whose every member's record says where its store is (a member that died
        as the round closed has none: the next round leaves it out). In-place workers need
        no torchrun bootstrap (MASTER_ADDR), which could wait on a dead rank 0."""
        if self.ours is not None:
            self.ours.bootstrap = False
        try:
            for _ in range(_OFFER_TRIES):
                self._rendezvous(cause)
                if self.offer is not None:
                    return
        finally:
            if self.ours is not None:
                self.ours.bootstrap = True

    def _needs_bootstrap(self, record: Any) -> bool:
        """Whether this node's workers may read MASTER_ADDR in ``record``'s round: not when they
        join a world that already trains in place (they start in a set-up world of their own,
        :meth:`_env`), so the rendezvous need not wait for rank 0 to publish it."""
        assert self.ours is not None
        records = self.ours.node_records()
        return not joins_live_world({n: bool(r.extra.get("in_place")) for n, r in records.items()
                                     if n in record.participants}, self.node)

    def _start_ahead(self) -> None:
        """Waiting as a spare beside a world that trains in place: start this node's workers
        now, into a set-up world of their own, so that the script's start-up (imports, the
        model, the data) is done before a place opens. They wait at the loop's first batch
        for the round that admits this node (``InPlaceWorld.enter_loop``), which then
        only offers it to them (:meth:`_start_group`). Called from the rendezvous at each
        look while a spare; only a world whose members say they train in place (an
        ``ElasticRun`` script, which waits in its set-up world) gets workers ahead: a plain
        script would train on alone in it."""
        if self._prestarted:
            self._count_ready_ahead()
            return
        if self.workers.pids() or self.channel is None or self.ours is None:
            return
        records = self.ours.node_records()
        if not joins_live_world({n: bool(r.extra.get("in_place")) for n, r in records.items()}, self.node):
            return
        self.channel.withdraw()
        for rank in range(self.spec.nproc):
            self.channel.forget(rank)
        self._prestarted = self.workers.start_all(self._launches(joining=list(range(self.spec.nproc))))
        self._joiner_pids = set(self._prestarted.values())
        modes = sorted({w.mode for w in self.workers.workers.values()})
        log.info("[%s] a spare: its workers start now (%s), so that they take a place at the next step boundary "
                 "with the script's start-up done; they wait at the loop's first batch", self.node,
                 " and ".join(modes) or "?")

    def _count_ready_ahead(self) -> None:
        """A worker started ahead is ready once it said it joins (its run is built, its loop waits)."""
        assert self.channel is not None
        ready = 0
        for rank, pid in self._prestarted.items():
            status = self.channel.status(rank)
            ready += status is not None and status.pid == pid and status.state == "joining"
        self.metrics.spare_workers_ready.set(ready)

    def _drop_prestarted(self) -> None:
        if self._prestarted:
            self._prestarted = {}
            self._stop(signal.SIGKILL, 0.0)

    def _take_prestarted(self) -> dict[int, int] | None:
        """The spare's workers started ahead, if they can take this round's place as they are."""
        prestarted, self._prestarted = self._prestarted, {}
        if not prestarted:
            return None
        self.metrics.spare_workers_ready.set(0)
        usable = (self.offer is not None and self._live_world and self.workers.pids() == prestarted
                  and all(code is None for code in self.workers.exits().values()))
        if usable:
            return prestarted
        self._stop(signal.SIGKILL, 0.0)  # one died, or this round does not train in place: start afresh
        return None

    def _start_group(self) -> None:
        self.watch.reset()
        adopted = self._take_prestarted()
        if self.channel is not None:
            if adopted is None:
                for rank in range(self.spec.nproc):
                    self.channel.forget(rank)
            if self.offer is not None:
                self.channel.offer(self.offer)  # before the workers start: they read it first
            else:
                self.channel.withdraw()
        joining = list(range(self.spec.nproc)) if self.offer is not None and self._live_world else None
        self._publish_in_place(False)  # the workers it had are gone; these hold nothing yet
        if adopted is not None:
            pids = adopted
            log.info("[%s] the workers started while a spare take the place: no start-up on the way", self.node)
        else:
            pids = self.workers.start_all(self._launches(joining))
        self._joiner_pids = set(pids.values()) if joining else set()
        self._group_started, self._refilled = time.time(), False
        self.goodput.workers_started(self._group_started)
        self._worker_group.workers = [
            Worker(local_rank=rank, global_rank=self.rank_base + rank, role_rank=self.rank_base + rank,
                   world_size=self.world_size, role_world_size=self.world_size) for rank in pids]
        for worker in self._worker_group.workers:
            worker.id = pids[worker.local_rank]
        self._worker_group.group_rank, self._worker_group.group_world_size = self.group_rank, self.group_world
        self._worker_group.state = WorkerState.HEALTHY
        self.metrics.workers_started(self._worker_group, pids)  # rank info for scripts that export none
        self.metrics.set_state("healthy")

    def _launches(self, joining: list[int] | None) -> dict[int, Launch]:
        """Every local rank's launch; ``joining``: they start into a set-up world of their own (:meth:`_env`)."""
        port = _free_port() if joining else 0
        return {rank: Launch(self._command(rank), self._env(rank, joining, port)) for rank in range(self.spec.nproc)}

    def _command(self, local_rank: int) -> tuple[str, ...]:
        return tuple(macros.substitute(list(self.spec.command), str(local_rank)))

    def _node_env(self) -> dict[str, str]:
        """What every worker of this node gets, the standbys included (they import
        prometheus_client before they know their rank, so its directory must be set)."""
        env = {**self.settings.worker_env,
               contract.NODE_NAME_ENV: self.node,
               contract.HEARTBEAT_DIR_ENV: str(self.settings.heartbeat_dir),
               MULTIPROC_ENV: str(self.settings.metrics_dir),
               AGENT_PID_ENV: str(os.getpid())}
        if self.settings.snapshot_dir is not None:
            env[contract.SNAPSHOT_DIR_ENV] = str(self.settings.snapshot_dir)
        env[TERM_GRACE_ENV] = f"{self.spec.term_grace:g}"
        if self.channel is not None:
            env[CONTROL_DIR_ENV] = str(self.settings.control_dir)
        if self.goodput.enabled:
            env[GOODPUT_DIR_ENV] = str(self.settings.goodput_dir)
        return env

    def _env(self, local_rank: int, joining: Sequence[int] | None = None, setup_port: int = 0) -> dict[str, str]:
        """torchrun's variables for one local rank, plus ours.

        ``joining``: the local ranks started together into a world that already trains in
        place. Their ``init_process_group()`` would wait for peers that called theirs long
        ago, so their start-up world is just them, with a store of their own
        (:func:`elastic.worker_env.setup_world_env`); ``ElasticRun`` joins the real world
        at the loop's first batch."""
        rank = self.rank_base + local_rank
        env = self._node_env()
        env.update({
            "RANK": str(rank), "LOCAL_RANK": str(local_rank), "GROUP_RANK": str(self.group_rank),
            "ROLE_RANK": str(rank), "ROLE_NAME": self.spec.role, "LOCAL_WORLD_SIZE": str(self.spec.nproc),
            "WORLD_SIZE": str(self.world_size), "GROUP_WORLD_SIZE": str(self.group_world),
            "ROLE_WORLD_SIZE": str(self.world_size), "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port), "TORCHELASTIC_RESTART_COUNT": str(self.restart_count),
            "TORCHELASTIC_MAX_RESTARTS": str(self.spec.max_restarts),
            "TORCHELASTIC_RUN_ID": self.spec.run_id,
            "TORCHELASTIC_USE_AGENT_STORE": str(self.handler.use_agent_store),
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
            contract.ROUND_ENV: str(self.round_number),
        })
        if self._recovering:
            env[RECOVERY_ENV] = "1"
        if joining:
            env.update(setup_world_env(local_rank, joining, setup_port))
        return env


_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


def _free_port() -> int:
    """A port for a joiners' set-up store (local rank 0 of them hosts it on loopback)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True)
class _Restarted:
    """A restart of every local worker, until its first progress says where its time went."""

    reason: str
    change: str  # " without b", " with c"...
    acted_at: float  # the agent stopped the old workers
    rendezvous_done: float
    started_at: float  # the new workers started
    start: str  # warm or cold

    def explained(self, now: float) -> str:
        return (f"training again {now - self.acted_at:.1f} s after the restart ({self.reason}{self.change}): "
                f"rendezvous and stop {self.rendezvous_done - self.acted_at:.1f} s, workers started {self.start} "
                f"{self.started_at - self.rendezvous_done:.1f} s, then {now - self.started_at:.1f} s to their first "
                "step (the script's own start: imports, process group, restore)")


def _change(before: tuple[str, ...] | list[str], after: tuple[str, ...] | list[str]) -> str:
    """`` without b`` / `` with c`` / both: how a round's members changed, for a log line."""
    gone = [n for n in before if n not in after]
    came = [n for n in after if n not in before]
    parts = ([f"without {', '.join(gone)}"] if gone else []) + ([f"with {', '.join(came)}"] if came else [])
    return f" {' and '.join(parts)}" if parts and before else ""


def _start_round_store(host: str | None) -> tuple[Any, str]:
    """A TCPStore server for the rounds this node hosts; returns it and ``host:port``.

    It serves only the brief exchange of a reconfigure (handles, gloo's addresses), under
    a fresh prefix per round, and lives exactly as long as this agent: a round whose
    store host died fails, and the next round picks another host.
    """
    import torch.distributed as dist

    server = dist.TCPStore(host_name="0.0.0.0", port=0, is_master=True, wait_for_workers=False)
    return server, f"{host or '127.0.0.1'}:{server.port}"


def _publish_keep_out(handler: EtcdV3RendezvousHandler, out: KeepOut | None) -> None:
    """Write (or, with None, clear) this node's keep-out key, as ``Reachability`` does for a
    node its peers cannot reach, and wait until the rendezvous' own mirror shows it: a
    stale key there would make the next round keep this node out again, as unreachable."""
    handler.reachability._publish(out)  # the one writer of keep-out keys (elastic/rendezvous/reachability.py)
    deadline = time.monotonic() + _KEEP_OUT_SEEN_S
    while time.monotonic() < deadline:
        entries, revision = handler.mirror.entries()
        if (handler.node in handler.reachability.keep_outs(entries)) == (out is not None):
            return
        handler.mirror.wait(revision, 0.1)


def _parenthesised(words: str) -> str:
    return f" ({words})" if words else ""


def _outcome(exc: BaseException) -> str:
    name = type(exc).__name__
    if "Timeout" in name:
        return "timeout"
    if "Closed" in name:
        return "closed"
    return "error"


def exit_code_for(exc: AgentSignal) -> int:
    return 128 + exc.signum


__all__ = ["AgentSignal", "AgentSpec", "JobFinishedError", "NodeAgent", "exit_code_for", "STANDBY_READY_TIMEOUT_S"]
