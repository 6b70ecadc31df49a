"""The node-local files between a worker and its agent, in ``$ELASTIC_GOODPUT_DIR``.

* ``worker-{local_rank}.json``: a worker's :class:`WorkerReport`, the intervals it marked
  that the job's record does not cover yet. Only rank 0's reaches the record.
* ``job.json``: the job's record as the agent last saw it in etcd. Workers read its end
  (to prune what is already counted) and its high water (to tell a redone step from a new
  one); ``elastic local`` and ``bench/chaos_soak.py`` read it for their summaries.

Written whole and renamed into place, as the in-place channel's files are: a reader sees
the old file or the new one, and either side survives the other's death.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from .. import contract
from .account import Account, Interval



def worker_file(directory: Path, local_rank: int) -> Path:
    return directory / contract.goodput_worker_file(local_rank)


@dataclass(frozen=True)
class WorkerReport:
    pid: int
    rank: int
    intervals: tuple[Interval, ...]

    def to_json(self) -> bytes:
        return json.dumps({"pid": self.pid, "rank": self.rank,
                           "intervals": [iv.to_row() for iv in self.intervals]}).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "WorkerReport":
        data = json.loads(raw)
        return cls(pid=int(data["pid"]), rank=int(data["rank"]),
                   intervals=tuple(Interval.from_row(row) for row in data["intervals"]))


def read_report(path: Path) -> WorkerReport | None:
    try:
        return WorkerReport.from_json(path.read_bytes())
    except (OSError, ValueError, KeyError, TypeError):
        return None  # absent, or replaced under us: the next look reads the new one


def read_job_file(path: Path) -> Account | None:
    try:
        return Account.from_json(path.read_bytes())
    except (OSError, ValueError):
        return None


def newest_account(paths: Iterable[Path]) -> Account | None:
    """The most complete of several copies of the record (each agent keeps one)."""
    found = [a for a in map(read_job_file, paths) if a is not None and a.to is not None]
    return max(found, key=lambda a: a.to or 0.0, default=None)
