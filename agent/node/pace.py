"""The agent's side of straggler detection: publish this node's pace, read everyone's, act.

Each look (at most every :data:`PERIOD_S`) the agent reads its own workers' paces from
their metrics files (``elastic_step_compute_seconds``, the slowest local rank is the
node's pace: it is the one everyone waits for) and its workers' job step from their
heartbeats, and writes both into its registry record (``pace``, ``pace_step``). It then
reads every member's record from the rendezvous' mirror (no etcd request) and feeds
:class:`agent.node.stragglers.StragglerWatch`. Every agent names the same node, in one log line
and in ``elastic_agent_straggler{node}``; only the straggler's own agent evicts it (keeps
itself out with the crash loop's back-off), so nobody needs to be elected. This module only
finds and says (:class:`agent.node.policy.PaceFacts`); whether to evict is the policy's.

Why the agent and the registry rather than a gather among the workers: the trainer stays
untouched, any script whose workers export the split takes part, and every agent (spares
included) sees the figures that decide. Only ``ElasticRun`` workers export the split
today; a node without a figure is never named, and a window counts only once every
member has one.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from elastic.metrics.multiprocess import merged

from elastic import contract
from elastic.heartbeat import read_beats

from agent.node.policy import PaceFacts
from agent.node.stragglers import Pace, Straggler, StragglerWatch

if TYPE_CHECKING:
    from agent.rendezvous.session import RendezvousSession

log = logging.getLogger(__name__)

PERIOD_S = float(os.environ.get(contract.STRAGGLER_PERIOD_ENV, "5"))
COMPUTE = "elastic_step_compute_seconds"


def local_pace(metrics_dir: Path) -> float | None:
    """The slowest live local rank's median compute seconds per step; None before any has one."""
    values = []
    for metric in merged(metrics_dir):  # a file a worker is creating right now is skipped, never raised
        if metric.name == COMPUTE:
            values += [s.value for s in metric.samples if s.value > 0]  # -1: a retired rank's
    return max(values) if values else None


def local_step(heartbeat_dir: Path) -> int | None:
    """The furthest job step this node's workers reported (their heartbeats)."""
    beats = read_beats(heartbeat_dir)
    return max((b.step for b in beats.values()), default=None)


def evict_enabled() -> bool:
    return os.environ.get(contract.STRAGGLER_EVICT_ENV, "1").strip().lower() not in ("0", "off", "false", "no")


class PaceMonitor:
    """Owned by the node agent; :meth:`look` from its loop while the workers train."""

    def __init__(self, node: str, session: "RendezvousSession", metrics: Any, metrics_dir: Path, heartbeat_dir: Path,
                 period: float = PERIOD_S) -> None:
        self.node, self.session, self.metrics = node, session, metrics
        self.metrics_dir, self.heartbeat_dir, self.period = metrics_dir, heartbeat_dir, period
        self.watch = StragglerWatch()
        self._next = 0.0
        self._named: str | None = None
        self._published: tuple[float | None, int | None] = (None, None)

    def look(self, participants: tuple[str, ...] | list[str]) -> PaceFacts | None:
        """The straggler named at a window this look judged, with what the policy weighs to
        evict it (:func:`agent.node.policy.straggler_out`); None between looks or with none named."""
        now = time.monotonic()
        if now < self._next:
            return None
        self._next = now + self.period
        self._publish(local_pace(self.metrics_dir), local_step(self.heartbeat_dir))
        records = self.session.node_records()
        paces = {n: _pace(records.get(n)) for n in participants}
        straggler = self.watch.observe(paces)
        self._name(straggler)
        if straggler is None:
            return None
        spares = sum(1 for n, r in records.items() if r.state == "spare" and n not in participants)
        return PaceFacts(straggler, mine=straggler.node == self.node, world=len(participants), spares=spares,
                         evict=evict_enabled())

    def forget(self) -> None:
        """The workers stopped (a restart, a keep-out): the old figures no longer apply."""
        self._publish(None, None)
        self._name(None)
        self.watch = StragglerWatch()

    def _publish(self, compute: float | None, step: int | None) -> None:
        if (compute, step) == self._published:
            return
        self._published = (compute, step)
        self.metrics.pace.set(compute if compute is not None else 0.0)
        self.session.publish(pace=compute, pace_step=step)

    def _name(self, straggler: Straggler | None) -> None:
        node = straggler.node if straggler is not None else None
        if node == self._named:
            return
        if self._named is not None:
            self.metrics.straggler.labels(node=self._named).set(0)
            log.info("[%s] node %s no longer lags the others", self.node, self._named)
        if straggler is not None:
            self.metrics.straggler.labels(node=straggler.node).set(1)
            log.warning("[%s] %s", self.node, straggler.describe())
        self._named = node


def _pace(record: Any) -> Pace | None:
    if record is None or record.pace is None or record.pace_step is None:
        return None
    return Pace(float(record.pace), int(record.pace_step))


def paces_of(records: Mapping[str, Any]) -> dict[str, Pace | None]:
    """Every node's published pace (``elastic top`` shows them)."""
    return {n: _pace(r) for n, r in records.items()}
