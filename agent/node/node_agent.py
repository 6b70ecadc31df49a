"""The node agent: one loop that observes its node, decides (:mod:`agent.node.policy`) and acts.

torch's ``LocalElasticAgent`` only notices trouble when a local worker exits, and it can
only restart every worker at once. This agent owns its loop instead, built on torch's
public pieces: it is an ``ElasticAgent``, it rendezvous through any ``RendezvousHandler``
(torchrun's ``--rdzv-backend``), and it starts workers through :mod:`agent.node.workers`
(``LogsSpecs``, ``SubprocessHandler``, ``TailLog``), warm from a standby where it can.

The call order, every ``--monitor-interval`` or sooner (etcd news, a worker's request and
signals wake it at once):

1. **observe** (:class:`agent.node.observer.Observer`): worker exits, the rendezvous' verdict on
   membership (with ``etcd-v3``: a peer's lease gone, our own lease gone, a new round), the
   hang watchdog, in-place workers' statuses, the straggler, SDC and freeze watches;
2. **decide**: :func:`agent.node.policy.decide`, a pure function, makes every decision;
3. **act** (:class:`agent.node.acts.Acts`): continue; succeed (after an exit barrier); fail;
   restart the group; keep out; or, for in-place workers, rejoin (rendezvous and hand the
   round to the running workers) or replace (start again only the local ranks that died or
   hung). An act that cannot complete leaves its outcome to the next observation.

The agent reaches its rendezvous only through :class:`agent.node.rendezvous_api.AgentRendezvous`
(etcd-v3's lives in :mod:`agent.rendezvous.agent_side`, which hands back the one for any torch
handler); its absent parts are null objects (:mod:`agent.node.nulls`).

In-place recovery needs the ``etcd-v3`` backend: the agent hosts a small TCPStore for the
rounds in which its node comes first, and advertises it, with its worker count, in the
node registry; its workers learn each round through :mod:`elastic.inplace.channel`.
"""

from __future__ import annotations

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
from agent.node.channel import AgentChannel
from agent.rendezvous.keepout import KeepOut
from elastic.worker_env import NodeEnv, Place, RankEnv

from agent.node.acts import Acts
from agent.node.fork_server import ForkServer, discard_early
from agent.node.metrics import AgentMetrics
from agent.node.node_run import NodeRun
from agent.node.nulls import NoChannel, NoPool
from agent.node.observer import Observer
from agent.node.policy import decide, streak_acted_on
from agent.node.preemption import terminate
from agent.node.rendezvous_api import JobFinishedError, Round
from agent.rendezvous.agent_side import agent_rendezvous
from agent.node.reporting import Reporting
from agent.node.health_watch import HealthWatch
from agent.node.events import EVENTS_FILE, EventLog
from agent.node.keep_outs import KeepOuts
from agent.node.sdc import SdcWatch
from agent.node.settings import AgentSettings
from agent.node.spare_ahead import SpareAhead
from agent.node.states import DEFAULT_TERM_GRACE_S, AgentState, RoundCause
from agent.node.watchdog import HangWatch
from agent.node.workers import Launch, LocalWorkers

log = logging.getLogger("elastic.agent")

STANDBY_READY_TIMEOUT_S = 120.0
_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


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


class AgentSignal(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(f"agent got signal {signal.Signals(signum).name}")
        self.signum = signum


class NodeAgent(ElasticAgent):
    """torch's ``ElasticAgent`` contract (:meth:`run`, :meth:`get_worker_group`) over the
    observe-decide-act loop. It owns the node's state (:class:`NodeRun`: the round, the restart
    budget, the crash streak) and its parts, and hands each collaborator the state and only the
    parts it uses (never itself, but as the :class:`agent.node.node_run.Group` it drives); each step
    is a collaborator's: :class:`Observer`,
    :func:`decide`, :class:`Acts`, with :class:`Reporting` for what it says and
    :class:`SpareAhead` for a spare's workers started ahead."""

    def __init__(self, spec: AgentSpec, handler: RendezvousHandler, settings: AgentSettings,
                 metrics: AgentMetrics, logs_specs: LogsSpecs) -> None:
        self.spec, self.handler, self.settings, self.metrics = spec, handler, settings, metrics
        self.node = settings.node_name
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self.rdzv = agent_rendezvous(handler, self.node, spec.nproc, settings.in_place)
        self.state = NodeRun(Round(world_size=spec.nproc), remaining_restarts=spec.max_restarts)  # shared, typed
        self.watch = HangWatch(settings.heartbeat_dir, settings.hang_timeout,
                               settings.hang_startup_timeout, node=self.node)
        self.commands = self.rdzv.command_watch(str(settings.heartbeat_dir))  # `elastic kill` from elsewhere
        self.channel: AgentChannel | NoChannel = AgentChannel(settings.control_dir) if self.rdzv.in_place \
            else NoChannel()
        self.store_server: Any = None  # the TCPStore of the rounds this node hosts (in place)
        store_addr: str | None = None
        if self.rdzv.in_place:
            self.store_server, store_addr = _start_round_store(settings.store_host or spec.local_addr)
        self.rdzv.attach(advertise_host=settings.store_host or spec.local_addr, metrics_url=metrics.url,
                         store_addr=store_addr, on_etcd_error=lambda kind: metrics.etcd_errors.labels(op=kind).inc(),
                         wake=self._wake, on_keep_out=lambda out: self.reporting.on_keep_out(out),
                         while_spare=lambda: self.spares.start_ahead())
        self.goodput = self.rdzv.goodput(settings.goodput_dir, settings.heartbeat_dir, metrics.registry)
        # stragglers: publish this node's pace, name the slow node, evict it (agent/node/pace.py)
        self.pace = self.rdzv.pace_monitor(metrics, settings.metrics_dir, settings.heartbeat_dir)
        # silent data corruption: replica votes that named this node (agent/node/sdc.py)
        self.sdc = SdcWatch(self.node, settings.heartbeat_dir)
        self.keep_outs = KeepOuts(self.node, self.rdzv.is_closed, settings.keep_out_s)  # one strike counter for every keep-out
        self.events = EventLog(settings.work_dir / EVENTS_FILE)  # what it acted on, for tools (agent.node.events)
        # node health: a sick node does not join, and goes out when it falls sick (agent/node/health_watch.py)
        self.health = HealthWatch(self.node, settings.snapshot_dir, settings.work_dir, settings.worker_env,
                                  self.rdzv.etcd_settings(), metrics.health_failing, events=self.events)
        # freezes: write off a peer whose agent does not answer; stop stale workers once thawed (agent/node/freeze.py)
        self.freeze = self.rdzv.freeze_watch(self.channel)
        self.pool: ForkServer | NoPool = ForkServer(spec.nproc, env={**os.environ, **self._node_env()}) \
            if settings.warm_start else NoPool()
        if settings.warm_start:
            self.pool.fill()  # the template imports torch while the first rendezvous runs
        else:
            discard_early()  # the template forked at the agent's start, never to be used
        self.workers = LocalWorkers(logs_specs, spec.role, self.pool,
                                    spec.numa_options,
                                    on_start=lambda mode: metrics.worker_starts.labels(mode=mode).inc())
        self._group_started = time.time()
        self._refilled = False
        run = self.state  # the collaborators share it and the parts each needs, never the agent
        self.observer = Observer(run, node=self.node, run_id=spec.run_id, heartbeat_dir=settings.heartbeat_dir,
                                 workers=self.workers, rdzv=self.rdzv, watch=self.watch, channel=self.channel,
                                 pace=self.pace, sdc=self.sdc, freeze=self.freeze, health=self.health)
        self.reporting = Reporting(run, node=self.node, nproc=spec.nproc, work_dir=settings.work_dir,
                                   metrics=metrics, rdzv=self.rdzv, watch=self.watch, workers=self.workers,
                                   observer=self.observer, events=self.events)
        self.spares = SpareAhead(run, self, node=self.node, nproc=spec.nproc, workers=self.workers,
                                 rdzv=self.rdzv, channel=self.channel, metrics=metrics, watch=self.watch)
        self.acts = Acts(run, self, node=self.node, settings=settings, metrics=metrics, workers=self.workers,
                         watch=self.watch, rdzv=self.rdzv, goodput=self.goodput, sdc=self.sdc, pace=self.pace,
                         freeze=self.freeze, channel=self.channel, pool=self.pool, observer=self.observer,
                         reporting=self.reporting, keep_outs=self.keep_outs)
        self._worker_group = WorkerGroup(WorkerSpec(
            role=spec.role, local_world_size=spec.nproc, rdzv_handler=handler, entrypoint=spec.command[0],
            args=spec.command[1:], max_restarts=spec.max_restarts, monitor_interval=spec.monitor_interval,
            local_addr=spec.local_addr))
        metrics.remaining_restarts.set(self.state.remaining_restarts)

    # the round's figures, as the workers' environment names them
    round = property(lambda self: self.state.round)
    group_rank = property(lambda self: self.round.group_rank)
    group_world = property(lambda self: self.round.group_world)
    rank_base = property(lambda self: self.round.rank_base)
    world_size = property(lambda self: self.round.world_size)
    master_addr = property(lambda self: self.round.master_addr)
    master_port = property(lambda self: self.round.master_port)
    round_number = property(lambda self: self.round.number)
    participants = property(lambda self: self.round.participants)
    offer = property(lambda self: self.round.offer)
    failure_line = property(lambda self: self.state.failure_line)  # why the job failed, in one line (launch prints it)

    # ------------------------------------------------------------------ torch's contract

    def get_worker_group(self, role: str = DEFAULT_ROLE) -> WorkerGroup:
        return self._worker_group

    def run(self, role: str = DEFAULT_ROLE) -> RunResult:
        previous = {sig: signal.signal(sig, self._on_signal) for sig in _SIGNALS}
        errors = self.events.error_handler()  # its ERROR lines, as events a tool can show
        log.addHandler(errors)
        try:
            self._await_standbys()
            self.rendezvous()
            self.start_group()
            return self._loop()
        except AgentSignal as exc:
            pids = self.workers.pids()
            terminate(self, self.node, self.workers, self.metrics, self.spec.term_grace, exc.signum)
            self.goodput.tick(pids, self.rank_base, force=True)  # rank 0's last marks, written as it stopped
            raise
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            log.removeHandler(errors)
            self.spares.drop()
            self.pool.close()
            self.channel.close()
            for fd in (self._wake_r, self._wake_w):
                os.close(fd)

    # ------------------------------------------------------------------ the loop

    def _loop(self) -> RunResult:
        while True:
            self._wait(self.spec.monitor_interval)
            self.commands.poll()  # `elastic kill` of this node from another machine
            self.goodput.tick(self.workers.pids(), self.rank_base)
            observed = self.observer.look()
            decision = decide(observed)
            # a failure being acted on counts (a refund in Acts.restart takes it back)
            self.state.streak = streak_acted_on(self.state.streak, decision, observed.crash_streak)
            self.reporting.export_lease()
            result = self.acts.carry_out(decision)
            if result is not None:
                return result

    def _wait(self, timeout: float) -> None:
        due = self.rdzv.lease_health().due_in
        if due is not None:
            timeout = min(timeout, due + 0.01)  # judge the lease on time, not at the next tick
        ready, _, _ = select.select([self._wake_r, self.channel.wake_fd], [], [], timeout)
        for fd in ready:
            try:
                while os.read(fd, 4096):
                    pass
            except BlockingIOError:
                pass

    def wake(self) -> None:
        """Look again at once (etcd news; an act that left its outcome to the next look)."""
        try:
            os.write(self._wake_w, b"w")
        except (BlockingIOError, OSError):
            pass

    _wake = wake

    def _on_signal(self, signum: int, _frame: Any) -> None:
        raise AgentSignal(signum)

    def _await_standbys(self) -> None:
        """Join the job only once this node can start its workers without importing torch.

        A node joining a running job opens a new round; the others would otherwise stand
        still (or, restarting, idle) while this node's workers imported torch.
        """
        deadline = time.monotonic() + STANDBY_READY_TIMEOUT_S
        while self.pool.ready_count() < self.pool.size:
            if time.monotonic() > deadline:
                log.warning("[%s] standby workers not ready after %.0f s; joining anyway (cold start)",
                            self.node, STANDBY_READY_TIMEOUT_S)
                return
            time.sleep(0.05)
        if self.settings.warm_start:  # said before the rendezvous: a spare waits there, its standbys ready
            self.metrics.standbys_ready.set(self.pool.ready_count())

    def while_healthy(self) -> None:
        """Between looks while the workers train: the standby pool refills once the group is up."""
        if not self._refilled and (self.watch.progressed()
                                   or time.time() - self._group_started >= self.settings.standby_refill_after):
            self._refilled = True  # the group is up: standbys no longer compete with a recovery
        if self._refilled and not self.pool.full:
            self.pool.fill()
        if self.settings.warm_start:
            self.metrics.standbys_ready.set(self.pool.ready_count())

    # ------------------------------------------------------------------ rounds and groups

    def _held_out(self, out: KeepOut | None) -> None:
        self.metrics.set_state(AgentState.STOPPED if out is not None else AgentState.HEALTHY)
        self.rdzv.hold_out(out)

    def rendezvous(self, cause: RoundCause = RoundCause.JOIN, offered: bool = False) -> None:
        """Take part in the next round (``offered``: one in-place workers can take, if any comes).
        A node that fails a health check joins none until it passes (agent.node.health_watch)."""
        if not self.health.gate(self.round_number, self.keep_outs, self._held_out):
            raise RendezvousClosedError("the job ended while this node was kept out by a failed health check")
        started = time.monotonic()
        try:
            self.state.round = self.rdzv.next_round(cause, self.round, offered=offered)
        except JobFinishedError:
            raise  # no round was asked for: the job had ended
        except Exception as exc:
            self.metrics.rendezvous.labels(outcome=_outcome(exc)).observe(time.monotonic() - started)
            raise
        self.metrics.rendezvous.labels(outcome="ok").observe(time.monotonic() - started)
        self.metrics.round.set(self.round_number)
        self.metrics.nodes_in_round.set(self.group_world)
        self.reporting.write_status()

    def start_group(self) -> None:
        """Start every local worker into the current round (or adopt a spare's workers started ahead)."""
        adopted = self.spares.take()
        self.watch.reset(keep_files=adopted is not None)  # the spare's workers beat into the files they opened
        if adopted is None:
            for rank in range(self.spec.nproc):
                self.channel.forget(rank)
        if self.offer is not None:
            self.channel.offer(self.offer)  # before the workers start: they read it first
        else:
            self.channel.withdraw()
        joining = list(range(self.spec.nproc)) if self.offer is not None and self.round.live_world else None
        self.rdzv.publish(in_place=False)  # the workers it had are gone; these hold nothing yet
        if adopted is not None:
            pids = adopted
            log.info("[%s] the workers started while a spare take the place: no start-up on the way", self.node)
        else:
            pids = self.workers.start_all(self.launches(joining))
        self.state.joiner_pids = set(pids.values()) if joining else set()
        self.group_started()
        self.goodput.workers_started(self._group_started)
        self._worker_group.workers = [
            Worker(local_rank=rank, global_rank=self.rank_base + rank, role_rank=self.rank_base + rank,
                   world_size=self.world_size, role_world_size=self.world_size) for rank in pids]
        for worker in self._worker_group.workers:
            worker.id = pids[worker.local_rank]
        self._worker_group.group_rank, self._worker_group.group_world_size = self.group_rank, self.group_world
        self._worker_group.state = WorkerState.HEALTHY
        self.metrics.workers_started(self._worker_group, pids)  # rank info for scripts that export none
        self.metrics.set_state(AgentState.HEALTHY)

    def start_again(self, ranks: list[int]) -> dict[int, int]:
        """In place: start ``ranks`` again, into a set-up world of their own first (they join a live one)."""
        port = _free_port()
        started = {rank: self.workers.start_again(rank, Launch(self.command_for(rank), self._env(rank, ranks, port)))
                   for rank in ranks}
        for worker in self._worker_group.workers:
            if worker.local_rank in started:
                worker.id = started[worker.local_rank]
        self.state.joiner_pids |= set(started.values())
        self.metrics.workers_started(self._worker_group, started)
        self.group_started()
        return started

    def group_started(self) -> None:
        self._group_started, self._refilled = time.time(), False

    def stop(self, sig: int, grace: float) -> dict[int, Any]:
        """Stop every local worker; returns torch's failure records of the stopped group."""
        pids = list(self.workers.pids().values())
        self.workers.stop(sig, grace=grace)
        failures = self.workers.failures()
        self.workers.forget()
        self.metrics.forget_pids(pids)
        return failures

    # ------------------------------------------------------------------ what each worker gets

    def launches(self, joining: list[int] | None) -> dict[int, Launch]:
        """Every local rank's launch; ``joining``: they start into a set-up world of their own (:meth:`_env`)."""
        port = _free_port() if joining else 0
        return {rank: Launch(self.command_for(rank), self._env(rank, joining, port))
                for rank in range(self.spec.nproc)}

    def command_for(self, local_rank: int) -> tuple[str, ...]:
        return tuple(macros.substitute(list(self.spec.command), str(local_rank)))

    def _node_env(self) -> dict[str, str]:
        """What every worker of this node gets, the standbys included (:class:`NodeEnv`)."""
        s = self.settings
        return NodeEnv(node_name=self.node, heartbeat_dir=str(s.heartbeat_dir), metrics_dir=str(s.metrics_dir),
                       agent_pid=os.getpid(), snapshot_dir=None if s.snapshot_dir is None else str(s.snapshot_dir),
                       term_grace=self.spec.term_grace,
                       control_dir=str(s.control_dir) if self.rdzv.in_place else None,
                       goodput_dir=str(s.goodput_dir) if self.goodput.enabled else None,
                       memory_dir=None if s.memory_dir is None else str(s.memory_dir), extra=s.worker_env).to_env()

    def _env(self, local_rank: int, joining: Sequence[int] | None = None, setup_port: int = 0) -> dict[str, str]:
        """torchrun's variables for one local rank, plus ours (:class:`RankEnv`).

        ``joining``: the local ranks started together into a world that already trains in
        place. Their ``init_process_group()`` would wait for peers that called theirs long
        ago, so their start-up world is just them, with a store of their own
        (:meth:`RankEnv.in_setup_world`); ``ElasticRun`` joins the real world
        at the loop's first batch."""
        place = Place(rank=self.rank_base + local_rank, world_size=self.world_size, group_rank=self.group_rank,
                      group_world_size=self.group_world, local_world_size=self.spec.nproc, round=self.round_number)
        me = RankEnv(place, local_rank=local_rank, role=self.spec.role, master_addr=self.master_addr,
                     master_port=self.master_port, restart_count=self.state.restart_count,
                     max_restarts=self.spec.max_restarts, run_id=self.spec.run_id,
                     use_agent_store=self.rdzv.use_agent_store,
                     nccl_async_error_handling=os.environ.get(contract.NCCL_ASYNC_ERROR_HANDLING_ENV, "1"),
                     recovering=self.state.recovering)
        return {**self._node_env(), **(me.in_setup_world(joining, setup_port) if joining else me).to_env()}


def _free_port() -> int:
    """A port for a joiners' set-up store (local rank 0 of them hosts it on loopback)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _start_round_store(host: str | None) -> tuple[Any, str]:
    """A TCPStore server for the rounds this node hosts; returns it and ``host:port``.

    It serves only the brief exchange of a reconfigure (handles, gloo's addresses), under
    a fresh prefix per round, and lives exactly as long as this agent: a round whose
    store host died fails, and the next round picks another host.
    """
    import torch.distributed as dist

    server = dist.TCPStore(host_name="0.0.0.0", port=0, is_master=True, wait_for_workers=False)
    return server, f"{host or '127.0.0.1'}:{server.port}"


def _outcome(exc: BaseException) -> str:
    name = type(exc).__name__
    if "Timeout" in name:
        return "timeout"
    if "Closed" in name:
        return "closed"
    return "error"


def exit_code_for(exc: AgentSignal) -> int:
    return 128 + exc.signum


__all__ = ["AgentSignal", "AgentSpec", "JobFinishedError", "NodeAgent", "exit_code_for",
           "STANDBY_READY_TIMEOUT_S"]
