"""Per-rank progress beacons the node agent's hang watchdog reads.

A worker that completes a step overwrites 24 bytes (step, wall time, pid) at offset 0 of
``$ELASTIC_HEARTBEAT_DIR/rank-{LOCAL_RANK}``: one ``pwrite`` per step, no fsync, no lock,
nothing that can block on a slow disk or a stuck peer. The agent only needs "when did
this rank last finish a step", so a torn read (never seen with 24-byte writes to the page
cache) would at worst delay a hang verdict by one poll.
"""

from __future__ import annotations

import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path

HEARTBEAT_DIR_ENV = "ELASTIC_HEARTBEAT_DIR"
_FORMAT = struct.Struct("<qdq")  # step, unix time, pid


@dataclass(frozen=True)
class Beat:
    step: int
    time: float
    pid: int


class Heartbeat:
    """The worker side: ``beat(step)`` after every committed step."""

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

    def beat(self, step: int) -> None:
        os.pwrite(self._fd, _FORMAT.pack(step, time.time(), self._pid), 0)

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
    return beats
