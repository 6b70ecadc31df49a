"""Per-rank progress beacons the node agent's hang watchdog (and ``elastic local``) reads.

A worker that makes progress overwrites 56 bytes (step, wall time, pid, kind, loss,
samples, finished) at offset 0 of ``$ELASTIC_HEARTBEAT_DIR/rank-{LOCAL_RANK}``: one ``pwrite``, no
fsync, no lock, nothing that can block on a slow disk or a stuck peer. The agent only
needs "when did this rank last make progress", so a torn read (never seen with writes
this small to the page cache) would at worst delay a hang verdict by one poll.

The record only ever grows by fields appended at its end (24 bytes, then 32 with
``kind``, 48 with ``loss`` and ``samples``, now 56 with ``finished``), so every reader parses the longest
layout it knows that fits: an old agent reads a new worker's record as its prefix, and
:func:`read_beats` still reads the records of workers older than itself (an upgrade can
meet both). ``loss`` is NaN and ``samples`` 0 where the writer reported none.

``kind`` says what ``step`` counts: :data:`JOB_STEP` is the job's committed step
(``ElasticRun``, or a script's own ``elastic.report_progress(step)``), comparable across
restarts; :data:`LOCAL_COUNT` counts this process's optimizer steps (the hook every worker
of ``elastic agent`` gets), which says "alive and stepping" but starts at 0 in each
process. Tools that report steps rolled back use only job steps.

``finished`` is the wall time at which the worker's script returned (0 while it runs):
:func:`mark_finished`, called by the agent's bootstrap, so that the interpreter's
teardown and the script's own exit hooks (a ``wandb.finish()``, a final upload) are not
mistaken for a hang however long they take. Everything else in the record stays as the
last beat left it: ``time`` is still when the rank last made progress.
"""

from __future__ import annotations

import math
import os
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from . import contract, worker_env

LOCAL_COUNT, JOB_STEP = 0, 1
_FORMAT = struct.Struct("<qdqqdqd")  # step, unix time, pid, kind, loss (NaN: none), samples, finished (0: no)
_SAMPLES = struct.Struct("<qdqqdq")  # before finished
_KINDS = struct.Struct("<qdqq")  # before loss and samples
_LEGACY = struct.Struct("<qdq")  # before kinds: always written by ElasticRun, so job steps
_LAYOUTS = (_FORMAT, _SAMPLES, _KINDS, _LEGACY)  # longest first: each is a prefix of the one before
NO_LOSS = math.nan


@dataclass(frozen=True)
class Beat:
    step: int
    time: float
    pid: int
    kind: int = JOB_STEP
    loss: float | None = None  # the loss the worker reported with this step, if any
    samples: int = 0  # samples this process reported since it started (a running total; see Heartbeat.beat)
    finished: float | None = None  # when the script returned (teardown since), None while it runs


def own_record_path() -> Path | None:
    """This worker's record under the agent (``LOCAL_RANK``'s), or None outside it."""
    env = worker_env.read()
    if not env.node.heartbeat_dir:
        return None
    return Path(env.node.heartbeat_dir) / contract.heartbeat_file(env.me.local_rank)


class Heartbeat:
    """The worker side: ``beat(step)`` after every step."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        self._pid = os.getpid()

    @classmethod
    def from_env(cls) -> "Heartbeat | None":
        """None when not running under our agent (plain torchrun or a notebook)."""
        path = own_record_path()
        return cls(path) if path is not None else None

    def beat(self, step: int, kind: int = JOB_STEP, loss: float = NO_LOSS, samples: int = 0) -> None:
        """``samples`` is this process's running total, not this step's: a reader that
        polls slower than the worker steps misses beats, and the difference between two
        totals it did see still counts every sample in between. A new process starts
        again at 0, which a reader tells by ``pid``."""
        os.pwrite(self._fd, _FORMAT.pack(step, time.time(), self._pid, kind, loss, samples, 0.0), 0)

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
        if not entry.name.startswith(contract.HEARTBEAT_PREFIX):
            continue
        try:
            raw = entry.read_bytes()[: _FORMAT.size]
            rank = int(entry.name[len(contract.HEARTBEAT_PREFIX):])
        except (OSError, ValueError):
            continue
        beat = parse_beat(raw)
        if beat is not None:
            beats[rank] = beat
    return beats


def parse_beat(raw: bytes) -> Beat | None:
    """One record, of any size ever written (longer ones: from a newer worker, read as
    the prefix known here); None for one too short to be any (a file just created)."""
    for layout in _LAYOUTS:
        if len(raw) >= layout.size:
            fields = layout.unpack_from(raw)
            if layout is _FORMAT or layout is _SAMPLES:
                step, at, pid, kind, loss, samples, *finished = fields
                return Beat(step, at, pid, kind, None if math.isnan(loss) else loss, samples,
                            finished[0] if finished and finished[0] > 0 else None)
            return Beat(*fields)
    return None


_returned = threading.Event()


def script_returned() -> bool:
    """Whether :func:`mark_finished` ran in this process (its script returned): its main thread
    is on its way out, and waits in it are not a hang (:mod:`elastic.inplace.left_behind`)."""
    return _returned.is_set()


def mark_finished() -> None:
    """This process's script returned: say so in its record, leaving the rest as it was.

    Only a record this process wrote is marked (a rank that never beat has nothing the
    watchdog would judge). Never raises: it runs on the way out of every worker."""
    _returned.set()
    try:
        path = own_record_path()
        if path is None:
            return
        with open(path, "r+b") as f:
            beat = parse_beat(f.read(_FORMAT.size))
            if beat is None or beat.pid != os.getpid():
                return
            loss = NO_LOSS if beat.loss is None else beat.loss
            f.seek(0)
            f.write(_FORMAT.pack(beat.step, beat.time, beat.pid, beat.kind, loss, beat.samples, time.time()))
    except (OSError, ValueError):
        pass
