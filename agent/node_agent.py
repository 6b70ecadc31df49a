"""torch's ``LocalElasticAgent`` with the node-level judgement torchrun lacks.

torch's monitor loop only notices trouble when a local worker exits. This agent also
stops its workers at once when

* a peer of the current round loses its etcd lease (killed, frozen, cut off): survivors
  would otherwise sit in a collective until its timeout;
* this node's own lease was lost (it was frozen): its workers belong to a world that
  has moved on and must die before they do anything, snapshots included;
* no local rank finished a step for the hang timeout: stacks go to the log, workers restart;
* another node opened a new round (a node joined or came back).

Every restart gets a reason. Worker failures and hangs count against ``--max-restarts``
as in torchrun; membership changes do not, and a worker failure that turns out to have
been caused by a peer's death (the peer is missing from the next round) is refunded,
so a long job does not run out of restarts because other machines died.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from elastic.rendezvous.handler import LEASE_LOST, NEW_ROUND, PEER_LOST, EtcdV3RendezvousHandler

from .commands import CommandWatch
from .metrics import AgentMetrics
from .settings import AgentSettings
from .warm_start import WarmPool, warm_handlers
from .watchdog import HangWatch

log = logging.getLogger("elastic.agent")

WORKER_FAILED, HANG, USER_ERROR_EXIT = "worker_failed", "hang", 2
_ABRUPT = {PEER_LOST, LEASE_LOST, HANG, WORKER_FAILED}  # the world is broken: no graceful stop
_STACK_DUMP_WAIT_S = 1.0
STANDBY_READY_TIMEOUT_S = 120.0


class NodeAgent(LocalElasticAgent):
    """Built by torch's ``launch_agent`` in place of ``LocalElasticAgent`` (see :mod:`.launch`)."""

    def __init__(self, *args: Any, settings: AgentSettings, metrics: AgentMetrics, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.settings, self.metrics = settings, metrics
        self.watch = HangWatch(settings.heartbeat_dir, settings.hang_timeout)
        self._reason: str | None = None
        self._previous_members: tuple[str, ...] = ()
        handler = self._worker_group.spec.rdzv_handler
        self.handler = handler if isinstance(handler, EtcdV3RendezvousHandler) else None
        self.commands = CommandWatch(self.handler, settings.node_name) if self.handler else None
        if self.handler is not None:
            self.handler.lease.update(metrics_url=metrics.url)
            self.handler.client.error_listeners.append(lambda kind: metrics.etcd_errors.labels(op=kind).inc())
        metrics.remaining_restarts.set(self._remaining_restarts)
        self.pool: WarmPool | None = None
        if settings.warm_start:
            self.pool = WarmPool(self._worker_group.spec.local_world_size,
                                 on_start=lambda mode: metrics.worker_starts.labels(mode=mode).inc())
            self.pool.fill()  # the standbys import torch while the first rendezvous runs

    def _await_standbys(self) -> None:
        """Join the job only once this node can start its workers without importing torch.

        A node joining a running job opens a new round, which stops every other node's
        workers; they would then idle while this node's workers imported torch.
        """
        deadline = time.monotonic() + STANDBY_READY_TIMEOUT_S
        while self.pool is not None and self.pool.ready_count() < self.pool.size:
            if time.monotonic() > deadline:
                log.warning("[%s] standby workers not ready after %.0f s; joining anyway (cold start)",
                            self.settings.node_name, STANDBY_READY_TIMEOUT_S)
                return
            time.sleep(0.05)

    def run(self, role: str = "default") -> RunResult:
        try:
            self._await_standbys()  # before the first rendezvous; restarts take what is ready
            return super().run(role)
        finally:
            if self.pool is not None:
                self.pool.close()

    # ------------------------------------------------------------------ monitoring

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        if self.commands is not None:
            self.commands.poll()  # `elastic kill` of this node from another machine
        result = super()._monitor_workers(worker_group)
        membership = self.handler.restart_reason() if self.handler is not None else None
        if membership in (PEER_LOST, LEASE_LOST) and result.state != WorkerState.SUCCEEDED:
            # torch restarts without counting when HEALTHY and num_nodes_waiting() > 0
            self._set_reason(membership)
            return RunResult(state=WorkerState.HEALTHY)
        if result.state == WorkerState.FAILED:
            self._reason = WORKER_FAILED
            if _user_error(result.failures):
                log.error("[%s] a worker exited with code 2 (a usage error): not restarting",
                          self.settings.node_name)
                self._remaining_restarts = 0
        elif result.state == WorkerState.HEALTHY:
            if membership == NEW_ROUND:
                self._set_reason(NEW_ROUND)
            else:
                stalled = self.watch.stalled()
                if stalled is not None:
                    self._on_hang(worker_group, stalled)
                    return RunResult(state=WorkerState.UNHEALTHY)
                if self.pool is not None:
                    if not self.pool.full and self.watch.progressed():
                        self.pool.fill()  # after the group's first step: never competes with a recovery
                    self.metrics.standbys_ready.set(self.pool.ready_count())
        self.metrics.set_state(result.state.name.lower())
        return result

    def _set_reason(self, reason: str) -> None:
        if self._reason != reason:
            log.warning("[%s] %s: stopping local workers now", self.settings.node_name, _describe(reason))
        self._reason = reason

    def _on_hang(self, worker_group: WorkerGroup, stalled_for: float) -> None:
        self._reason = HANG
        log.error("[%s] no rank on this node finished a step for %.0f s (hang timeout %s); "
                  "dumping worker stacks, then restarting", self.settings.node_name, stalled_for,
                  self.watch.describe_timeout())
        for worker in worker_group.workers:
            if worker.id is not None:
                try:
                    os.kill(int(worker.id), signal.SIGUSR1)  # faulthandler in ElasticRun dumps stacks
                except (ProcessLookupError, ValueError):
                    pass
        time.sleep(_STACK_DUMP_WAIT_S)  # let faulthandler's writes land before the kill

    # ------------------------------------------------------------------ restarts

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        if self.handler is not None:
            self.handler.lease.update(state="stopping")
        self.metrics.set_state("stopped")
        if self._reason in _ABRUPT or not self.watch.progressed():
            # broken world, or a group that has not finished a step: nothing to flush, and
            # a worker blocked in process-group set-up would not run a SIGTERM handler
            self._shutdown(signal.SIGKILL, timeout=5)
        else:
            # lets rank 0 flush a snapshot; a rank stuck in a collective with one that
            # already stopped gets SIGKILL after the grace period
            self._shutdown(signal.SIGTERM, timeout=min(self._shutdown_timeout, self.settings.graceful_stop))
        self.metrics.forget_workers(worker_group)

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        reason = self._reason or NEW_ROUND
        self._reason = reason
        previous = self._previous_members
        super()._restart_workers(worker_group)
        current = self._previous_members
        if reason == WORKER_FAILED and previous and not set(previous) <= set(current):
            reason = PEER_LOST  # our worker died because a peer did; not our failure to count
            self._remaining_restarts += 1
        log.info("[%s] restart (%s): world of %d nodes, %d restarts left", self.settings.node_name,
                 reason, worker_group.group_world_size, self._remaining_restarts)
        self.metrics.restarts.labels(reason=reason).inc()
        self.metrics.remaining_restarts.set(self._remaining_restarts)
        self._reason = None

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        started = time.monotonic()
        try:
            super()._rendezvous(worker_group)
        except Exception as exc:
            self.metrics.rendezvous.labels(outcome=_outcome(exc)).observe(time.monotonic() - started)
            raise
        self.metrics.rendezvous.labels(outcome="ok").observe(time.monotonic() - started)
        if self.handler is not None and self.handler.round is not None:
            self._previous_members = self.handler.round.participants
            self.metrics.round.set(self.handler.round.round)
        self.metrics.nodes_in_round.set(worker_group.group_world_size)

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        self.watch.reset()
        if self.handler is not None and self.handler.round is not None:
            os.environ["ELASTIC_ROUND"] = str(self.handler.round.round)  # inherited by the workers
        if self.pool is not None:
            with warm_handlers(self.pool):
                started = super()._start_workers(worker_group)
        else:
            started = super()._start_workers(worker_group)
        self.metrics.set_state("healthy")
        return started


def _user_error(failures: dict[int, ProcessFailure]) -> bool:
    return bool(failures) and all(f.exitcode == USER_ERROR_EXIT for f in failures.values())


def _outcome(exc: BaseException) -> str:
    name = type(exc).__name__
    if "Timeout" in name:
        return "timeout"
    if "Closed" in name:
        return "closed"
    return "error"


def _describe(reason: str) -> str:
    return {
        PEER_LOST: "a peer of this round lost its etcd lease (dead, frozen or cut off)",
        LEASE_LOST: "this node lost its own etcd lease (it was frozen or cut off); its workers are stale",
        NEW_ROUND: "another node opened a new round (a node joined or came back)",
    }.get(reason, reason)
