"""Per-rank progress beacons the node agent's hang watchdog reads.

A worker that makes progress overwrites 32 bytes (step, wall time, pid, kind) at offset 0
of ``$ELASTIC_HEARTBEAT_DIR/rank-{LOCAL_RANK}``: one ``pwrite``, no fsync, no lock,
nothing that can block on a slow disk or a stuck peer. The agent only needs "when did
this rank last make progress", so a torn read (never seen with writes this small to the
page cache) would at worst delay a hang verdict by one poll.

``kind`` says what ``step`` counts: :data:`JOB_STEP` is the job's committed step
(``ElasticRun``, or a script's own ``elastic.report_progress(step)``), comparable across
restarts; :data:`LOCAL_COUNT` counts this process's optimizer steps (the hook every worker
of ``elastic agent`` gets), which says "alive and stepping" but starts at 0 in each
process. Tools that report steps rolled back use only job steps.
"""

from __future__ import annotations

import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path

HEARTBEAT_DIR_ENV = "ELASTIC_HEARTBEAT_DIR"
LOCAL_COUNT, JOB_STEP = 0, 1
_FORMAT = struct.Struct("<qdqq")  # step, unix time, pid, kind
_LEGACY = struct.Struct("<qdq")  # before kinds: always written by ElasticRun, so job steps


@dataclass(frozen=True)
class Beat:
    step: int
    time: float
    pid: int
    kind: int = JOB_STEP


class Heartbeat:
    """The worker side: ``beat(step)`` after every step."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        self._pid = os.getpid()

    @classmethod
    def from_env(cls) -> "Heartbeat | None":
        """None when not running under our agent (plain torchrun or a notebook)."""
        directory = os.environ.get(HEARTBEAT_DIR_ENV)
        if not directory:
            return None
        return cls(Path(directory) / f"rank-{int(os.environ.get('LOCAL_RANK', '0'))}")

    def beat(self, step: int, kind: int = JOB_STEP) -> None:
        os.pwrite(self._fd, _FORMAT.pack(step, time.time(), self._pid, kind), 0)

    def close(self) -> None:
        os.close(self._fd)


def read_beats(directory: Path) -> dict[int, Beat]:
    """The agent side: local rank -> last beat, for every rank that has beaten."""
    beats: dict[int, Beat] = {}
    try:
        entries = list(directory.iterdir())
    except FileNotFoundError:
        return beats
    for entry in entries:
        if not entry.name.startswith("rank-"):
            continue
        try:
            raw = entry.read_bytes()[: _FORMAT.size]
            rank = int(entry.name[5:])
        except (OSError, ValueError):
            continue
        if len(raw) == _FORMAT.size:
            beats[rank] = Beat(*_FORMAT.unpack(raw))
        elif len(raw) == _LEGACY.size:
            beats[rank] = Beat(*_LEGACY.unpack(raw))
    return beats
