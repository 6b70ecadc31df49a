"""The agent's side of goodput: fold what happened on this node into the job's record.

Each monitor tick an agent gathers the intervals of the job's time that it witnessed and
nobody has counted yet; normally only the agent of rank 0's node has any:

* its own, when it restarts or replaces workers because the job's world broke (not when
  its own lease was lost: the job trained on without it): detection up to the moment it
  acted, then the rendezvous (for a node joining, both are the join's);
* its ``ElasticRun`` workers' (``worker-{local_rank}.json``, written by
  :class:`elastic.goodput.GoodputLog`, which hands in only what it witnessed for the job:
  rank 0's steps, snapshot stalls and each re-formation's phases);
* for any other script, rank 0's heartbeats: step time is productive, recomputed (job
  steps at or below the high water) or, for scripts that report no job steps,
  ``unknown`` once the job has had a fault, because a redone step cannot be told from a
  new one; the start of the worker to its first beat (its imports, its own restore, its
  first step, which cannot be told apart) is ``worker_start``.

It folds them into the record at ``{prefix}/{run}/goodput/account`` (signed like every
value we write) with :func:`elastic.goodput.extend`, under a compare-and-swap on the
key's revision, at most once per ``push_every`` seconds; and only when its write succeeds
does it add the seconds that write added to ``elastic_productive_seconds_total`` and
``elastic_lost_seconds_total{cause}``. So ``sum(rate(...))`` over every node is the job's
figure, whoever accounted when, and a write lost to a race is simply done again from the
newer record. Every agent mirrors the record (the job's goodput and its fault timeline
as gauges, and ``job.json`` for its workers and ``elastic local``).

An agent that acts on its own node's trouble (a worker failed or hung, its lease lost)
leaves a note under ``goodput/acts/{node}``, so that the accountant, which may only see a
collective fail, can name the fault.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge

from agent.etcd import EtcdClient, EtcdError
from elastic.goodput.account import (DETECTION, FAULT_PHASES, JOIN, LOCAL_REASONS, LOST_CAUSES, PRODUCTIVE,
                                     RECOMPUTE, RENDEZVOUS, UNKNOWN, WORKER_START, Account, Interval, added, extend,
                                     name_faults)
from elastic import contract
from elastic.atomic_file import write_atomically
from elastic.goodput.files import WorkerReport, read_report, worker_file
from elastic.heartbeat import JOB_STEP, Beat, read_beats
from agent.rendezvous.registry import run_prefix
from agent.rendezvous.signing import SignatureError, StateSigner

if TYPE_CHECKING:
    from agent.rendezvous.session import RendezvousSession

log = logging.getLogger("elastic.agent")

PUSH_EVERY_S = 1.0
ETCD_DEADLINE_S = 0.5  # a tick must not stall the agent's loop while etcd is away
TIMELINE_PHASES = (*FAULT_PHASES, RECOMPUTE, UNKNOWN)


def account_key(key_prefix: str, run_id: str) -> str:
    return f"{run_prefix(key_prefix, run_id)}/goodput/account"


def notes_prefix(key_prefix: str, run_id: str) -> str:
    return f"{run_prefix(key_prefix, run_id)}/goodput/acts/"


def fault_nodes(reason: str, node: str, previous: Iterable[str], current: Iterable[str]) -> tuple[str, ...]:
    """Which node(s) a restart was about: the lost ones, the joined ones, or this one."""
    before, after = set(previous), set(current)
    if reason == "scale_up":
        return tuple(sorted(after - before))
    if reason == "peer_lost":
        return tuple(sorted(before - after))
    return (node,)


def beat_cause(beat: Beat, high_water: int, had_fault: bool) -> str:
    """What the time up to ``beat`` was, for a script whose only report is its heartbeat."""
    if beat.kind == JOB_STEP:
        return PRODUCTIVE if beat.step > high_water else RECOMPUTE
    return UNKNOWN if had_fault else PRODUCTIVE  # a per-process count says nothing of redone steps


def decode_account(signer: StateSigner, key: str, value: bytes) -> Account | None:
    try:
        return Account.from_json(signer.open(key.encode(), value))
    except (SignatureError, ValueError) as exc:
        log.warning("ignoring goodput record %s: %s", key, exc)
        return None


def decode_note(signer: StateSigner, key: str, value: bytes) -> tuple[str, float] | None:
    """A node's note (``goodput/acts/{node}``: why it acted, and when), or None if it is
    forged or not a note."""
    try:
        data = json.loads(signer.open(key.encode(), value))
        return str(data["reason"]), float(data["at"])
    except (SignatureError, ValueError, KeyError, TypeError, OverflowError, RecursionError):
        return None


def read_account(client: EtcdClient, signer: StateSigner, key_prefix: str, run_id: str) -> Account | None:
    """The job's record, read from etcd (``elastic top``)."""
    key = account_key(key_prefix, run_id)
    value, _meta = client.call(lambda c: c.get(key))
    return None if value is None else decode_account(signer, key, value)


class GoodputMetrics:
    """The counters the accountant adds to, and the gauges every agent mirrors from the record."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.productive = Counter("elastic_productive_seconds",
                                  "Job wall time spent in steps that were completed, counted by the agent that "
                                  "recorded it (sum over nodes = the job's)", registry=r)
        self.lost = Counter("elastic_lost_seconds", "Job wall time lost, by cause, counted by the agent that "
                                                    "recorded it (sum over nodes = the job's)", ["cause"], registry=r)
        self.ratio = Gauge("elastic_goodput_ratio", "The job's productive share of its wall time since its first "
                                                     "step (every agent mirrors the job's record)", registry=r)
        self.fault_at = Gauge("elastic_last_fault_timestamp_seconds",
                              "Unix time at which the latest fault of this node and reason began",
                              ["fault_node", "reason"], registry=r)
        self.fault_phase = Gauge("elastic_last_fault_phase_seconds",
                                 "Seconds of each phase of the latest fault of this node and reason",
                                 ["fault_node", "reason", "phase"], registry=r)
        for cause in LOST_CAUSES:
            self.lost.labels(cause=cause)  # export zeros, so rate() works from the start
        self._shown: set[tuple[str, str]] = set()

    def wrote(self, new: Account, old: Account) -> None:
        productive, lost = added(new, old)
        if productive:
            self.productive.inc(productive)
        for cause, seconds in lost.items():
            if seconds:
                self.lost.labels(cause=cause).inc(seconds)

    def mirror(self, record: Account) -> None:
        if record.goodput is not None:
            self.ratio.set(record.goodput)
        for fault in record.faults:  # oldest first: the newest of each node and reason wins
            for node in fault.nodes or ("unknown",):
                labels = (node, fault.reason or "unknown")
                self.fault_at.labels(*labels).set(fault.at)
                for phase in TIMELINE_PHASES:
                    self.fault_phase.labels(*labels, phase).set(fault.phases.get(phase, 0.0))


@dataclass
class _Beats:
    """Where heartbeat accounting of the current local rank 0 stands."""

    pid: int | None = None
    counted_to: float | None = None  # the time the next beat interval starts from
    first: bool = True  # the next interval ends at the worker's first beat: its start-up


class GoodputAccountant:
    """See the module doc. Without an etcd-v3 rendezvous (no session) the agent holds a
    :class:`NoGoodput` instead."""

    enabled = True  # the workers get GOODPUT_DIR and report into it

    def __init__(self, node: str, directory: Path, heartbeat_dir: Path, registry: CollectorRegistry,
                 session: "RendezvousSession", push_every: float = PUSH_EVERY_S,
                 clock: Callable[[], float] = time.time) -> None:
        self.node, self.directory, self.heartbeat_dir = node, directory, heartbeat_dir
        self.session, self.push_every, self.clock = session, push_every, clock
        directory.mkdir(parents=True, exist_ok=True)
        self.metrics = GoodputMetrics(registry)
        self.key = account_key(session.key_prefix, session.run_id)
        self.notes = notes_prefix(session.key_prefix, session.run_id)
        self.record = Account()
        self.revision = 0  # the record's mod revision in etcd; 0: none yet
        self._pending: list[Interval] = []  # not yet written: its own (a restart of rank 0), rank 0's beats
        self._beats = _Beats()
        self._last_push = 0.0
        self._retry_at = 0.0
        self._reports: dict[Path, tuple[tuple[int, int], WorkerReport | None]] = {}

    # ------------------------------------------------------------------ what the agent tells us

    def acted(self, reason: str, at: float | None = None) -> None:
        """This agent acted on ``reason`` (at ``at``, default now); a local one is noted for
        the accountant. Each attempt is capped like the whole (etcd3's own request timeout is
        5 s, and a node cut off from etcd calls this on its way to fencing itself)."""
        if reason not in LOCAL_REASONS:
            return
        key = self.notes + self.node
        when = self.clock() if at is None else at
        try:
            self.session.swap_signed(key, json.dumps({"reason": reason, "at": when}).encode(), None,
                                     deadline=ETCD_DEADLINE_S)
        except EtcdError as exc:
            log.debug("goodput note not written: %s", exc)

    def restarted(self, reason: str, nodes: tuple[str, ...], acted_at: float, rendezvous_done: float) -> None:
        """Workers are started anew because the job's world broke (or grew): the time to
        ``acted_at`` was detection and the rest rendezvous (for a node joining: both are the
        join's). A node whose own lease was lost witnessed nothing of the job's time."""
        if reason == "lease_lost":
            return
        first, second = (JOIN, JOIN) if reason == "scale_up" else (DETECTION, RENDEZVOUS)
        self._pending += [Interval(end=acted_at, cause=first, reason=reason, nodes=nodes),
                          Interval(end=rendezvous_done, cause=second, start=acted_at, reason=reason, nodes=nodes)]

    def workers_started(self, at: float) -> None:
        self._beats = _Beats(counted_to=at)

    def workers_stopped(self, local_ranks: Iterable[int] | None = None) -> None:
        """Their reports must not speak for their successors."""
        ranks = list(local_ranks) if local_ranks is not None else None
        for path in list(self.directory.glob("worker-*.json")):
            if ranks is None or any(path == worker_file(self.directory, r) for r in ranks):
                path.unlink(missing_ok=True)
                self._reports.pop(path, None)

    # ------------------------------------------------------------------ each tick

    def tick(self, workers: Mapping[int, int], rank_base: int, force: bool = False) -> None:
        """``workers``: local rank -> pid of the current group; ``rank_base``: global rank of local rank 0."""
        self._refresh()
        now = self.clock()
        if now < self._retry_at and not force:
            return
        intervals, beat = self._gather(workers, rank_base)
        if beat is not None:  # held until written: the next beat's interval starts where this one ends,
            self._pending.append(intervals[-1])  # so a push that waits cannot stretch the start-up over steps
            self._beats.counted_to, self._beats.first = beat.time, False
        counted = self.record.to if self.record.to is not None else float("-inf")
        if not intervals or max(iv.end for iv in intervals) <= counted:
            self._pending = []  # everything there is was counted already (by someone)
            return
        news = any(iv.reason and iv.end > counted for iv in intervals)  # a fault: record it now
        if not (force or news) and now - self._last_push < self.push_every:
            return
        if not self.session.healthy:
            return  # etcd is away: keep it all for when it is back
        self._last_push = now
        if self._write(intervals):
            self._pending = []

    def _gather(self, workers: Mapping[int, int], rank_base: int) -> tuple[list[Interval], Beat | None]:
        intervals = list(self._pending)
        reports = [r for r in (self._report(rank, pid) for rank, pid in workers.items()) if r is not None]
        if reports:  # ElasticRun workers: what they witnessed, in time order across them
            return sorted(intervals + [iv for r in reports for iv in r.intervals], key=lambda iv: iv.end), None
        if rank_base != 0 or 0 not in workers:
            return intervals, None  # not rank 0's node
        beat = read_beats(self.heartbeat_dir).get(0)
        if beat is None or beat.pid != workers[0] or self._beats.counted_to is None:
            return intervals, None
        if beat.time <= self._beats.counted_to:
            return intervals, None
        cause = WORKER_START if self._beats.first else beat_cause(beat, self.record.high_water,
                                                                   bool(self.record.faults))
        step = beat.step if beat.kind == JOB_STEP or cause == UNKNOWN else None  # see Interval.step
        intervals.append(Interval(end=beat.time, cause=cause, start=self._beats.counted_to, step=step))
        return intervals, beat

    def _report(self, local_rank: int, pid: int) -> WorkerReport | None:
        path = worker_file(self.directory, local_rank)
        try:
            st = os.stat(path)
        except OSError:
            return None
        key = (st.st_mtime_ns, st.st_size)
        cached = self._reports.get(path)
        if cached is None or cached[0] != key:
            cached = (key, read_report(path))
            self._reports[path] = cached
        report = cached[1]
        return report if report is not None and report.pid == pid else None

    # ------------------------------------------------------------------ the record in etcd

    def _refresh(self) -> None:
        """Take a newer record from the mirror: keep ``job.json`` and the gauges current."""
        entry = self.session.entries().get(self.key)
        if entry is None or entry.mod_revision <= self.revision:
            return
        record = decode_account(self.session.signer, self.key, entry.value)
        if record is not None:
            self._adopt(record, entry.mod_revision)

    def _adopt(self, record: Account, revision: int) -> None:
        self.record, self.revision = record, revision
        try:
            write_atomically(self.directory / contract.GOODPUT_JOB_FILE, record.to_json())
        except OSError as exc:
            log.debug("cannot write %s: %s", self.directory / contract.GOODPUT_JOB_FILE, exc)
        self.metrics.mirror(record)

    def _write(self, intervals: list[Interval]) -> bool:
        """One compare-and-swap from the record we hold; True if it took."""
        old = self.record
        new = extend(old, intervals)
        new = name_faults(new, self._notes(), since=len(old.faults) - (old.state != "idle"))
        try:
            took, revision = self.session.swap_signed(self.key, new.to_json(), self.revision, deadline=ETCD_DEADLINE_S)
        except EtcdError as exc:
            log.debug("goodput record not written: %s", exc)
            self._retry_at = self.clock() + 2.0
            return False
        if not took:
            return False  # someone wrote first: the mirror brings their record, and we fold again
        self.metrics.wrote(new, old)
        self._adopt(new, revision)
        return True

    def _notes(self) -> dict[str, tuple[str, float]]:
        notes = {}
        for key, entry in self.session.entries().items():
            if not key.startswith(self.notes):
                continue
            note = decode_note(self.session.signer, key, entry.value)
            if note is not None:
                notes[key[len(self.notes):]] = note
        return notes


class NoGoodput:
    """:class:`GoodputAccountant`'s place without an etcd-v3 rendezvous (no shared account to
    keep): it does nothing, but its gauges are registered all the same, so that ``/metrics``
    shows the same names whatever the rendezvous."""

    enabled = False  # the workers get no GOODPUT_DIR

    def __init__(self, registry: CollectorRegistry) -> None:
        self.metrics = GoodputMetrics(registry)

    def acted(self, reason: str, at: float | None = None) -> None:
        pass

    def restarted(self, reason: str, nodes: tuple[str, ...], acted_at: float, rendezvous_done: float) -> None:
        pass

    def workers_started(self, at: float) -> None:
        pass

    def workers_stopped(self, local_ranks: Iterable[int] | None = None) -> None:
        pass

    def tick(self, workers: Mapping[int, int], rank_base: int, force: bool = False) -> None:
        pass
