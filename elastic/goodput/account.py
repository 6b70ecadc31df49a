"""A job's goodput account: every second since its first step, assigned to exactly one cause.

Pure: no clock, no files, no etcd, so every rule below is unit-tested in milliseconds
(``tests/elastic/goodput/test_account.py``), as ``agent/rendezvous/rounds.py`` is.

The account is a fold over **intervals** of wall time, each with one cause. Workers and
agents produce intervals (:mod:`elastic.goodput.recorder`, :mod:`agent.node.goodput`); one agent
at a time folds them into the job's record in etcd with :func:`extend`, under a
compare-and-swap, and exports what its write added. So:

* **it is a partition**: the record covers ``[started_at, to]`` and
  ``productive + sum(lost) == to - started_at`` after every fold; time before ``to``
  is never counted again, whoever reports it (an interval is clipped at ``to``);
* **nothing is counted twice across nodes**: only the write that moved ``to`` exports the
  seconds it added, and writes are serialised by etcd;
* **counters never go back**: a step redone after a rollback does not take its first run
  back from "productive" (a counter cannot shrink); its second run is counted as
  ``recompute`` instead. The totals equal those of the strict definition (the first run
  lost, the second productive) up to the difference between the two runs' step times.

A gap between the account's end and the next interval longer than :data:`GAP_ABSORBED_S`
is ``unknown``: nobody reported what the job did then (an agent whose report died with
its node). A shorter gap is scheduling slack and belongs to the interval that follows.

**Faults** are read off the same stream: a run of fault phases (detection, rendezvous,
worker start, restore, join) after productive time opens a fault record; the
recomputation that follows is charged to it; the next productive second closes it. Its
name (reason, nodes) comes from whichever of its intervals carries one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Mapping

PRODUCTIVE = "productive"
DETECTION, RENDEZVOUS, WORKER_START, RESTORE = "detection", "rendezvous", "worker_start", "restore"
RECOMPUTE, SNAPSHOT, JOIN, UNKNOWN = "recompute", "snapshot", "join", "unknown"
LOST_CAUSES = (DETECTION, RENDEZVOUS, WORKER_START, RESTORE, RECOMPUTE, SNAPSHOT, JOIN, UNKNOWN)
FAULT_PHASES = (DETECTION, RENDEZVOUS, WORKER_START, RESTORE, JOIN)  # open (or continue) a fault
CAUSES = (PRODUCTIVE, *LOST_CAUSES)

GAP_ABSORBED_S = 1.0
MAX_FAULTS = 20  # the record keeps the newest ones; the counters keep every second

_IDLE, _FAULT, _RECOMPUTE = "idle", "fault", "recompute"


@dataclass(frozen=True)
class Interval:
    """``[start, end]`` spent on ``cause``; ``start`` None: from wherever the account stands.

    ``step`` is the job step a productive or recomputed interval ended at (it raises the
    high water); on an ``unknown`` interval any step count says it was step time of unknown
    worth (a plain script's steps after a fault), not a gap nobody reported. ``reason`` and
    ``nodes`` name the fault the interval belongs to, if known.
    """

    end: float
    cause: str
    start: float | None = None
    step: int | None = None
    reason: str = ""
    nodes: tuple[str, ...] = ()
    detail: str = ""  # what the fault was, in words, where the reason (a metric label) is too coarse: an SDC's step

    def to_row(self) -> list[Any]:
        row = [self.start, self.end, self.cause, self.step, self.reason, list(self.nodes)]
        return row + [self.detail] if self.detail else row

    @classmethod
    def from_row(cls, row: list[Any]) -> "Interval":
        start, end, cause, step, reason, nodes, *rest = row
        if cause not in CAUSES:
            raise ValueError(f"unknown cause {cause!r}")
        return cls(end=float(end), cause=str(cause), start=None if start is None else float(start),
                   step=None if step is None else int(step), reason=str(reason), nodes=tuple(map(str, nodes)),
                   detail=str(rest[0]) if rest else "")


@dataclass(frozen=True)
class Fault:
    """One fault (or join): when it began, its name, and the seconds of each phase."""

    at: float
    reason: str = ""
    nodes: tuple[str, ...] = ()
    phases: Mapping[str, float] = field(default_factory=dict)
    detail: str = ""  # e.g. an SDC's step, tensors and rollback (Interval.detail)

    @property
    def seconds(self) -> float:
        return sum(self.phases.values())

    def to_dict(self) -> dict[str, Any]:
        out = {"at": self.at, "reason": self.reason, "nodes": list(self.nodes), "phases": dict(self.phases)}
        return {**out, "detail": self.detail} if self.detail else out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Fault":
        nodes = data.get("nodes", [])
        if not isinstance(nodes, list):
            raise TypeError(f"fault nodes {nodes!r:.40} is not a list")
        return cls(at=float(data["at"]), reason=str(data.get("reason", "")), nodes=tuple(map(str, nodes)),
                   phases={str(k): float(v) for k, v in dict(data.get("phases", {})).items()},
                   detail=str(data.get("detail", "")))


@dataclass(frozen=True)
class Account:
    """The job's record: what :func:`extend` folds intervals into and etcd stores."""

    started_at: float | None = None  # the start of the job's first step
    to: float | None = None  # every second up to here is assigned
    productive: float = 0.0
    lost: Mapping[str, float] = field(default_factory=lambda: {c: 0.0 for c in LOST_CAUSES})
    high_water: int = -1  # the highest job step ever completed
    faults: tuple[Fault, ...] = ()
    state: str = _IDLE  # where the last interval left the fault reading (see module doc)

    @property
    def wall(self) -> float:
        return 0.0 if self.to is None or self.started_at is None else self.to - self.started_at

    @property
    def lost_total(self) -> float:
        return sum(self.lost.values())

    @property
    def goodput(self) -> float | None:
        """Productive share of the wall time since the first step; None before any."""
        return self.productive / self.wall if self.wall > 0 else None

    def to_json(self) -> bytes:
        return json.dumps({"v": 1, "started_at": self.started_at, "to": self.to, "productive": self.productive,
                           "lost": dict(self.lost), "high_water": self.high_water, "state": self.state,
                           "faults": [f.to_dict() for f in self.faults]}, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes | str) -> "Account":
        """Raises ValueError on anything that is not an account this module wrote."""
        try:
            data = json.loads(raw)
            if data.get("v") != 1:
                raise ValueError(f"goodput record version {data.get('v')!r}, expected 1")
            lost = {c: 0.0 for c in LOST_CAUSES}
            lost.update({str(k): float(v) for k, v in data["lost"].items() if k in lost})
            return cls(started_at=_opt_float(data["started_at"]), to=_opt_float(data["to"]),
                       productive=float(data["productive"]), lost=lost, high_water=int(data["high_water"]),
                       faults=tuple(Fault.from_dict(f) for f in data.get("faults", ())),
                       state=str(data.get("state", _IDLE)))
        except (KeyError, TypeError, AttributeError, OverflowError, RecursionError) as exc:
            raise ValueError(f"not a goodput record: {exc!r:.80}") from None


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)


def extend(account: Account, intervals: Iterable[Interval]) -> Account:
    """``account`` with ``intervals`` (in time order) folded in; see the module doc."""
    fold = _Fold(account)
    for interval in intervals:
        fold.add(interval)
    return fold.result()


class _Fold:
    """The mutable working copy :func:`extend` uses; the result is a new frozen Account."""

    def __init__(self, a: Account) -> None:
        self.started_at, self.to, self.productive = a.started_at, a.to, a.productive
        self.lost = {c: float(a.lost.get(c, 0.0)) for c in LOST_CAUSES}
        self.high_water, self.state = a.high_water, a.state
        self.faults = [replace(f, phases=dict(f.phases)) for f in a.faults]

    def add(self, iv: Interval) -> None:
        if iv.step is not None and iv.cause in (PRODUCTIVE, RECOMPUTE):
            self.high_water = max(self.high_water, iv.step)
        if self.to is None:  # the clock starts with the job's first step; what came before is set-up
            if iv.cause not in (PRODUCTIVE, RECOMPUTE) or iv.start is None:
                return
            self.started_at = self.to = iv.start
        start = self.to if iv.start is None else iv.start
        if iv.end <= self.to:
            return
        if start > self.to + GAP_ABSORBED_S:
            self._charge(UNKNOWN, start, Interval(end=start, cause=UNKNOWN))
        self._charge(iv.cause, iv.end, iv)

    def _charge(self, cause: str, end: float, iv: Interval) -> None:
        assert self.to is not None
        seconds, began = end - self.to, self.to
        self.to = end
        if cause == PRODUCTIVE:
            self.productive += seconds
            self.state = _IDLE
            return
        self.lost[cause] += seconds
        if cause in FAULT_PHASES:
            if self.state != _FAULT:
                self.faults.append(Fault(at=began, phases={}))
                self.state = _FAULT
            self._phase(cause, seconds, iv)
        elif cause == RECOMPUTE and self.state in (_FAULT, _RECOMPUTE) and self.faults:
            self._phase(cause, seconds, iv)
            self.state = _RECOMPUTE
        elif cause == UNKNOWN and iv.step is not None:
            self.state = _IDLE  # steps were taken again: whatever they were worth, the fault is over
        elif cause == UNKNOWN and self.state == _FAULT:
            self._phase(cause, seconds, iv)
        # snapshot stalls (and unknown outside a fault) leave the fault reading as it is

    def _phase(self, cause: str, seconds: float, iv: Interval) -> None:
        fault = self.faults[-1]
        phases = dict(fault.phases)
        phases[cause] = phases.get(cause, 0.0) + seconds
        named = not fault.reason and iv.reason
        self.faults[-1] = replace(fault, phases=phases, reason=iv.reason if named else fault.reason,
                                  nodes=iv.nodes if named else fault.nodes, detail=iv.detail if named else fault.detail)

    def result(self) -> Account:
        return Account(started_at=self.started_at, to=self.to, productive=self.productive, lost=dict(self.lost),
                       high_water=self.high_water, faults=tuple(self.faults[-MAX_FAULTS:]), state=self.state)


def added(new: Account, old: Account) -> tuple[float, dict[str, float]]:
    """What a write from ``old`` to ``new`` adds: productive seconds and lost seconds by cause.

    Never negative for ``new = extend(old, ...)``; a caller handed anything else gets zeros
    rather than a counter that goes back.
    """
    productive = max(0.0, new.productive - old.productive)
    return productive, {c: max(0.0, new.lost.get(c, 0.0) - old.lost.get(c, 0.0)) for c in LOST_CAUSES}


def name_faults(account: Account, notes: Mapping[str, tuple[str, float]], since: int,
                slack: float = 1.0) -> Account:
    """Name the faults from index ``since`` on that nobody named, from other agents' notes.

    ``since`` is the first fault the caller's fold may have opened or extended, so a fault
    already closed keeps its name.

    An agent that acts on a fault of its own node (a worker failed or hung, its lease was
    lost) leaves a note ``node -> (reason, when)``. The accountant is often on another
    node and sees only that a collective failed (``reform``) or nothing at all; a note
    written during the fault (within ``slack`` seconds of its ends) names it.
    """
    faults = list(account.faults)
    changed = False
    for i in range(max(0, since), len(faults)):
        fault = faults[i]
        if fault.reason not in ("", "reform"):
            continue
        until = fault.at + fault.seconds + slack  # the note's agent acted during the fault
        near = sorted((at, node, reason) for node, (reason, at) in notes.items()
                      if reason in LOCAL_REASONS and fault.at - slack <= at <= until)
        if near:
            _, node, reason = near[0]
            faults[i] = replace(fault, reason=reason, nodes=(node,))
            changed = True
    return replace(account, faults=tuple(faults)) if changed else account


# a node's own trouble, which only it sees; a worker's failure by its kind where its words say one (agent.node.fault_cause)
LOCAL_REASONS = ("worker_failed", "hang", "lease_lost", "health", "disk_full", "cuda_oom", "nccl_error", "cuda_error",
                 "oom")
