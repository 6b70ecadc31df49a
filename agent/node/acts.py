"""The act step of the node agent's loop: carry out one :class:`agent.node.policy.Decision`.

Contract: :meth:`Acts.carry_out` once per loop turn, with what :func:`agent.node.policy.decide`
returned; it returns a ``RunResult`` when the run ends (succeed, fail), else None. The
acts only act: none decides anew. An act that cannot complete (a rejoin or a replace that
gets no round its in-place workers can take, a write-off etcd refused) says so in the
run's state (:class:`agent.node.node_run.NodeRun`) and wakes the loop: the next observation
carries it, and the policy decides.
"""

from __future__ import annotations

import logging
import signal
import time
from typing import Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
from torch.distributed.elastic.rendezvous import RendezvousClosedError

from agent.node.channel import AgentChannel

from agent.node.events import GaveUp, KeptOut, Restarted as RestartedEvent
from agent.node.fork_server import ForkServer
from agent.node.fault_cause import timeline_reason
from agent.node.goodput import GoodputAccountant, NoGoodput, fault_nodes
from agent.node.keep_outs import KeepOuts
from agent.node.metrics import AgentMetrics
from agent.node.node_run import Group, NodeRun
from agent.node.nulls import NoChannel, NoPool
from agent.node.observer import Observer
from agent.node.policy import Action, Decision, Reason, Streak, after_round, formed_afresh, settled, stop_signal
from agent.node.rendezvous_api import AgentRendezvous
from agent.node.reporting import Reporting, Restarted, change
from agent.node.sdc import SdcWatch
from agent.node.settings import AgentSettings
from agent.node.states import AgentState, NodeState, RoundCause
from agent.node.watchdog import HangWatch
from agent.node.workers import LocalWorkers

log = logging.getLogger("elastic.agent")

_STACK_DUMP_WAIT_S = 1.0


class Acts:
    def __init__(self, run: NodeRun, group: Group, *, node: str, settings: AgentSettings, metrics: AgentMetrics,
                 workers: LocalWorkers, watch: HangWatch, rdzv: AgentRendezvous, goodput: GoodputAccountant | NoGoodput,
                 sdc: SdcWatch, pace: Any, freeze: Any, channel: AgentChannel | NoChannel,
                 pool: ForkServer | NoPool, observer: Observer, reporting: Reporting, keep_outs: KeepOuts) -> None:
        self.keep_outs = keep_outs  # the one strike counter of every keep-out (agent.node.keep_outs)
        self.run, self.group, self.node, self.settings, self.metrics = run, group, node, settings, metrics
        self.workers, self.watch, self.rdzv, self.goodput = workers, watch, rdzv, goodput
        self.sdc, self.pace, self.freeze, self.channel, self.pool = sdc, pace, freeze, channel, pool
        self.observer, self.reporting = observer, reporting
        self.restarted: Restarted | None = None  # the last restart, until its first progress explains it

    def carry_out(self, decision: Decision) -> RunResult | None:
        if decision.unheeded:  # a finding the policy did not act on: said once, its strikes dropped
            log.error("[%s] %s", self.node, decision.unheeded)
            self.sdc.forget()
        if decision.action is Action.CONTINUE:
            self.while_healthy()
        elif decision.action is Action.SUCCEED:
            return self.succeed()
        elif decision.action is Action.FAIL:
            return self.fail(decision)
        elif decision.action is Action.RESTART:
            self.restart(decision)
        elif decision.action is Action.REJOIN:
            self.rejoin(decision)
        elif decision.action is Action.REPLACE:
            self.replace(decision)
        elif decision.action is Action.KEEP_OUT:
            self.keep_out(decision)
        elif decision.action is Action.END:
            self.end(decision)
        return None

    # ------------------------------------------------------------------ healthy

    def while_healthy(self) -> None:
        run = self.run
        self.metrics.set_state(AgentState.HEALTHY)
        if run.crash_streak:
            youngest = min((w.ran_for() for w in self.workers.workers.values()), default=0.0)
            run.streak = Streak(settled(run.crash_streak, youngest), run.streak.before)
            if not run.crash_streak:
                self.rdzv.publish(crash="")  # it trains: its old failure says nothing about the script any more
        if self.restarted is not None and self.watch.progressed():
            log.info("[%s] %s", self.node, self.restarted.explained(time.time()))
            self.restarted = None
        self.group.while_healthy()

    # ------------------------------------------------------------------ a new group

    def restart(self, decision: Decision, joined_from: tuple[str, ...] | None = None) -> None:
        """Stop the local workers, take part in the next round, start them anew in it.
        ``joined_from``: this node already took part in the round (an in-place rejoin that
        found it forming afresh), whose members before it were these."""
        run = self.run
        reason = decision.reason or Reason.SCALE_UP
        acted_at = time.time()
        why = ""
        if joined_from is None:
            why = self.reporting.describe(decision)
            log.warning("[%s] %s: stopping local workers now", self.node, why)
            self.reporting.acting_on(decision)
        if decision.dump_stacks:
            self._dump_stacks(list(self.workers.pids()))
        sig = stop_signal(reason, self.watch.progressed())
        grace = min(self.settings.graceful_stop, 30.0)
        pids, rank_base = self.workers.pids(), run.round.rank_base
        if reason is Reason.LEASE_LOST:
            self.group.stop(sig, grace)  # first: etcd may be out of reach, and no request may delay the fence
            self.rdzv.publish(fault=f"etcd lease lost: {self.reporting.describe(decision)}"[:300])  # agent.node.fault_cause
        cause = timeline_reason(reason.value, [f.cause for f in self.observer.seen_failures.values()])
        self.goodput.acted(cause, at=acted_at)
        if joined_from is None:  # else the round it takes part in has closed: it is "running" in it
            self.rdzv.publish(state=NodeState.STOPPING)
        self.metrics.set_state(AgentState.STOPPED)
        if reason is not Reason.LEASE_LOST:
            self.group.stop(sig, grace)
        self.goodput.tick(pids, rank_base, force=True)  # what rank 0 marked before it stopped
        self.goodput.workers_stopped()
        if decision.counted:
            run.remaining_restarts -= 1
        run.restart_count += 1
        previous = run.round.participants if joined_from is None else joined_from
        if reason is Reason.WORKER_FAILED:
            self.rdzv.report_unreachable()  # a peer cut off from us fails our workers, its lease intact
        if joined_from is None:
            self.group.rendezvous(RoundCause.JOIN if reason in (Reason.SCALE_UP, Reason.LEASE_LOST)
                                  else RoundCause.FAILURE)
        after = after_round(reason, previous, run.round.participants, run.streak)
        reason = after.reason  # our worker died because a peer did: not our failure to count...
        run.remaining_restarts += int(after.refund)
        if after.streak is not None:
            run.streak = after.streak  # ... nor a step of a crash loop of ours
        rendezvous_done = time.time()
        self.goodput.restarted(cause if reason is Reason.WORKER_FAILED else reason.value,
                               fault_nodes(reason.value, self.node, previous, run.round.participants), acted_at,
                               rendezvous_done)
        run.recovering = reason is not Reason.LEASE_LOST  # these workers' start-up is the job's
        self.group.start_group()
        modes = sorted({w.mode for w in self.workers.workers.values()})
        start = "warm (pre-imported)" if modes == ["warm"] else "cold (importing torch)" if modes == ["cold"] \
            else "warm and cold"
        log.info("[%s] restart (%s)%s: world of %d nodes, workers started %s, %d restarts left", self.node,
                 reason.value, change(previous, run.round.participants), run.round.group_world, start,
                 run.remaining_restarts)
        self.reporting.emit(RestartedEvent(reason.value, why))
        self.restarted = Restarted(reason.value, change(previous, run.round.participants), acted_at,
                                   rendezvous_done, time.time(), start)
        self.metrics.restarts.labels(reason=reason.value).inc()
        self.metrics.remaining_restarts.set(run.remaining_restarts)

    # ------------------------------------------------------------------ in place

    def rejoin(self, decision: Decision) -> None:
        """In place: the workers keep running while this node takes part in the new round."""
        run = self.run
        if decision.reason is Reason.FROZEN and not self.freeze.write_off(self.observer.frozen):
            return  # etcd refused the write-off: nothing changed, and the next look judges again
        log.info("[%s] %s: rejoining in place (workers keep running)", self.node, self.reporting.describe(decision))
        previous, before = run.round.number, run.round.participants
        if decision.reason is Reason.REFORM:
            self.rdzv.report_unreachable()  # so the next round can leave out a member nobody reaches
        self.group.rendezvous(RoundCause.JOIN if decision.reason is Reason.SCALE_UP else RoundCause.FAILURE,
                              offered=True)
        if self._formed_afresh(decision, before):
            return
        if run.round.offer is None:
            log.warning("[%s] no usable round for in-place workers", self.node)
            self._unusable(Reason.PEER_LOST)
            return
        self.channel.offer(run.round.offer)
        self.watch.rejoined()
        assert decision.reason is not None
        self.metrics.reforms.labels(reason=decision.reason.value).inc()
        log.info("[%s] round %d -> %d in place%s: world of %d nodes (%s), %d workers", self.node, previous,
                 run.round.number, change(before, run.round.participants), run.round.group_world,
                 ", ".join(run.round.participants), run.round.world_size)

    def replace(self, decision: Decision) -> None:
        """In place: start again only the local ranks that died or hung."""
        run = self.run
        ranks = list(decision.ranks)
        acted_at = time.time()
        if decision.reason is not None:
            self.goodput.acted(decision.reason.value)
        log.warning("[%s] %s: starting local rank(s) %s again; the others keep running", self.node,
                    self.reporting.describe(decision), ranks)
        self.reporting.acting_on(decision, in_place=True)
        if decision.dump_stacks:
            self._dump_stacks(ranks)
        pids = [pid for rank, pid in self.workers.pids().items() if rank in ranks]
        before = self.workers.pids()
        self.workers.stop(signal.SIGKILL, ranks=ranks)
        self.goodput.tick(before, run.round.rank_base, force=True)  # what rank 0 marked before it died
        self.workers.forget(ranks)
        self.metrics.forget_pids(pids)
        for rank in ranks:
            self.channel.forget(rank)
            self.watch.forget(rank)
        self.goodput.workers_stopped(ranks)
        if decision.counted:
            run.remaining_restarts -= 1
        before_round = run.round.participants
        self.group.rendezvous(RoundCause.FAILURE, offered=True)
        if self._formed_afresh(decision, before_round):
            return
        if run.round.offer is None:
            self._unusable(decision.reason or Reason.WORKER_FAILED)
            return
        self.channel.offer(run.round.offer)
        if decision.reason is not None:
            self.goodput.restarted(decision.reason.value, (self.node,), acted_at, time.time())
        if 0 in ranks:
            self.goodput.workers_started(time.time())
        run.recovering = True
        started = self.group.start_again(ranks)
        assert decision.reason is not None
        self.metrics.restarts.labels(reason=decision.reason.value).inc()
        self.metrics.remaining_restarts.set(run.remaining_restarts)
        modes = sorted({self.workers.workers[rank].mode for rank in started if rank in self.workers.workers})
        log.info("[%s] round %d: local rank(s) %s started again (%s), %d restarts left", self.node,
                 run.round.number, ranks, " and ".join(modes) or "?", run.remaining_restarts)

    def _formed_afresh(self, decision: Decision, before: tuple[str, ...]) -> bool:
        """After an in-place rejoin or replace: carry out :func:`agent.node.policy.formed_afresh`'s
        restart, if the round formed afresh (True)."""
        restart = formed_afresh(decision.reason, self.run.round.fresh_world)
        if restart is None:
            return False
        log.info("[%s] round %d formed afresh (no member's workers ran in place when it closed): starting local "
                 "workers anew in it", self.node, self.run.round.number)
        self.restart(restart, joined_from=before)
        return True

    def _unusable(self, reason: Reason) -> None:
        """The round came without an offer: the next look carries it to the policy (agent.node.policy, 1b)."""
        self.run.unusable_round = reason
        self.group.wake()

    # ------------------------------------------------------------------ out for a while

    def keep_out(self, decision: Decision) -> None:
        """A crash loop, a straggler or suspect hardware (:mod:`agent.node.policy`): stop this
        node's workers and stay out of the job's rounds for the back-off an unreachable node
        gets, so the other nodes stop standing still for it and train on; then join again,
        as a newcomer would.

        The keep-out key goes to etcd first: every closer of the next round leaves out a
        node that holds one (``Reachability.excluded``), so the others' round, which may
        already be open, closes without this node instead of waiting for it."""
        run = self.run
        out = self.keep_outs.strike(decision.detail, run.round.number)
        log.error("[%s] kept out of the job for %.0f s (strike %d), so that the other nodes train on without it: %s",
                  self.node, out.backoff, out.strikes, decision.detail)
        self.reporting.emit(KeptOut(decision.reason.value if decision.reason else "", decision.detail, out.backoff,
                                    out.strikes))
        if decision.reason is Reason.STRAGGLER:
            self.metrics.straggler_evictions.inc()
        elif decision.reason not in (Reason.SDC, Reason.HEALTH):
            self.metrics.crash_loops.inc()
        self.sdc.forget()
        self.pace.forget()
        self.rdzv.keep_out(out)
        self.goodput.acted(Reason.HEALTH.value if decision.reason is Reason.HEALTH else Reason.WORKER_FAILED.value)
        pids = self.workers.pids()
        self.group.stop(signal.SIGKILL, 0.0)
        self.goodput.tick(pids, run.round.rank_base, force=True)
        self.goodput.workers_stopped()
        self.channel.withdraw()
        self.metrics.set_state(AgentState.STOPPED)
        self.restarted = None
        self.pool.fill()  # the standbys import while this node waits: its return starts warm
        back = self.keep_outs.stay_out(out)
        self.rdzv.keep_out(None)
        if back:  # else the job ended meanwhile, and the rendezvous says so
            again = ("it is still a straggler" if decision.reason is Reason.STRAGGLER
                     else "replica votes name it the outlier twice again" if decision.reason is Reason.SDC
                     else "a health check still fails" if decision.reason is Reason.HEALTH
                     else "its workers fail right after their start once more")
            log.info("[%s] back after %.0f s kept out; joining the job again (kept out again, for longer, if %s)",
                     self.node, out.backoff, again)
        run.restart_count += 1  # a new group: its own attempt directory for logs and error files
        self.group.rendezvous(RoundCause.JOIN)
        run.recovering = False
        self.group.start_group()

    # ------------------------------------------------------------------ the end

    def succeed(self) -> RunResult:
        run = self.run
        log.info("[%s] local workers finished", self.node)
        self.goodput.tick(self.workers.pids(), run.round.rank_base, force=True)  # rank 0's last steps
        self.rdzv.publish(state=NodeState.SUCCEEDED)
        self.rdzv.announce_finished()  # before the barrier: a node joining a round with this one stops now
        # Stay in the registry until every peer has finished too, so that this node leaving
        # early is not mistaken for a peer lost (which would restart the others).
        self.rdzv.exit_barrier(run.round, self.settings.exit_barrier_timeout)
        self.metrics.set_state(AgentState.SUCCEEDED)
        return RunResult(state=WorkerState.SUCCEEDED, return_values={r: None for r in self.workers.pids()})

    def end(self, decision: Decision) -> None:
        """Another node ended the job: stop the workers (SIGTERM: a rank 0 that trains flushes its
        snapshot) and leave as the job did, through the agent's closed-rendezvous exit (its line,
        and 0 only if the job trained its last step)."""
        log.info("[%s] %s: stopping this node's workers", self.node, decision.detail)
        pids = self.workers.pids()
        self.group.stop(signal.SIGTERM, self.settings.graceful_stop)
        self.goodput.tick(pids, self.run.round.rank_base, force=True)
        raise RendezvousClosedError(decision.detail)

    def fail(self, decision: Decision) -> RunResult:
        run = self.run
        if decision.reason is Reason.ETCD_LOST:  # the fix is the line: no traceback to point at
            run.failure_line = why = decision.detail
            log.error("[%s] the job fails: %s", self.node, decision.detail)
        elif decision.reason in (Reason.CRASH_LOOP, Reason.SCRIPT_ERROR):  # one line that ends with the cause
            if decision.reason is Reason.CRASH_LOOP:
                self.metrics.crash_loops.inc()
            run.failure_line = why = \
                f"{decision.detail}; the traceback: {self.reporting.traceback_where(decision.failed)}"
            log.error("[%s] the job fails: %s", self.node, run.failure_line)
        elif decision.final_snapshot_lost:  # the worker's line says it all; no torchrun box after it
            run.failure_line = why = decision.detail
            log.error("[%s] %s: the job fails", self.node, decision.detail)
        else:
            why = self.reporting.describe(decision)
            log.error("[%s] %s: the job fails", self.node, why)
        failed = sorted(decision.failed.items())
        self.reporting.emit(GaveUp(decision.reason.value if decision.reason else "", why,
                                   tuple(r for r, _ in failed), tuple(c for _, c in failed)))
        if decision.dump_stacks:
            self._dump_stacks(list(self.workers.pids()))
        failed_alone = self.workers.failures()  # before the stop adds its own victims
        if decision.usage_error or decision.final_snapshot_lost:  # the ranks that broke with it are not the story
            failed_alone = {rank: f for rank, f in failed_alone.items() if rank in decision.failed}
        pids = self.workers.pids()
        stopped = self.group.stop(signal.SIGTERM, self.settings.graceful_stop)
        self.goodput.tick(pids, run.round.rank_base, force=True)
        failures: Any = failed_alone or stopped
        self.rdzv.publish(state=NodeState.FAILED)
        self.metrics.set_state(AgentState.FAILED)
        return RunResult(state=WorkerState.FAILED, failures=failures)

    def _dump_stacks(self, ranks: list[int]) -> None:
        """faulthandler in every agent worker dumps all threads' stacks on SIGUSR1."""
        self.workers.send(signal.SIGUSR1, ranks)
        time.sleep(_STACK_DUMP_WAIT_S)  # let faulthandler's writes land before the kill


__all__ = ["Acts"]
