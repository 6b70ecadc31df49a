"""A spare's workers, started ahead beside a world that trains in place.

Contract: the rendezvous calls :meth:`SpareAhead.start_ahead` at each look while this
node waits as a spare (its first call starts the workers, later ones count those ready);
the agent's group start calls :meth:`SpareAhead.take` once the round admits the node
(the workers, if they can take its place as they are, else None after stopping them);
the agent's end calls :meth:`SpareAhead.drop`.
"""

from __future__ import annotations

import logging
import signal
from elastic import contract
from agent.node.channel import AgentChannel

from agent.node.metrics import AgentMetrics
from agent.node.node_run import Group, NodeRun
from agent.node.nulls import NoChannel
from agent.node.rendezvous_api import AgentRendezvous
from agent.node.watchdog import HangWatch
from agent.node.workers import LocalWorkers

log = logging.getLogger("elastic.agent")


class SpareAhead:
    def __init__(self, run: NodeRun, group: Group, *, node: str, nproc: int, workers: LocalWorkers,
                 rdzv: AgentRendezvous, channel: AgentChannel | NoChannel, metrics: AgentMetrics,
                 watch: HangWatch) -> None:
        self.run, self.group, self.node, self.nproc = run, group, node, nproc
        self.workers, self.rdzv, self.channel, self.metrics, self.watch = workers, rdzv, channel, metrics, watch
        self.prestarted: dict[int, int] = {}  # local rank -> pid: workers started while a spare

    def start_ahead(self) -> None:
        """Waiting as a spare beside a world that trains in place: start this node's workers
        now, into a set-up world of their own, so that the script's start-up (imports, the
        model, the data) is done before a place opens. They wait at the loop's first batch
        for the round that admits this node (``InPlaceWorld.enter_loop``), which then
        only offers it to them (:meth:`take`). Only a world whose members say they train in
        place (an ``ElasticRun`` script, which waits in its set-up world) gets workers
        ahead: a plain script would train on alone in it."""
        if self.prestarted:
            self._count_ready()
            return
        if self.workers.pids() or not self.rdzv.in_place or not self.rdzv.live_world_ahead():
            return
        self.channel.withdraw()
        for rank in range(self.nproc):
            self.channel.forget(rank)
        self.watch.reset()  # an older group's beats go now: adopted, these workers keep the files they open
        self.prestarted = self.workers.start_all(self.group.launches(joining=list(range(self.nproc))))
        self.run.joiner_pids = set(self.prestarted.values())
        modes = sorted({w.mode for w in self.workers.workers.values()})
        log.info("[%s] a spare: its workers start now (%s), so that they take a place at the next step boundary "
                 "with the script's start-up done; they wait at the loop's first batch", self.node,
                 " and ".join(modes) or "?")

    def _count_ready(self) -> None:
        """A worker started ahead is ready once it said it joins (its run is built, its loop waits)."""
        ready = 0
        for rank, pid in self.prestarted.items():
            status = self.channel.status(rank)
            ready += status is not None and status.pid == pid and status.state == contract.WorkerState.JOINING
        self.metrics.spare_workers_ready.set(ready)

    def drop(self) -> None:
        if self.prestarted:
            self.prestarted = {}
            self.group.stop(signal.SIGKILL, 0.0)

    def take(self) -> dict[int, int] | None:
        """The spare's workers started ahead, if they can take this round's place as they are."""
        prestarted, self.prestarted = self.prestarted, {}
        if not prestarted:
            return None
        self.metrics.spare_workers_ready.set(0)
        usable = (self.run.round.offer is not None and self.run.round.live_world and self.workers.pids() == prestarted
                  and all(code is None for code in self.workers.exits().values()))
        if usable:
            return prestarted
        self.group.stop(signal.SIGKILL, 0.0)  # one died, or this round does not train in place: start afresh
        return None


__all__ = ["SpareAhead"]
