"""What the node agent says: its log lines about a decision, ``status.json``, and its gauges.

Contract: :class:`Reporting` reads the agent's state and writes only outward (the log, a
file in the agent's directory, metrics); it changes nothing the loop decides on. The
acts call :meth:`Reporting.describe` before they act; the loop calls
:meth:`Reporting.export_lease` each look and the round driver :meth:`Reporting.write_status`
after each round; the rendezvous calls :meth:`Reporting.on_keep_out`.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from elastic.atomic_file import write_atomically

from agent.node.events import Event, EventLog, NoEvents, WorkersFailed, WorkersHung
from agent.node.metrics import AgentMetrics
from agent.node.node_run import NodeRun
from agent.node.observer import Observer
from agent.node.policy import Decision, Reason, last_words
from agent.node.rendezvous_api import AgentRendezvous
from agent.node.watchdog import HangWatch
from agent.node.workers import LocalWorkers

log = logging.getLogger("elastic.agent")


class Reporting:
    def __init__(self, run: NodeRun, *, node: str, nproc: int, work_dir: Path, metrics: AgentMetrics,
                 rdzv: AgentRendezvous, watch: HangWatch, workers: LocalWorkers, observer: Observer,
                 events: EventLog | NoEvents | None = None) -> None:
        self.run, self.node, self.nproc, self.work_dir = run, node, nproc, work_dir
        self.events = events if events is not None else NoEvents()  # what it did, for tools (agent.node.events)
        self.metrics, self.rdzv, self.watch, self.workers, self.observer = metrics, rdzv, watch, workers, observer

    def write_status(self) -> None:
        """``status.json`` in the agent's directory: where this node's workers stand, for tools
        (``elastic local`` follows any script's progress through it and the heartbeats)."""
        r = self.run.round
        status = {"node": self.node, "round": r.number, "participants": list(r.participants),
                  "group_rank": r.group_rank, "group_world": r.group_world, "rank_base": r.rank_base,
                  "world_size": r.world_size, "nproc": self.nproc, "time": time.time()}
        path = self.work_dir / "status.json"
        try:
            write_atomically(path, json.dumps(status).encode())
        except OSError as exc:
            log.debug("cannot write %s: %s", path, exc)

    def on_keep_out(self, out: Any) -> None:
        """The rendezvous keeps this node out (``out``: why and how long) or lets it back in (None)."""
        metrics = self.metrics
        metrics.kept_out.set(1 if out is not None else 0)
        metrics.keep_out_backoff.set(out.backoff if out is not None else 0)
        if out is not None:
            metrics.kept_out_total.inc()

    def export_lease(self) -> None:
        health = self.rdzv.lease_health()
        self.metrics.keepalive_age.set(health.age if health.age is not None else 0.0)
        self.metrics.etcd_outage.set(1 if health.outage else 0)

    def describe(self, decision: Decision) -> str:
        reason = decision.reason
        if reason is Reason.HANG:
            last = self.watch.last_progress()
            since = f"for {time.time() - last:.0f} s" if last is not None else "since the group started"
            return (f"no rank on this node made progress {since} (hang timeout {self.watch.describe_timeout()}); "
                    "dumping worker stacks, then restarting")
        cut_off = self.rdzv.lease_health().cut_off if reason is Reason.LEASE_LOST else ""
        if cut_off:
            return cut_off
        if decision.detail:
            return decision.detail
        kept_out, reform_why = self.observer.kept_out_peers, self.observer.reform_why
        return {
            Reason.PEER_LOST: f"{', '.join(kept_out)} went out of the job (kept out)" if kept_out
                              else "a peer of this round lost its etcd lease (dead, frozen or cut off)",
            Reason.LEASE_LOST: "this node lost its own etcd lease (it was frozen or cut off); its workers are stale",
            Reason.SCALE_UP: "another node opened a new round (a node joined or came back)",
            Reason.REFORM: f"{reform_why}: forming the round again without them"
                           if self.observer.reform_peers_stopped  # elastic.stopping: peers left at a boundary
                           else f"a local worker's collective failed{_parenthesised(reform_why)} while "
                                "every lease held; forming the round again",
            Reason.WORKER_FAILED: f"local worker(s) {sorted(decision.failed)} failed "
                                  f"(exit {', '.join(str(c) for c in decision.failed.values())})"
                                  f"{self._last_words()}",
        }.get(reason, str(reason))  # type: ignore[arg-type]  # a None reason is looked up too

    def _last_words(self) -> str:
        """`` with "ValueError: boom"``: what the failed workers' error files say, if anything."""
        words = self._cause_words()
        return f' with "{words}"' if words else ""

    def _cause_words(self) -> str:
        seen = self.observer.seen_failures
        words = last_words(seen) if seen else ""
        return words if not words.startswith("exit ") else ""

    def emit(self, event: Event) -> None:
        self.events.emit(event)

    def acting_on(self, decision: Decision, *, in_place: bool = False) -> None:
        """The event for stopping (``in_place``: restarting) workers that failed or hung, if
        that is what ``decision`` is about; nothing for another reason."""
        if decision.reason is Reason.WORKER_FAILED:
            failed = sorted(decision.failed.items())
            seen = self.observer.seen_failures
            cause = next((f.cause for _, f in sorted(seen.items()) if f.cause is not None), None)
            self.events.emit(WorkersFailed(tuple(r for r, _ in failed), tuple(c for _, c in failed),
                                           self._cause_words(), in_place=in_place,
                                           cause=cause.value if cause is not None else ""))
        elif decision.reason is Reason.HANG:
            self.events.emit(WorkersHung(tuple(decision.ranks), in_place=in_place))

    def traceback_where(self, failed: Mapping[int, int]) -> str:
        """Where a failed worker's traceback is: its stderr file, else this agent's own output."""
        workers = self.workers.workers
        files = sorted({w.stderr for r, w in workers.items() if r in failed and w.stderr})
        return ", ".join(files) if files else "above, in this agent's output (stderr)"


@dataclass(frozen=True)
class Restarted:
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


def change(before: tuple[str, ...] | list[str], after: tuple[str, ...] | list[str]) -> str:
    """`` without b`` / `` with c`` / both: how a round's members changed, for a log line."""
    gone = [n for n in before if n not in after]
    came = [n for n in after if n not in before]
    parts = ([f"without {', '.join(gone)}"] if gone else []) + ([f"with {', '.join(came)}"] if came else [])
    return f" {' and '.join(parts)}" if parts and before else ""


def _parenthesised(words: str) -> str:
    return f" ({words})" if words else ""


__all__ = ["Reporting", "Restarted", "change"]
