"""One rank's metrics handle: labels bound once, so a step costs a handful of locked adds."""

from __future__ import annotations

import os
import time
from importlib import metadata
from pathlib import Path
from typing import Any, Protocol

from .catalogue import Families, families

_IMPORTED_AT = time.monotonic()
STARTED_AT_ENV = "ELASTIC_WORKER_STARTED_AT"  # set by a warm-started worker (agent/warm_worker.py)


class DurableStats(Protocol):
    """What :meth:`WorkerMetrics.snapshot_durable` reads; ``checkpoints.WriterStats`` fits."""

    last_capture_s: float
    last_write_s: float
    last_bytes: int
    last_durable_time: float | None


def process_age_seconds() -> float:
    """Seconds since this process was started (by torchrun or the agent), not since import.

    Linux records the start in ``/proc/self/stat`` in clock ticks since boot; comparing it
    with ``CLOCK_BOOTTIME`` avoids the whole-second ``btime``. Elsewhere: since import.
    A warm-started worker (``agent/warm_worker.py``) counts from when its standby was
    given its rank, which is when a cold worker would have been started.
    """
    started_at = os.environ.get(STARTED_AT_ENV)
    if started_at:
        try:
            return time.time() - float(started_at)
        except ValueError:
            pass
    try:
        stat = Path("/proc/self/stat").read_text()
        start_ticks = int(stat[stat.rindex(")") + 2:].split()[19])  # field 22, starttime
        return time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return time.monotonic() - _IMPORTED_AT


def package_version() -> str:
    try:
        return metadata.version("elastic-trainer")
    except metadata.PackageNotFoundError:
        return "unknown"


class WorkerMetrics:
    """Progress, snapshot and recovery metrics of one rank (collectives: ``collective()``)."""

    def __init__(self, rank: int, world_size: int, *, backend: str, device: str, torch_version: str,
                 restart_count: int | None = None, fam: Families | None = None) -> None:
        f = fam or families()
        self.families = f
        label = str(rank)
        self.rank = rank
        self._steps = f.steps.labels(label)
        self._samples = f.samples.labels(label)
        self._step_duration = f.step_duration.labels(label)
        self._data_wait = f.data_wait.labels(label)
        self._last_step = f.last_step_timestamp.labels(label)
        self._loss = f.loss.labels(label)
        self._tokens: Any = None  # bound on first use: no series for jobs without tokens
        self._first_step_seen = False
        if restart_count is None:
            restart_count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        f.world_size.set(world_size)
        f.rank.labels(label).set(rank)
        f.worker_restarts.set(restart_count)
        f.build_info.labels(package_version(), torch_version, backend, device).set(1)

    # ------------------------------------------------------------------ steps

    def step_done(self, local_samples: int, step_seconds: float, data_wait_seconds: float,
                  loss: float | None = None, tokens: int | None = None) -> None:
        """After every committed step; ``loss`` None leaves the gauge at its last value."""
        self._steps.inc()
        if local_samples:
            self._samples.inc(local_samples)
        self._step_duration.observe(step_seconds)
        self._data_wait.observe(data_wait_seconds)
        self._last_step.set(time.time())
        if loss is not None:
            self._loss.set(loss)
        if tokens:
            if self._tokens is None:
                self._tokens = self.families.tokens.labels(str(self.rank))
            self._tokens.inc(tokens)
        if not self._first_step_seen:
            self._first_step_seen = True
            self.families.time_to_first_step.set(process_age_seconds())

    def set_loss(self, loss: float) -> None:
        self._loss.set(loss)

    def world_changed(self, world_size: int) -> None:
        self.families.world_size.set(world_size)

    def rank_changed(self, rank: int, world_size: int) -> None:
        """In place, a surviving process may get a new rank: its series follow it.

        Counters and histograms continue under the new label (the old one keeps its total,
        so ``rate()`` over ranks is unaffected).
        """
        if rank == self.rank:
            self.world_changed(world_size)
            return
        f, label = self.families, str(rank)
        self.rank = rank
        self._steps = f.steps.labels(label)
        self._samples = f.samples.labels(label)
        self._step_duration = f.step_duration.labels(label)
        self._data_wait = f.data_wait.labels(label)
        self._last_step = f.last_step_timestamp.labels(label)
        self._loss = f.loss.labels(label)
        self._tokens = None
        f.rank.labels(label).set(rank)
        self.world_changed(world_size)

    def healed(self, seconds: float, transferred_bytes: int) -> None:
        self.families.heal.set(seconds)
        if transferred_bytes:
            self.families.heal_bytes.inc(transferred_bytes)

    # ------------------------------------------------------------------ snapshots and recovery

    def restored(self, seconds: float, snapshot_written_at: float | None = None) -> None:
        """Start-up restore took ``seconds``; the snapshot found (if any) was durable at that time."""
        self.families.restore.set(seconds)
        if snapshot_written_at:
            self.families.snapshot_last_durable.set(snapshot_written_at)

    def snapshot_stalled(self, seconds: float) -> None:
        self.families.snapshot_stall.observe(seconds)

    def snapshot_skipped(self) -> None:
        """A due snapshot was skipped (overlap policy): rising means the disk cannot keep up."""
        self.families.snapshots_skipped.inc()

    def snapshot_durable(self, stats: DurableStats) -> None:
        """The writer's ``on_durable`` callback (runs on the writer thread)."""
        f = self.families
        f.snapshot_write.observe(stats.last_capture_s + stats.last_write_s)
        f.snapshot_bytes.inc(stats.last_bytes)
        if stats.last_durable_time is not None:
            f.snapshot_last_durable.set(stats.last_durable_time)
