"""A worker's own account of its time, marked as it goes; rank 0 hands it to its agent.

``ElasticRun`` calls a handful of marks, each meaning "the time since the previous mark
went to X": a step (productive, or recompute if the job had completed that step before,
less the snapshot stall inside it), the detection of a failed collective, the wait for
the round, the restore or heal, or the whole stand-still of a join. Every rank marks and
keeps its marks; what it hands in (``worker-{local_rank}.json``, folded into the job's
record by its agent: :mod:`elastic.goodput.account`) is only what it witnessed **for the
job**:

* everything while it is rank 0, and the re-formation in which it stops being rank 0 (a
  join that makes a newcomer rank 0: the survivors stood still, the newcomer did not);
* on becoming rank 0 as a survivor that kept its state (rank 0's node died): all it still
  remembers, since its predecessor's last seconds were never reported;
* its own start-up only if it is the job's: it restored the job's state from disk (a
  restart), or its agent started it to repair a broken world (``ELASTIC_GOODPUT_RECOVERY``).
  A newcomer healed from a live replica started while the job trained on without it.

Marks are wall-clock times (``time.time``): they are compared with the agent's and with
other nodes'. A mark costs a deque append; a flush (twice a second at most) one small
file write.
"""

from __future__ import annotations

import os
import time
from collections import deque
from pathlib import Path
from typing import Callable, Sequence

from .account import (DETECTION, JOIN, PRODUCTIVE, RECOMPUTE, RENDEZVOUS, RESTORE, SNAPSHOT, WORKER_START,
                      Interval)
from .. import contract, worker_env
from ..atomic_file import write_atomically
from .files import WorkerReport, read_job_file, worker_file

FLUSH_EVERY_S = 0.5
# Whose each remembered interval is: handed in now, handed in if this process takes rank 0
# over as a survivor, or never (its own start-up while the job trained on without it).
MINE, JOBS, OWN = 1, 0, -1
KEEP = 4096  # intervals; consecutive steps coalesce, so this spans hours


class GoodputLog:
    """Marks of one worker process. ``GoodputLog(None, ...)`` records nothing (not under the agent)."""

    def __init__(self, directory: Path | None, local_rank: int = 0, *, started_at: float | None = None,
                 recovery: bool = False, clock: Callable[[], float] = time.time) -> None:
        self.directory, self.clock, self.recovery = directory, clock, recovery
        self.path = worker_file(directory, local_rank) if directory is not None else None
        self._last = started_at if started_at is not None else clock()  # the previous mark
        self._log: deque[tuple[Interval, int]] = deque(maxlen=KEEP)  # (interval, MINE | JOBS | OWN)
        self._pending: list[Interval] = []  # the formation in progress, named once it is over
        self._healed = False  # this formation gave us our state from a live replica
        self._formed_once = False
        self._reason = "start"
        self._participants: tuple[str, ...] = ()
        self._started = False
        self.rank = -1
        self.high_water = -1
        self._job_to: float | None = None
        self._job_seen: tuple[int, int] | None = None
        self._flushed = 0.0

    @classmethod
    def from_env(cls) -> "GoodputLog":
        env = worker_env.read()
        directory = env.node.goodput_dir
        if not directory:
            return cls(None)
        from elastic.metrics.worker import process_age_seconds  # the process's start, warm starts included

        return cls(Path(directory), env.me.local_rank,
                   started_at=time.time() - process_age_seconds(), recovery=env.me.recovering)

    @property
    def enabled(self) -> bool:
        return self.directory is not None

    # ------------------------------------------------------------------ marks

    def failed(self) -> None:
        """A collective failed: the step in flight and the wait to learn of it were detection."""
        self._mark(DETECTION, self._pending)

    def forming(self, reason: str) -> None:
        """A world is about to form, for ``reason`` (start, failure or join)."""
        self._reason = reason
        if reason == "start" and not self._started:
            self._started = True
            self._mark(WORKER_START, self._pending)  # process start to here: imports, process group

    def healed_from_replica(self) -> None:
        """This formation's state came from a live rank, not from this process or disk."""
        self._healed = True

    def joined(self) -> None:
        """The round is in (membership reconfigured): the wait for it was rendezvous."""
        self._mark(JOIN if self._reason == "join" else RENDEZVOUS, self._pending)

    def formed(self, participants: Sequence[str], rank: int) -> None:
        """Standing on the agreed step: the agreement, heal or restore is done."""
        if self.directory is None:
            return
        self._mark(JOIN if self._reason == "join" else RESTORE, self._pending)
        reason, nodes = self._name(tuple(participants))
        newcomer = self._healed and not self._formed_once and not self.recovery  # started as the job ran on
        was_rank0 = self.rank == 0
        if rank == 0 and not was_rank0 and self._formed_once:  # a survivor takes over: the job's time it saw
            self._log = deque(((iv, MINE if whose == JOBS else whose) for iv, whose in self._log), maxlen=KEEP)
        whose = MINE if was_rank0 or (rank == 0 and not newcomer) else OWN if newcomer else JOBS
        self._log.extend((Interval(end=iv.end, cause=iv.cause, start=iv.start, reason=reason, nodes=nodes), whose)
                         for iv in self._pending)
        self._pending, self._healed, self._formed_once = [], False, True
        if participants:
            self._participants = tuple(participants)
        self.rank = rank
        self._read_job(force=True)
        self.flush(force=True)

    def stepped(self, step: int, stall: float = 0.0) -> None:
        """Step ``step`` completed; ``stall`` of its seconds were spent on a snapshot."""
        if self.directory is None:
            return
        now = self.clock()
        cause = PRODUCTIVE if step > self.high_water else RECOMPUTE
        self.high_water = max(self.high_water, step)
        mine = MINE if self.rank == 0 else JOBS
        if 0.0 < stall < now - self._last:
            self._append(Interval(end=now - stall, cause=cause, start=self._last, step=step), mine)
            self._append(Interval(end=now, cause=SNAPSHOT, start=now - stall), mine)
        else:
            self._append(Interval(end=now, cause=cause, start=self._last, step=step), mine)
        self._last = now
        if now - self._flushed >= FLUSH_EVERY_S:
            self.flush()

    def corrupted(self, nodes: Sequence[str], detail: str) -> None:
        """A replica check found replicas that differ (silent data corruption) and every
        replica goes back: the time since the last step (the loop's code, the check) is
        the fault's detection, the steps trained again its recompute; ``detail`` says the
        step, the tensors and how far back (the fault's reason stays ``sdc``: a label)."""
        if self.directory is None:
            return
        now = self.clock()
        self._append(Interval(end=now, cause=DETECTION, start=self._last, reason="sdc", nodes=tuple(nodes),
                              detail=detail), MINE if self.rank == 0 else JOBS)
        self._last = now
        self.flush(force=True)

    def _mark(self, cause: str, into: list[Interval]) -> None:
        if self.directory is None:
            return
        now = self.clock()
        into.append(Interval(end=now, cause=cause, start=self._last))
        self._last = now

    def _append(self, iv: Interval, whose: int) -> None:
        last, was = self._log[-1] if self._log else (None, OWN)
        if last is not None and was == whose and last.cause == iv.cause and not last.reason and last.end == iv.start:
            self._log[-1] = (Interval(end=iv.end, cause=iv.cause, start=last.start, step=iv.step), whose)
        else:
            self._log.append((iv, whose))

    def _name(self, participants: tuple[str, ...]) -> tuple[str, tuple[str, ...]]:
        """What this formation was, as far as this worker can tell (the agent names restarts)."""
        before, after = set(self._participants), set(participants)
        if self._reason == "failure":
            lost = tuple(sorted(before - after))
            return ("peer_lost" if lost else "reform"), lost
        if self._reason == "join":
            return "scale_up", tuple(sorted(after - before))
        return "", ()

    # ------------------------------------------------------------------ handing in

    def flush(self, force: bool = False) -> None:
        """Hand in what this worker witnessed that the record does not cover yet (rank 0, or
        when forced); every rank forgets what the record covers."""
        if self.path is None:
            return
        now = self.clock()
        if not force and now - self._flushed < FLUSH_EVERY_S:
            return
        self._flushed = now
        self._read_job()
        while self._log and self._job_to is not None and self._log[0][0].end <= self._job_to:
            self._log.popleft()
        if self.rank != 0 and not force:
            return
        intervals = tuple(iv for iv, whose in self._log if whose == MINE)
        try:
            write_atomically(self.path, WorkerReport(os.getpid(), self.rank, intervals).to_json())
        except OSError:
            pass  # the agent's directory is gone (it is exiting): nothing to hand in to

    def _read_job(self, force: bool = False) -> None:
        if self.directory is None:
            return
        path = self.directory / contract.GOODPUT_JOB_FILE
        try:
            st = os.stat(path)
        except OSError:
            return
        key = (st.st_mtime_ns, st.st_size)
        if key == self._job_seen and not force:
            return
        job = read_job_file(path)
        if job is not None:
            self._job_seen = key
            self._job_to = job.to
            self.high_water = max(self.high_water, job.high_water)

    def close(self) -> None:
        self.flush(force=True)
