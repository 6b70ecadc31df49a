"""The act step of the node agent's loop: carry out one :class:`agent.policy.Decision`.

Contract: :meth:`Acts.carry_out` once per loop turn, with what :func:`agent.policy.decide`
returned; it returns a ``RunResult`` when the run ends (succeed, fail), else None. The
acts only act: none decides anew. An act that cannot complete (a rejoin or a replace that
gets no round its in-place workers can take, a write-off etcd refused) says so in the
agent's state and wakes the loop: the next observation carries it, and the policy decides.
"""

from __future__ import annotations

import logging
import signal
import time
from typing import TYPE_CHECKING, Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerState

from elastic.rendezvous.keepout import KeepOut, backoff, next_strikes

from .fault_cause import timeline_reason
from .goodput import fault_nodes
from .policy import Action, Decision, Reason, refunded, settled, stop_signal
from .reporting import Restarted, change
from .states import AgentState, NodeState, RoundCause

if TYPE_CHECKING:
    from .node_agent import NodeAgent

log = logging.getLogger("elastic.agent")

_STACK_DUMP_WAIT_S = 1.0


class Acts:
    def __init__(self, agent: "NodeAgent") -> None:
        self.agent = agent
        self.crash_strikes = 0  # keep-outs for a crash loop (elastic.rendezvous.keepout.backoff)
        self.back_in_at: float | None = None  # when this node last came back from such a keep-out
        self.restarted: Restarted | None = None  # the last restart, until its first progress explains it

    def carry_out(self, decision: Decision) -> RunResult | None:
        a = self.agent
        if decision.unheeded:  # a finding the policy did not act on: said once, its strikes dropped
            log.error("[%s] %s", a.node, decision.unheeded)
            a.sdc.forget()
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
        return None

    # ------------------------------------------------------------------ healthy

    def while_healthy(self) -> None:
        a = self.agent
        a.metrics.set_state(AgentState.HEALTHY)
        if a.crash_streak:
            youngest = min((w.ran_for() for w in a.workers.workers.values()), default=0.0)
            a.crash_streak = settled(a.crash_streak, youngest)
            if not a.crash_streak:
                a.rdzv.publish(crash="")  # it trains: its old failure says nothing about the script any more
        if self.restarted is not None and a.watch.progressed():
            log.info("[%s] %s", a.node, self.restarted.explained(time.time()))
            self.restarted = None
        a.while_healthy()

    # ------------------------------------------------------------------ a new group

    def restart(self, decision: Decision) -> None:
        a = self.agent
        reason = decision.reason or Reason.SCALE_UP
        acted_at = time.time()
        log.warning("[%s] %s: stopping local workers now", a.node, a.reporting.describe(decision))
        if decision.dump_stacks:
            self._dump_stacks(list(a.workers.pids()))
        sig = stop_signal(reason, a.watch.progressed())
        grace = min(a.settings.graceful_stop, 30.0)
        pids, rank_base = a.workers.pids(), a.rank_base
        if reason is Reason.LEASE_LOST:
            a.stop(sig, grace)  # first: etcd may be out of reach, and no request may delay the fence
            a.rdzv.publish(fault=f"etcd lease lost: {a.reporting.describe(decision)}"[:300])  # agent.fault_cause
        cause = timeline_reason(reason.value, [f.message for f in a.observer.seen_failures.values()])
        a.goodput.acted(cause, at=acted_at)
        a.rdzv.publish(state=NodeState.STOPPING)
        a.metrics.set_state(AgentState.STOPPED)
        if reason is not Reason.LEASE_LOST:
            a.stop(sig, grace)
        a.goodput.tick(pids, rank_base, force=True)  # what rank 0 marked before it stopped
        a.goodput.workers_stopped()
        if decision.counted:
            a.remaining_restarts -= 1
        a.restart_count += 1
        previous = a.participants
        if reason is Reason.WORKER_FAILED:
            a.rdzv.report_unreachable()  # a peer cut off from us fails our workers, its lease intact
        a.rendezvous(RoundCause.JOIN if reason in (Reason.SCALE_UP, Reason.LEASE_LOST) else RoundCause.FAILURE)
        if refunded(reason, previous, a.participants):
            reason = Reason.PEER_LOST  # our worker died because a peer did; not our failure to count
            a.remaining_restarts += 1
            a.crash_streak = a.streak_before  # nor a step of a crash loop of ours
        rendezvous_done = time.time()
        a.goodput.restarted(cause if reason is Reason.WORKER_FAILED else reason.value,
                            fault_nodes(reason.value, a.node, previous, a.participants), acted_at, rendezvous_done)
        a.recovering = reason is not Reason.LEASE_LOST  # these workers' start-up is the job's
        a.start_group()
        modes = sorted({w.mode for w in a.workers.workers.values()})
        start = "warm (pre-imported)" if modes == ["warm"] else "cold (importing torch)" if modes == ["cold"] \
            else "warm and cold"
        log.info("[%s] restart (%s)%s: world of %d nodes, workers started %s, %d restarts left", a.node,
                 reason.value, change(previous, a.participants), a.group_world, start, a.remaining_restarts)
        self.restarted = Restarted(reason.value, change(previous, a.participants), acted_at,
                                   rendezvous_done, time.time(), start)
        a.metrics.restarts.labels(reason=reason.value).inc()
        a.metrics.remaining_restarts.set(a.remaining_restarts)

    # ------------------------------------------------------------------ in place

    def rejoin(self, decision: Decision) -> None:
        """In place: the workers keep running while this node takes part in the new round."""
        a = self.agent
        if decision.reason is Reason.FROZEN and not a.freeze.write_off(a.observer.frozen):
            return  # etcd refused the write-off: nothing changed, and the next look judges again
        log.info("[%s] %s: rejoining in place (workers keep running)", a.node, a.reporting.describe(decision))
        previous, before = a.round_number, a.participants
        if decision.reason is Reason.REFORM:
            a.rdzv.report_unreachable()  # so the next round can leave out a member nobody reaches
        a.rendezvous(RoundCause.JOIN if decision.reason is Reason.SCALE_UP else RoundCause.FAILURE, offered=True)
        if a.offer is None:
            log.warning("[%s] no usable round for in-place workers", a.node)
            self._unusable(Reason.PEER_LOST)
            return
        a.channel.offer(a.offer)
        a.watch.rejoined()
        assert decision.reason is not None
        a.metrics.reforms.labels(reason=decision.reason.value).inc()
        log.info("[%s] round %d -> %d in place%s: world of %d nodes (%s), %d workers", a.node, previous,
                 a.round_number, change(before, a.participants), a.group_world, ", ".join(a.participants),
                 a.world_size)

    def replace(self, decision: Decision) -> None:
        """In place: start again only the local ranks that died or hung."""
        a = self.agent
        ranks = list(decision.ranks)
        acted_at = time.time()
        if decision.reason is not None:
            a.goodput.acted(decision.reason.value)
        log.warning("[%s] %s: starting local rank(s) %s again; the others keep running", a.node,
                    a.reporting.describe(decision), ranks)
        if decision.dump_stacks:
            self._dump_stacks(ranks)
        pids = [pid for rank, pid in a.workers.pids().items() if rank in ranks]
        before = a.workers.pids()
        a.workers.stop(signal.SIGKILL, ranks=ranks)
        a.goodput.tick(before, a.rank_base, force=True)  # what rank 0 marked before it died
        a.workers.forget(ranks)
        a.metrics.forget_pids(pids)
        for rank in ranks:
            a.channel.forget(rank)
            a.watch.forget(rank)
        a.goodput.workers_stopped(ranks)
        if decision.counted:
            a.remaining_restarts -= 1
        a.rendezvous(RoundCause.FAILURE, offered=True)
        if a.offer is None:
            self._unusable(decision.reason or Reason.WORKER_FAILED)
            return
        a.channel.offer(a.offer)
        if decision.reason is not None:
            a.goodput.restarted(decision.reason.value, (a.node,), acted_at, time.time())
        if 0 in ranks:
            a.goodput.workers_started(time.time())
        a.recovering = True
        started = a.start_again(ranks)
        assert decision.reason is not None
        a.metrics.restarts.labels(reason=decision.reason.value).inc()
        a.metrics.remaining_restarts.set(a.remaining_restarts)
        modes = sorted({a.workers.workers[rank].mode for rank in started if rank in a.workers.workers})
        log.info("[%s] round %d: local rank(s) %s started again (%s), %d restarts left", a.node,
                 a.round_number, ranks, " and ".join(modes) or "?", a.remaining_restarts)

    def _unusable(self, reason: Reason) -> None:
        """The round came without an offer: the next look carries it to the policy (agent.policy, 1b)."""
        self.agent.unusable_round = reason
        self.agent.wake()

    # ------------------------------------------------------------------ out for a while

    def keep_out(self, decision: Decision) -> None:
        """A crash loop, a straggler or suspect hardware (:mod:`agent.policy`): stop this
        node's workers and stay out of the job's rounds for the back-off an unreachable node
        gets, so the other nodes stop standing still for it and train on; then join again,
        as a newcomer would.

        The keep-out key goes to etcd first: every closer of the next round leaves out a
        node that holds one (``Reachability.excluded``), so the others' round, which may
        already be open, closes without this node instead of waiting for it."""
        a = self.agent
        back_for = None if self.back_in_at is None else time.monotonic() - self.back_in_at
        self.crash_strikes = next_strikes(self.crash_strikes, back_for)
        out = KeepOut(a.node, self.crash_strikes, backoff(self.crash_strikes), cause=decision.detail,
                      round=a.round_number)
        log.error("[%s] kept out of the job for %.0f s (strike %d), so that the other nodes train on without it: %s",
                  a.node, out.backoff, out.strikes, decision.detail)
        if decision.reason not in (Reason.STRAGGLER, Reason.SDC, Reason.HEALTH):
            a.metrics.crash_loops.inc()
        a.sdc.forget()
        a.pace.forget()
        a.rdzv.keep_out(out)
        a.goodput.acted(Reason.HEALTH.value if decision.reason is Reason.HEALTH else Reason.WORKER_FAILED.value)
        pids = a.workers.pids()
        a.stop(signal.SIGKILL, 0.0)
        a.goodput.tick(pids, a.rank_base, force=True)
        a.goodput.workers_stopped()
        a.channel.withdraw()
        a.metrics.set_state(AgentState.STOPPED)
        self.restarted = None
        a.pool.fill()  # the standbys import while this node waits: its return starts warm
        deadline = time.monotonic() + out.backoff
        while time.monotonic() < deadline and not a.rdzv.is_closed():
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
        a.rdzv.keep_out(None)
        self.back_in_at = time.monotonic()
        if time.monotonic() >= deadline:  # else the job ended meanwhile, and the rendezvous says so
            again = ("it is still a straggler" if decision.reason is Reason.STRAGGLER
                     else "replica votes name it the outlier twice again" if decision.reason is Reason.SDC
                     else "a health check still fails" if decision.reason is Reason.HEALTH
                     else "its workers fail right after their start once more")
            log.info("[%s] back after %.0f s kept out; joining the job again (kept out again, for longer, if %s)",
                     a.node, out.backoff, again)
        a.restart_count += 1  # a new group: its own attempt directory for logs and error files
        a.rendezvous(RoundCause.JOIN)
        a.recovering = False
        a.start_group()

    # ------------------------------------------------------------------ the end

    def succeed(self) -> RunResult:
        a = self.agent
        log.info("[%s] local workers finished", a.node)
        a.goodput.tick(a.workers.pids(), a.rank_base, force=True)  # rank 0's last steps
        a.rdzv.publish(state=NodeState.SUCCEEDED)
        # Stay in the registry until every peer has finished too, so that this node leaving
        # early is not mistaken for a peer lost (which would restart the others).
        a.rdzv.exit_barrier(a.round, a.settings.exit_barrier_timeout)
        a.metrics.set_state(AgentState.SUCCEEDED)
        return RunResult(state=WorkerState.SUCCEEDED, return_values={r: None for r in a.workers.pids()})

    def fail(self, decision: Decision) -> RunResult:
        a = self.agent
        if decision.reason is Reason.ETCD_LOST:  # the fix is the line: no traceback to point at
            a.failure_line = decision.detail
            log.error("[%s] the job fails: %s", a.node, decision.detail)
        elif decision.reason in (Reason.CRASH_LOOP, Reason.SCRIPT_ERROR):  # one line that ends with the cause
            if decision.reason is Reason.CRASH_LOOP:
                a.metrics.crash_loops.inc()
            a.failure_line = f"{decision.detail}; the traceback: {a.reporting.traceback_where(decision.failed)}"
            log.error("[%s] the job fails: %s", a.node, a.failure_line)
        elif decision.final_snapshot_lost:  # the worker's line says it all; no torchrun box after it
            a.failure_line = decision.detail
            log.error("[%s] %s: the job fails", a.node, decision.detail)
        else:
            log.error("[%s] %s: the job fails", a.node, a.reporting.describe(decision))
        if decision.dump_stacks:
            self._dump_stacks(list(a.workers.pids()))
        failed_alone = a.workers.failures()  # before the stop adds its own victims
        if decision.usage_error or decision.final_snapshot_lost:  # the ranks that broke with it are not the story
            failed_alone = {rank: f for rank, f in failed_alone.items() if rank in decision.failed}
        pids = a.workers.pids()
        stopped = a.stop(signal.SIGTERM, a.settings.graceful_stop)
        a.goodput.tick(pids, a.rank_base, force=True)
        failures: Any = failed_alone or stopped
        a.rdzv.publish(state=NodeState.FAILED)
        a.metrics.set_state(AgentState.FAILED)
        return RunResult(state=WorkerState.FAILED, failures=failures)

    def _dump_stacks(self, ranks: list[int]) -> None:
        """faulthandler in every agent worker dumps all threads' stacks on SIGUSR1."""
        self.agent.workers.send(signal.SIGUSR1, ranks)
        time.sleep(_STACK_DUMP_WAIT_S)  # let faulthandler's writes land before the kill


__all__ = ["Acts"]
