"""The observe step of the node agent's loop: one :class:`agent.node.policy.Observation` per look.

Contract: :meth:`Observer.look` once per loop turn, after the agent's wait and before
:func:`agent.node.policy.decide`. It reads the workers (exits, failures in detail, in-place
statuses), the rendezvous (membership news, the peers' crash reports, a lost etcd), the
hang watchdog and the straggler, SDC and freeze watches, and feeds each into a field of
the observation; it decides nothing. What it says about this node on the way (whether its
workers hold state in place, what they failed with) goes into its registry record, each
written only on a change.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from elastic import contract
from agent.node.channel import AgentChannel

from agent.node.node_run import NodeRun
from agent.node.nulls import NoChannel
from agent.node.fault_cause import attribute
from agent.node.oom import killed_by, oom_killed, oom_kills
from agent.node.policy import Failure, Observation, crash_report, last_words, next_streak
from agent.node.rendezvous_api import AgentRendezvous
from agent.node.sdc import SdcWatch
from agent.node.watchdog import HangWatch
from agent.node.workers import LocalWorkers

log = logging.getLogger("elastic.agent")


class Observer:
    def __init__(self, run: NodeRun, *, node: str, run_id: str, heartbeat_dir: Path, workers: LocalWorkers,
                 rdzv: AgentRendezvous, watch: HangWatch, channel: AgentChannel | NoChannel, pace: Any,
                 sdc: SdcWatch, freeze: Any, health: Any) -> None:
        self.run, self.node, self.run_id, self.heartbeat_dir = run, node, run_id, heartbeat_dir
        self.workers, self.rdzv, self.watch, self.channel = workers, rdzv, watch, channel
        self.pace, self.sdc, self.freeze = pace, sdc, freeze  # the straggler, SDC and freeze watches
        self.health = health  # agent.node.health_watch: '' for a healthy node, else the failed checks
        self.kept_out_peers: list[str] = []  # members of this round that went out for a crash loop
        self.seen_failures: dict[int, Failure] = {}  # the last look's failed workers, for the log
        self.reform_why = ""  # what the worker asking for a new round said
        self.reform_peers_stopped = False  # ... and whether it asks because ranks stopped after SIGTERM
        self.frozen: Any = None  # the freeze watch's last finding (agent.node.freeze.Frozen), for the act
        # what this node's registry record says: its workers run in place (they hold state, or
        # are joiners starting that take the next offer); a round's closer reads it (rounds.py)
        self._runs_in_place = False
        self._said_in_place = False
        self._in_world = False  # a local worker is in a formed world, taking steps (its status says TRAINING)
        self._oom_seen = oom_kills()  # the kernel's OOM kill count, to tell an OOM kill from a SIGKILL (agent.node.oom)
        self._kill_words: dict[int, tuple[str, contract.FaultCause | None]] = {}  # pid -> what killed it, judged once
        self._failed_since: float | None = None  # when the current failed workers were first seen (monotonic)

    def look(self) -> Observation:
        run = self.run
        exits = self.workers.exits()
        membership, self.kept_out_peers = self.rdzv.membership(run.round)
        stalled = self.watch.stalled() if all(code is None for code in exits.values()) else None
        in_place, reform, whole_node = self._in_place_statuses()
        self.rdzv.publish(in_place=self._runs_in_place)
        failures = self.seen_failures = self._failures(exits)
        now = time.monotonic()
        self._failed_since = (self._failed_since or now) if failures else None
        report = crash_report(failures)
        if report:  # tell the other nodes what this node's workers failed with right after their start
            self.rdzv.publish(crash=report)
        if failures:  # the last fault of this node, kind first (agent.node.fault_cause), for elastic top
            self.rdzv.publish(fault=last_words(failures)[:300])
        failed = any(code not in (None, 0) for code in exits.values())
        fresh = failed or membership is not None or reform or stalled is not None
        self.frozen = self.freeze.look(self.workers.pids(), run.round.number, run.round.participants)
        unusable, run.unusable_round = run.unusable_round, None
        sdc = self.sdc.look()
        return Observation(
            exits=exits, membership=membership, stalled_for=stalled, in_place=in_place, reform_requested=reform,
            whole_node=whole_node,
            restarts_left=run.remaining_restarts, failures=failures,
            crash_streak=next_streak(run.crash_streak, failures.values()),
            nodes_without_us=run.round.count_others(self.node) if self.rdzv.can_keep_out else None,
            peer_crashes=self.rdzv.peer_crashes(run.round) if report else None,  # read only for a crash of ours
            etcd_lost=self.rdzv.etcd_lost(self._stale_fence(), self.run_id) if failures else "",
            health=self.health.look(),
            min_nodes=self.rdzv.min_nodes,
            pace=self.pace.look(run.round.participants),
            sdc=sdc,
            spares_waiting=self._spares_waiting(sdc.suspect),
            written_off=self.freeze.written_off(run.round.number, run.round.participants, fresh=fresh) or "",
            frozen=self.frozen.nodes if self.frozen is not None else (),
            frozen_detail=self.frozen.detail if self.frozen is not None else "",
            unusable_round=unusable,
            job_ended=self.rdzv.job_ended(),
            in_world=self._in_world,
            scripts_returned=self.watch.scripts_returned(len(exits)),
            failed_for=now - self._failed_since if self._failed_since is not None else 0.0)

    def _spares_waiting(self, suspect: str) -> int:
        """Only when it matters (an SDC suspect in a round at the job's minimum size): a read of etcd."""
        current = self.run.round
        if not suspect or len(current.others(self.node)) >= self.rdzv.min_nodes:
            return 0
        return self.rdzv.spares_waiting(current)

    def _stale_fence(self) -> dict[str, Any] | None:
        """What rank 0 said of the fence that refused its group (elastic.snapshots), if it did."""
        try:
            data = json.loads((self.heartbeat_dir / contract.STALE_FENCE_FILE).read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def _failures(self, exits: dict[int, int | None]) -> dict[int, Failure]:
        """The failed local workers in detail: how long each ran and its last words."""
        out = {}
        for rank, code in exits.items():
            worker = self.workers.workers.get(rank)
            if code in (None, 0) or worker is None:
                continue
            line, kind, cause = worker.error_details()
            message = attribute(line, cause)  # "disk full (ENOSPC): OSError: ..." (agent.node.fault_cause)
            if not message and code < 0:
                if worker.pid not in self._kill_words:
                    now = oom_kills()
                    self._kill_words[worker.pid] = (killed_by(-code, self._oom_seen, now),
                                                    contract.FaultCause.OOM if oom_killed(-code, self._oom_seen, now)
                                                    else None)
                    self._oom_seen = now
                message, cause = self._kill_words[worker.pid]
            out[rank] = Failure(code=int(code), ran_for=worker.ran_for(), message=message,
                                progressed=self.watch.progressed_since_start(rank), kind=kind, cause=cause)
        return out

    def _in_place_statuses(self) -> tuple[bool, bool, bool]:
        """(every running local worker runs in place, one asked for a new round, one said its
        node's ranks are one unit of state)."""
        run = self.run
        self._runs_in_place = self._in_world = False
        statuses, starting = [], False
        for rank, pid in self.workers.pids().items():
            status = self.channel.status(rank)
            if status is None or status.pid != pid:
                if pid not in run.joiner_pids:
                    return False, False, False
                # Started into a world that trains in place, and not heard from yet: it takes
                # the newest offer at its first batch, so a round that comes meanwhile is
                # offered to it (restarting it would throw its start-up away, standby and all).
                starting = True
                continue
            statuses.append(status)
        in_place = (bool(statuses) or starting) and all(s.mode == contract.WorkerMode.IN_PLACE for s in statuses)
        self._runs_in_place = in_place
        self._in_world = any(s.state == contract.WorkerState.TRAINING for s in statuses)
        if in_place and not self._said_in_place:
            self._said_in_place = True
            log.info("[%s] workers run in place: a peer lost or a node joining no longer restarts them", self.node)
        asking = [s for s in statuses if s.want_round_after is not None and s.want_round_after >= run.round.number]
        self.reform_why = asking[0].reason if asking else ""
        self.reform_peers_stopped = asking[0].peers_stopped if asking else False
        whole_node = any(isinstance(s.extra, dict) and s.extra.get(contract.WHOLE_NODE_KEY) for s in statuses)
        return in_place, bool(asking), whole_node


__all__ = ["Observer"]
