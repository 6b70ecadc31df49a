"""One rank's metrics handle: labels bound once, so a step costs a handful of locked adds."""

from __future__ import annotations

import os
import socket
import time
from importlib import metadata
from pathlib import Path
from typing import Any, Mapping, Protocol

from prometheus_client import values

from .. import worker_env
from .catalogue import RETIRED, Families, families
from .rank_info import RankInfo, dcgm_hostname
from .step_split import StepSplit

_IMPORTED_AT = time.monotonic()


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
    A warm-started worker (``agent/worker/warm_worker.py``) counts from when its standby was
    given its rank, which is when a cold worker would have been started.
    """
    started_at = worker_env.read().started_at  # a warm-started worker's (agent/worker/warm_worker.py)
    if started_at is not None:
        return time.time() - started_at
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


def default_identity(rank: int, environ: Mapping[str, str] = os.environ) -> RankInfo:
    """This process's rank info from torchrun's environment; no GPU (``TrainingMetrics`` knows it).

    The node as ``elastic.distributed.node_name`` has it: the agent's name, else the host's.
    """
    env = worker_env.read(environ)
    return RankInfo(rank, env.me.local_rank, env.node.node_name or socket.gethostname(), dcgm_hostname(environ))


class WorkerMetrics:
    """Progress, snapshot and recovery metrics of one rank (collectives: ``collective()``)."""

    def __init__(self, rank: int, world_size: int, *, backend: str, device: str, torch_version: str,
                 restart_count: int | None = None, fam: Families | None = None,
                 identity: RankInfo | None = None) -> None:
        f = fam or families()
        self.families = f
        self.rank = rank
        self.identity = identity if identity is not None else default_identity(rank)
        if self.identity.rank != rank:
            raise ValueError(f"identity is of rank {self.identity.rank}, not {rank}")
        self._tokens: Any = None  # bound on first use: no series for jobs without tokens
        self._bind(str(rank))
        self._first_step_seen = False
        self._split = StepSplit()
        if restart_count is None:
            restart_count = worker_env.read().me.restart_count
        f.world_size.set(world_size)
        f.rank.labels(str(rank)).set(rank)
        f.rank_info.labels(*self.identity.labels()).set(1)
        f.worker_restarts.set(restart_count)
        f.build_info.labels(package_version(), torch_version, backend, device).set(1)
        f.sdc_mismatches.labels(node=self.identity.node)  # served at 0 from the start: rate() and alerts see it

    def _bind(self, label: str) -> None:
        f = self.families
        self._steps = f.steps.labels(label)
        self._samples = f.samples.labels(label)
        # histograms at the first step under this rank: a joiner's set-up world is rank 0 for a
        # moment, and a histogram bound then read 0/0 under rank 0 for good (a NaN row in the
        # p50 and straggler-ratio rules beside the rank that does train there)
        self._step_duration: Any = None
        self._data_wait: Any = None
        self._split_label = label  # the split's gauges are bound at its first figure: no 0 that reads as a pace
        self._compute: Any = None
        self._collective_wait: Any = None
        self._last_step = f.last_step_timestamp.labels(label)
        self._loss = f.loss.labels(label)
        if self._tokens is not None:
            self._tokens = f.tokens.labels(label)

    # ------------------------------------------------------------------ rank

    def rank_changed(self, rank: int, world_size: int) -> None:
        """This process now holds ``rank`` of ``world_size`` (in-place recovery, no restart).

        The old rank's live series go: its info and gauges (``elastic_rank``, last step,
        loss) are removed, or in multiprocess mode overwritten with their :data:`RETIRED`
        value, which the agent's endpoint leaves out. Counters and histograms count on
        under the new rank, the old rank's stay flat, as after a restart. Call it once the
        new membership is known and before the first step in it.
        """
        f = self.families
        old, new = str(self.rank), str(rank)
        info = RankInfo(rank, self.identity.local_rank, self.identity.node, self.identity.hostname,
                        self.identity.gpu_uuid)
        if rank != self.rank:
            for gauge in (f.rank, f.last_step_timestamp, f.loss, f.step_compute, f.step_collective_wait):
                _retire(gauge, (old,))
        self._split.reset()  # a new world: the old pace is not this one's
        if info != self.identity:
            _retire(f.rank_info, self.identity.labels())
        self.rank, self.identity = rank, info
        self._bind(new)
        f.rank.labels(new).set(rank)
        f.rank_info.labels(*info.labels()).set(1)
        f.world_size.set(world_size)

    # ------------------------------------------------------------------ steps

    def step_done(self, local_samples: int, step_seconds: float, data_wait_seconds: float,
                  loss: float | None = None, tokens: int | None = None, collective_seconds: float = 0.0,
                  snapshot_seconds: float = 0.0) -> None:
        """After every committed step; ``loss`` None leaves the gauge at its last value.
        ``collective_seconds``: the step's time in the gradient all-reduce (the comm hook's);
        ``snapshot_seconds``: its snapshot stall (submit, capture wait). Neither is the rank's pace."""
        self._steps.inc()
        split = self._split.add(step_seconds, data_wait_seconds, collective_seconds, snapshot_seconds)
        if split is not None:
            if self._compute is None:
                self._compute = self.families.step_compute.labels(self._split_label)
                self._collective_wait = self.families.step_collective_wait.labels(self._split_label)
            self._compute.set(split.compute)
            self._collective_wait.set(split.collective)
        if local_samples:
            self._samples.inc(local_samples)
        if self._step_duration is None:
            self._step_duration = self.families.step_duration.labels(self._split_label)
            self._data_wait = self.families.data_wait.labels(self._split_label)
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

    def state_from(self, source: str) -> None:
        """disk | replica | peer-memory | memory | fresh: where this worker's state came from at its latest world."""
        self.families.restores.labels(source).inc()

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


def _retire(gauge: Any, labels: tuple[str, ...]) -> None:
    """Make one labelled sample of ``gauge`` disappear from what is served.

    Served from this process (``ELASTIC_METRICS_PORT``): ``remove()`` does it. Written to
    multiprocess files: the value stays in this pid's file whatever ``remove()`` does, so
    overwrite it with the family's retired value, which the agent's collector drops.
    """
    if values.ValueClass is values.MutexValue:  # decided by prometheus_client at import, from the env
        gauge.remove(*labels)
    else:
        (family,) = gauge.describe()
        gauge.labels(*labels).set(RETIRED[family.name])
