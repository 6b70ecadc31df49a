"""What ``ElasticRun`` records, behind the few calls it makes; the trainer stays about training."""

from __future__ import annotations

import os
from typing import Protocol

import torch
from torch.nn.parallel import DistributedDataParallel

from .. import contract
from ..distributed import DistInfo
from .comm_hook import OP_ALLREDUCE, CollectiveTimer, register_comm_hook
from .export import Export, start_export
from .rank_info import RankInfo, dcgm_hostname, gpu_uuid_label, visible_token
from .worker import DurableStats, WorkerMetrics


class LossReader:
    """``float(loss)`` without synchronising the GPU.

    A CUDA loss is copied into pinned memory behind an event; the value is read at a later
    step once the event has passed, so the gauge lags by a step or so on CUDA and is exact
    and immediate on the CPU.
    """

    def __init__(self) -> None:
        self._host: torch.Tensor | None = None
        self._event: torch.cuda.Event | None = None

    def __call__(self, loss: torch.Tensor) -> float | None:
        if not loss.is_cuda:
            return float(loss.detach())
        value = None
        if self._event is not None:
            if not self._event.query():
                return None  # still in flight: keep the older reading, enqueue nothing new
            value = float(self._host)  # type: ignore[arg-type]  # set together with _event
        if self._host is None:
            self._host = torch.empty((), dtype=torch.float32, pin_memory=True)
            self._event = torch.cuda.Event()
        self._host.copy_(loss.detach().reshape(()).float(), non_blocking=True)
        self._event.record()  # type: ignore[union-attr]  # set together with _host
        return value


def cuda_gpu_uuid(device: torch.device) -> str:
    """The uuid of the GPU ``device`` as DCGM's ``UUID`` label holds it; "" off NVIDIA CUDA.

    CUDA's own answer for the device this worker trains on, so it is right whatever
    ``CUDA_VISIBLE_DEVICES`` or the device order say. CUDA is already initialised here
    (``init_distributed`` set the device).
    """
    if device.type != "cuda" or torch.version.hip is not None:
        return ""
    index = device.index if device.index is not None else torch.cuda.current_device()
    token = visible_token(os.environ.get("CUDA_VISIBLE_DEVICES"), index) or ""
    return gpu_uuid_label(str(torch.cuda.get_device_properties(index).uuid), mig=token.startswith("MIG-"))


def rank_identity(info: DistInfo) -> RankInfo:
    return RankInfo(info.rank, info.local_rank, info.node, dcgm_hostname(), cuda_gpu_uuid(info.device))




def collective_metrics_enabled() -> bool:
    """Per-bucket all-reduce timing needs a Python DDP comm hook (under 1 % of a small CPU
    step here, docs/BENCHMARKS.md); ``ELASTIC_COLLECTIVE_METRICS=0`` opts out of it."""
    return os.environ.get(contract.COLLECTIVE_METRICS_ENV, "1").strip().lower() not in ("0", "off", "false", "no")


class MetricsLike(Protocol):
    """What the trainer calls; :class:`TrainingMetrics` records, :class:`NoMetrics` does nothing."""

    def attach(self, model: DistributedDataParallel, *, average: bool = True) -> bool: ...
    def restored(self, seconds: float, snapshot_written_at: float | None) -> None: ...
    def healed(self, seconds: float, transferred_bytes: int) -> None: ...
    def state_from(self, source: str) -> None: ...
    def sdc_mismatch(self, node: str) -> None: ...
    def world_changed(self, rank: int, world_size: int) -> None: ...
    def snapshot_submitted(self, seconds: float) -> None: ...
    def snapshot_skipped(self) -> None: ...
    def capture_waited(self, seconds: float) -> None: ...
    def commit_took(self, seconds: float) -> None: ...
    def peer_copied(self, seconds: float, moved_bytes: int, held_bytes: int) -> None: ...
    def peer_copy_lag(self, steps: int) -> None: ...
    def step_done(self, local_samples: int, step_seconds: float, data_wait_seconds: float,
                  loss: torch.Tensor | None, tokens: int | None) -> None: ...


class NoMetrics:
    """``metrics=False``: the same calls, nothing recorded, no comm hook (DDP averages)."""

    snapshot_durable = None

    def attach(self, model: DistributedDataParallel, *, average: bool = True) -> bool:
        return True

    def restored(self, seconds: float, snapshot_written_at: float | None) -> None:
        pass

    def healed(self, seconds: float, transferred_bytes: int) -> None:
        pass

    def state_from(self, source: str) -> None:
        pass

    def sdc_mismatch(self, node: str) -> None:
        pass

    def world_changed(self, rank: int, world_size: int) -> None:
        pass

    def snapshot_submitted(self, seconds: float) -> None:
        pass

    def snapshot_skipped(self) -> None:
        pass

    def capture_waited(self, seconds: float) -> None:
        pass

    def commit_took(self, seconds: float) -> None:
        pass

    def peer_copied(self, seconds: float, moved_bytes: int, held_bytes: int) -> None:
        pass

    def peer_copy_lag(self, steps: int) -> None:
        pass

    def step_done(self, local_samples: int, step_seconds: float, data_wait_seconds: float,
                  loss: torch.Tensor | None, tokens: int | None) -> None:
        pass


class TrainingMetrics:
    """Progress, collective, snapshot and recovery metrics of one ``ElasticRun``."""

    def __init__(self, info: DistInfo) -> None:
        self.export: Export = start_export(info.local_rank)  # before any value exists (multiprocess dir)
        self.worker = WorkerMetrics(info.rank, info.world_size, backend=info.backend, device=info.device.type,
                                    torch_version=torch.__version__, identity=rank_identity(info))
        self.backend = info.backend
        self.collectives: CollectiveTimer | None = None
        self._sharded: list[CollectiveTimer] = []  # a sharded model's all-gather and reduce-scatter
        self._replicate: CollectiveTimer | None = None  # HSDP's all-reduce across replicas (in place)
        self._loss = LossReader()
        self._stall: float | None = None  # submit time of the snapshot whose capture is in flight
        self._collective_seen = 0.0  # the comm hook's total at the previous step
        # Not the rank's pace (step_split): this step's snapshot submit and capture wait, and
        # the commit of the previous step (rank 0's ledger line and snapshot submit).
        self._submit_s = self._capture_s = self._commit_s = 0.0

    def attach(self, model: DistributedDataParallel, *, average: bool = True) -> bool:
        """Time DDP's gradient all-reduce; before the first backward.

        Returns whether DDP still averages the gradients. ``average=False`` (ElasticRun) makes
        the hook sum, for a caller whose loss already carries ``1 / world``: that saves a pass
        over every bucket (see ``comm_hook``). Without the hook DDP always averages.
        """
        if not collective_metrics_enabled():
            return True
        self.collectives = register_comm_hook(model, self.backend, average=average)
        self._collective_seen = 0.0
        return average

    def attach_sharded(self, model: torch.nn.Module) -> None:
        """Time a sharded model's FSDP2 collectives (:mod:`elastic.metrics.fsdp_timing`)."""
        if collective_metrics_enabled() and not self._sharded:
            from .fsdp_timing import time_fsdp_collectives

            self._sharded = time_fsdp_collectives(model, self.backend)

    def replicate_timer(self) -> CollectiveTimer | None:
        """A timer for HSDP's all-reduce across replicas, which the run issues itself
        (:class:`elastic.inplace.hsdp.HsdpInPlace`); None with collective metrics off."""
        if not collective_metrics_enabled():
            return None
        if self._replicate is None:
            self._replicate = CollectiveTimer(self.backend, op=OP_ALLREDUCE)
        return self._replicate

    def rank_changed(self, rank: int, world_size: int) -> None:
        """In-place recovery gave this process ``rank`` of ``world_size``: its per-rank series follow."""
        self.worker.rank_changed(rank, world_size)

    def restored(self, seconds: float, snapshot_written_at: float | None) -> None:
        self.worker.restored(seconds, snapshot_written_at)

    def healed(self, seconds: float, transferred_bytes: int) -> None:
        self.worker.healed(seconds, transferred_bytes)

    def state_from(self, source: str) -> None:
        self.worker.state_from(source)

    def sdc_mismatch(self, node: str) -> None:
        """A replica check named ``node`` (rank 0 counts, for every node named)."""
        self.worker.families.sdc_mismatches.labels(node=node).inc()

    def world_changed(self, rank: int, world_size: int) -> None:
        self.worker.rank_changed(rank, world_size)

    def snapshot_durable(self, stats: DurableStats) -> None:
        self.worker.snapshot_durable(stats)

    def snapshot_submitted(self, seconds: float) -> None:
        """Training blocked ``seconds`` in ``submit``; the capture wait before the next update adds to it."""
        self._stall = seconds
        self._submit_s += seconds

    def snapshot_skipped(self) -> None:
        self.worker.snapshot_skipped()

    def capture_waited(self, seconds: float) -> None:
        self._capture_s += seconds
        if self._stall is not None:
            self.worker.snapshot_stalled(self._stall + seconds)
            self._stall = None

    def commit_took(self, seconds: float) -> None:
        """Committing the previous step took ``seconds`` of this one: rank 0's ledger line and
        snapshot submit, work no other rank does. Counted in a rank's pace, it made rank 0 of
        a job of short steps look 2-4x slower than its peers, and evicted as a straggler."""
        self._commit_s += seconds

    def peer_copied(self, seconds: float, moved_bytes: int, held_bytes: int) -> None:
        """A peer copy completed (:mod:`elastic.inplace.peer_copies`)."""
        f = self.worker.families
        f.peer_copy.set(seconds)
        f.peer_copy_bytes.inc(moved_bytes)
        f.peer_copy_host.set(held_bytes)

    def peer_copy_lag(self, steps: int) -> None:
        self.worker.families.peer_copy_lag.set(steps)

    def step_done(self, local_samples: int, step_seconds: float, data_wait_seconds: float,
                  loss: torch.Tensor | None, tokens: int | None) -> None:
        """``loss`` None: a loop that runs its own backward (elastic.prepare); elastic_loss stays unset."""
        collective = 0.0
        timers = ([self.collectives] if self.collectives is not None else []) + self._sharded + \
            ([self._replicate] if self._replicate is not None else [])
        if timers:
            for timer in timers:
                timer.drain()
            total = sum(timer.seconds for timer in timers)
            collective, self._collective_seen = total - self._collective_seen, total
        self.worker.step_done(local_samples, step_seconds, data_wait_seconds, None if loss is None else self._loss(loss), tokens,
                              collective_seconds=collective,
                              snapshot_seconds=max(self._commit_s, self._submit_s) + self._capture_s)  # submit is in the commit
        self._submit_s = self._capture_s = self._commit_s = 0.0
