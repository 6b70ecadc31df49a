"""``ElasticRun``: a plain training loop that survives node loss and world-size changes.

    run = ElasticRun(model, optimizer, dataset, global_batch_size=64, epochs=10,
                     snapshot_dir="/shared/ckpt/job1")
    for x, y in run:                       # this rank's share of the next global batch
        loss = loss_fn(run.model(x), y)    # mean over the local batch, as usual
        run.step(loss)                     # backward, all-reduce, optimizer, commit, snapshot

What happens, top to bottom:

1. **Start.** Join the process group (torchrun's env; nccl with CUDA, gloo without),
   check that every rank sees the snapshot directory, let rank 0 pick the newest valid
   snapshot and broadcast its step, restore it on every rank (model, optimizer, scheduler,
   scaler, sampler, step, RNG) and verify by all-gather that all ranks stand on one step.
2. **Each step.** The sampler hands this rank its contiguous share of the next global
   batch. The loss is rescaled by ``local_n / global_n`` so that the sum over ranks equals
   the mean over the global batch, uneven splits included (the metrics' comm hook sums;
   without it DDP averages and the scale is ``local_n * world / global_n``); a rank whose share
   is empty (the epoch's tail) trains on one stand-in sample with its loss scaled by zero,
   so it still joins the all-reduce and contributes an exact zero. Every RNG (torch, Python,
   NumPy) is reseeded from ``(seed, step, rank)`` before each step, so dropout and random
   augmentation do not depend on how often, or at which step, a process restarted.
3. **Commit.** After ``optimizer.step`` the step is committed: the sampler cursor moves, rank
   0 appends to the ledger and, every N steps / T seconds, hands a snapshot to the
   background writer (which must finish copying before the next ``optimizer.step``).
4. **End.** After the last step a final snapshot is written and flushed. On SIGTERM
   (torchrun stopping its workers) the loop stops at the next step boundary, flushes the
   pending snapshot, releases the process group and exits with 128 + 15.

Metrics (``elastic.metrics``, on unless ``metrics=False``): progress per step, DDP's gradient
all-reduce through a timing comm hook, snapshot stall/write/bytes, restore time and time to
the first step; exported as ``docs/metrics.md`` describes.
"""

from __future__ import annotations

import faulthandler
import logging
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset

from checkpoints import (
    AsyncSnapshotWriter,
    SnapshotError,
    SnapshotStore,
    capture_rng_state,
    check_state_compatible,
    restore_rng_state,
)

from .distributed import (
    DEFAULT_COLLECTIVE_TIMEOUT_S,
    DistInfo,
    ElasticRunError,
    all_gather_ints,
    broadcast_int,
    check_shared_dir,
    init_distributed,
)
from .heartbeat import Heartbeat
from .ledger import Ledger, LedgerError
from .sampler import ElasticSampler, epoch_seed, split_sizes

if TYPE_CHECKING:
    from .metrics.training import TrainingMetrics

log = logging.getLogger(__name__)

BatchPolicy = Literal["fixed-global", "fixed-per-rank"]


@dataclass(frozen=True)
class StepInfo:
    """What ``on_step_end`` receives after every committed step, on every rank.

    ``loss`` is this rank's unscaled loss, detached; ``float(info.loss)`` synchronises
    with the GPU, so a metrics hook should do it only when it actually exports.
    """

    step: int
    epoch: int
    samples: int  # in this step's global batch
    total_samples: int  # committed since the job began, across incarnations
    local_samples: int
    loss: torch.Tensor
    step_seconds: float
    data_wait_seconds: float
    world_size: int
    rank: int
    node: str


def step_seed(seed: int, step: int, rank: int) -> int:
    return epoch_seed(epoch_seed(seed, step), rank)


def seed_everything(seed: int) -> None:
    """torch (CPU and CUDA), Python's ``random`` and NumPy's global RNG, if NumPy is loaded.

    Not ``torch.manual_seed``: on a machine without CUDA it also queues a lazy CUDA, XPU and
    MTIA seeding, each with a formatted stack trace, every call (0.75 ms per step, 2 % of a
    small CPU step). Devices other than CPU and CUDA are not trained on here.
    """
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)  # immediate once CUDA is initialised, as it is by the first step
    random.seed(seed)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(seed % (1 << 32))


class _LocalBatches:
    """Batch sampler for one epoch from a given cursor: pure, so a DataLoader may prefetch."""

    def __init__(self, order: torch.Tensor, cursor: int, batch_size: int, rank: int, world: int) -> None:
        self.order, self.cursor, self.batch_size, self.rank, self.world = order, cursor, batch_size, rank, world

    def __iter__(self) -> Iterator[list[int]]:
        cursor, n = self.cursor, len(self.order)
        while cursor < n:
            batch = self.order[cursor:cursor + self.batch_size]
            sizes = split_sizes(len(batch), self.world)
            start = sum(sizes[:self.rank])
            local = batch[start:start + sizes[self.rank]]
            yield (local if len(local) else batch[:1]).tolist()  # stand-in sample, loss x 0
            cursor += len(batch)

    def __len__(self) -> int:
        return -(-(len(self.order) - self.cursor) // self.batch_size)


class ElasticRun:
    """Fault-tolerant DDP loop over ``dataset``; iterate it and call ``step(loss)`` per batch.

    ``global_batch_size`` stays the same at every world size by default (each rank gets
    ``global / world``, uneven splits allowed). ``batch_policy="fixed-per-rank"`` instead
    keeps ``per_rank_batch_size`` and scales the learning rate linearly with the resulting
    global batch (``lr * per_rank * world / global_batch_size``).

    The loss passed to ``step`` must be the *mean* over the local batch (the default of
    torch's losses). BatchNorm statistics stay per rank, so models with BatchNorm match
    across world sizes only up to those statistics (use SyncBatchNorm for exactness).

    ``metrics=False`` records no metrics and installs no comm hook (the overhead bench's
    baseline). ``count_tokens(batch) -> int`` feeds ``elastic_tokens_total``; it runs on the
    host-side batch before it moves to the device, so keep it cheap (e.g. ``numel()``).
    ``snapshot_writer`` picks where rank 0 writes snapshots: a writer process at idle
    priority (the default; until it is up, a thread writes), or a thread of the trainer,
    whose GIL hand-offs cost a small CPU step a few percent (docs/BENCHMARKS.md).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        dataset: Dataset[Any],
        *,
        global_batch_size: int,
        snapshot_dir: str | Path,
        steps: int | None = None,
        epochs: int | None = None,
        scheduler: Any = None,
        scaler: Any = None,
        seed: int = 0,
        batch_policy: BatchPolicy = "fixed-global",
        per_rank_batch_size: int | None = None,
        snapshot_every_steps: int | None = 100,
        snapshot_every_seconds: float | None = None,
        keep_snapshots: int = 3,
        backend: str = "auto",
        collective_timeout: float = DEFAULT_COLLECTIVE_TIMEOUT_S,
        ledger: str | Path | None = None,
        on_step_end: Callable[[StepInfo], None] | None = None,
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        max_grad_norm: float | None = None,
        handle_sigterm: bool = True,
        snapshot_meta: dict[str, Any] | None = None,
        metrics: bool = True,
        count_tokens: Callable[[Any], int] | None = None,
        snapshot_writer: Literal["process", "thread"] = "process",
    ) -> None:
        if steps is None and epochs is None:
            raise ElasticRunError("give steps= or epochs= (or both; the run stops at whichever comes first)")
        if global_batch_size < 1:
            raise ElasticRunError(f"global batch size must be >= 1, got {global_batch_size}")
        if batch_policy not in ("fixed-global", "fixed-per-rank"):
            raise ElasticRunError(f"unknown batch policy {batch_policy!r}; use fixed-global or fixed-per-rank")
        if batch_policy == "fixed-per-rank" and not per_rank_batch_size:
            raise ElasticRunError("batch policy fixed-per-rank needs a per-rank batch size")
        self.steps_target, self.epochs_target = steps, epochs
        self.global_batch_size, self.batch_policy = global_batch_size, batch_policy
        self.per_rank_batch_size = per_rank_batch_size
        self.seed, self.scheduler, self.scaler = seed, scheduler, scaler
        self.snapshot_every_steps, self.snapshot_every_seconds = snapshot_every_steps, snapshot_every_seconds
        self.on_step_end, self.max_grad_norm = on_step_end, max_grad_norm
        self.dataset, self.num_workers, self.collate_fn = dataset, num_workers, collate_fn
        self.snapshot_meta = dict(snapshot_meta or {})
        self.count_tokens = count_tokens
        self._tokens: int | None = None
        self._stop_signal: int | None = None
        if handle_sigterm and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_sigterm)

        self._owns_process_group = not dist.is_initialized()  # a caller's group is the caller's to destroy
        self.dist: DistInfo = init_distributed(backend, collective_timeout)
        d = self.dist
        self._where = f"[{d.node} rank {d.rank}]"
        self.metrics: TrainingMetrics | None = self._start_metrics() if metrics else None
        self.optimizer = optimizer
        self.sampler = ElasticSampler(len(dataset), seed=seed)  # type: ignore[arg-type]
        self.step_count, self.total_samples, self.resumed_from = 0, 0, 0
        self._module = model.to(d.device)
        self.ledger: Ledger | None = None
        self.store, self.writer = self._open_store(Path(snapshot_dir), keep_snapshots, ledger, snapshot_writer)
        self._restore()
        self.model: nn.Module = DistributedDataParallel(
            self._module, device_ids=[d.local_rank] if d.device.type == "cuda" else None
        )
        # the hook sums and step() puts 1/world into the loss; without the hook DDP averages
        self._ddp_averages = (self.metrics.attach(self.model, average=False)  # type: ignore[arg-type]
                              if self.metrics is not None else True)
        self._last_snapshot_time = time.monotonic()
        self._pending: tuple[list[int], int] | None = None  # (global batch ids, local n) between yield and step()
        self._step_started = self._data_wait = 0.0
        self._closed = False
        self._heartbeat = Heartbeat.from_env()  # the agent's hang watchdog reads it
        if self._heartbeat is not None and threading.current_thread() is threading.main_thread():
            faulthandler.register(signal.SIGUSR1, all_threads=True)  # the watchdog's stack dump

    # ------------------------------------------------------------------ start

    def _start_metrics(self) -> "TrainingMetrics":
        from .metrics.export import MetricsConfigError
        from .metrics.training import TrainingMetrics

        try:
            return TrainingMetrics(self.dist)
        except MetricsConfigError as e:
            raise ElasticRunError(str(e)) from None

    def _open_store(
        self, root: Path, keep: int, ledger: str | Path | None, writer_mode: Literal["process", "thread"]
    ) -> tuple[SnapshotStore, AsyncSnapshotWriter | None]:
        """Rank 0 opens what only it writes; a failure there is broadcast so every rank stops."""
        d = self.dist
        problem = ""
        store: SnapshotStore | None = None
        if d.is_main:
            try:
                store = SnapshotStore(root, keep=keep)
                self.ledger = Ledger(ledger) if ledger is not None else None
            except (SnapshotError, LedgerError) as e:
                problem = str(e)
        if broadcast_int(int(bool(problem)), d):
            raise ElasticRunError(problem or f"rank 0 cannot open its snapshot directory {root} or ledger; see rank 0's log")
        check_shared_dir(root, d)
        if store is None:
            store = SnapshotStore(root, keep=keep, create=False)
        on_durable = self.metrics.snapshot_durable if self.metrics is not None else None
        # The writer process imports torch when a worker starts; until it is ready a thread
        # writes, so the first snapshot after a restart never waits for that import.
        writer = (AsyncSnapshotWriter(store, overlap_policy="skip", on_durable=on_durable, mode=writer_mode)
                  if d.is_main else None)
        return store, writer

    def _restore(self) -> None:
        """Rank 0 picks the newest valid snapshot; every rank loads exactly that one."""
        d = self.dist
        t0 = time.perf_counter()
        found = self.store.load_latest() if d.is_main else None
        step = broadcast_int(found[0].step if found else -1, d)
        if step >= 0:
            state = found[1] if found else self.store.load(step)
            self._load_state(state)
            if d.is_main:
                info = found[0]  # type: ignore[index]
                log.info(
                    "%s world %d (%s, %s): resumed from snapshot step %d (epoch %d, %d samples into it), "
                    "written at world size %d", self._where, d.world_size, d.backend, d.device.type,
                    step, self.sampler.epoch, self.sampler.cursor, info.world_size,
                )
        elif d.is_main:
            log.info("%s world %d (%s, %s): no snapshot in %s, starting from scratch",
                     self._where, d.world_size, d.backend, d.device.type, self.store.root)
        steps = all_gather_ints(self.step_count, d)
        if len(set(steps)) != 1:
            raise ElasticRunError(
                f"ranks restored different steps {steps}; the snapshot directory changed under the job - "
                "make sure only this job writes to it"
            )
        self.resumed_from = self.step_count
        if self.metrics is not None:
            self.metrics.restored(time.perf_counter() - t0, found[0].written_at if found else None)

    def _load_state(self, state: dict[str, Any]) -> None:
        check_state_compatible(self._module.state_dict(), state["model"], "model")
        self._module.load_state_dict(state["model"])
        try:
            self.optimizer.load_state_dict(state["optimizer"])
        except (ValueError, KeyError) as e:
            raise ElasticRunError(
                f"snapshot optimizer does not match this optimizer ({e}); resume with the same optimizer "
                "or start with an empty snapshot directory"
            ) from None
        for name, obj in (("scheduler", self.scheduler), ("scaler", self.scaler)):
            if obj is not None and name in state:
                obj.load_state_dict(state[name])
        try:
            self.sampler.load_state_dict(state["sampler"])
        except ValueError as e:
            raise ElasticRunError(str(e)) from None
        progress = state["progress"]
        self.step_count, self.total_samples = int(progress["step"]), int(progress["samples"])
        restore_rng_state(state["rng"])

    # ------------------------------------------------------------------ loop

    @property
    def done(self) -> bool:
        return (self.steps_target is not None and self.step_count >= self.steps_target) or (
            self.epochs_target is not None and self.sampler.epoch >= self.epochs_target
        )

    def _batch_size(self) -> int:
        if self.batch_policy == "fixed-per-rank":
            return int(self.per_rank_batch_size) * self.dist.world_size  # type: ignore[arg-type]
        return self.global_batch_size

    def __iter__(self) -> Iterator[Any]:
        d = self.dist
        try:
            while not self.done:
                batch_size = self._batch_size()
                batches = _LocalBatches(self.sampler.order(), self.sampler.cursor, batch_size, d.rank, d.world_size)
                loader = DataLoader(
                    self.dataset, batch_sampler=batches, num_workers=self.num_workers,
                    collate_fn=self.collate_fn, pin_memory=d.device.type == "cuda",
                )
                epoch = self.sampler.epoch
                t0 = time.perf_counter()
                for batch in loader:
                    ids = self.sampler.global_batch(batch_size)
                    start, stop = self.sampler.local_range(len(ids), d.rank, d.world_size)
                    self._pending = (ids, stop - start)
                    seed_everything(step_seed(self.seed, self.step_count, d.rank))
                    if self.count_tokens is not None:
                        self._tokens = self.count_tokens(batch)
                    batch = self._to_device(batch)
                    self._step_started = t0
                    self._data_wait = time.perf_counter() - t0
                    yield batch
                    if self._pending is not None:
                        raise ElasticRunError("call run.step(loss) exactly once for every batch the run yields")
                    if self._stop_signal is not None:
                        self._stop_on_signal()
                    if self.done or self.sampler.epoch != epoch:
                        break
                    t0 = time.perf_counter()
            self._final_snapshot()
        finally:
            self.close()

    def _to_device(self, batch: Any) -> Any:
        if self.dist.device.type == "cpu":
            return batch
        if isinstance(batch, torch.Tensor):
            return batch.to(self.dist.device, non_blocking=True)
        if isinstance(batch, (list, tuple)):
            return type(batch)(self._to_device(b) for b in batch)
        if isinstance(batch, dict):
            return {k: self._to_device(v) for k, v in batch.items()}
        return batch

    def step(self, loss: torch.Tensor) -> None:
        """Backward, all-reduce, optimizer step, then commit the step (ledger, snapshot, hook)."""
        if self._pending is None:
            raise ElasticRunError("run.step(loss) called without a batch; call it once per batch of the loop")
        ids, local_n = self._pending
        d = self.dist
        scale = local_n * (d.world_size if self._ddp_averages else 1) / len(ids)
        scaled = loss if scale == 1.0 else loss * scale
        if self.scaler is not None:
            self.scaler.scale(scaled).backward()
        else:
            scaled.backward()
        if self.max_grad_norm is not None:
            if self.scaler is not None:
                self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self._module.parameters(), self.max_grad_norm)
        if self.writer is not None:
            t_wait = time.perf_counter()
            self.writer.wait_capture()  # the snapshot's copy of params must predate this update
            if self.metrics is not None:
                self.metrics.capture_waited(time.perf_counter() - t_wait)
        self._optimizer_step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()
        epoch = self.sampler.epoch
        self.sampler.advance(len(ids))
        self.step_count += 1
        self.total_samples += len(ids)
        self._pending = None
        if self._heartbeat is not None:
            self._heartbeat.beat(self.step_count)
        if self.ledger is not None:
            self.ledger.record(epoch=epoch, step=self.step_count, world_size=d.world_size, samples=ids,
                               resumed_from=self.resumed_from)
        self._maybe_snapshot()
        now = time.perf_counter()
        if self.metrics is not None:
            self.metrics.step_done(local_n, now - self._step_started, self._data_wait, loss, self._tokens)
        if self.on_step_end is not None:
            self.on_step_end(StepInfo(
                step=self.step_count, epoch=epoch, samples=len(ids), total_samples=self.total_samples,
                local_samples=local_n, loss=loss.detach(), step_seconds=now - self._step_started,
                data_wait_seconds=self._data_wait, world_size=d.world_size, rank=d.rank, node=d.node,
            ))

    def _optimizer_step(self) -> None:
        saved: list[float] = []
        if self.batch_policy == "fixed-per-rank":  # linear scaling rule (nominal batch), around the step only
            lr_scale = self._batch_size() / self.global_batch_size
            for group in self.optimizer.param_groups:
                saved.append(group["lr"])
                group["lr"] = group["lr"] * lr_scale
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        for group, lr in zip(self.optimizer.param_groups, saved):
            group["lr"] = lr  # exact restore: schedulers and snapshots see the unscaled value

    # ------------------------------------------------------------------ snapshots

    def state(self) -> dict[str, Any]:
        """Everything a restart needs, as tensors and plain numbers."""
        state: dict[str, Any] = {
            "model": self._module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "sampler": self.sampler.state_dict(),
            "progress": {"step": self.step_count, "samples": self.total_samples},
            "rng": capture_rng_state(),
        }
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler.state_dict()
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        return state

    def _meta(self) -> dict[str, Any]:
        return {**self.snapshot_meta, "epoch": self.sampler.epoch, "cursor": self.sampler.cursor,
                "samples": self.total_samples}

    def _maybe_snapshot(self) -> None:
        if self.writer is None or self.done:
            return  # the last step gets its own, flushed snapshot
        by_steps = bool(self.snapshot_every_steps) and self.step_count % self.snapshot_every_steps == 0  # type: ignore[operator]
        by_time = self.snapshot_every_seconds is not None and (
            time.monotonic() - self._last_snapshot_time >= self.snapshot_every_seconds
        )
        if by_steps or by_time:
            if self.ledger is not None:
                self.ledger.sync()  # ledger lines up to this step outlive a machine crash
            t0 = time.perf_counter()
            if self.writer.submit(self.step_count, self.state(), world_size=self.dist.world_size,
                                  extra_meta=self._meta()):
                self._last_snapshot_time = time.monotonic()
                if self.metrics is not None:
                    self.metrics.snapshot_submitted(time.perf_counter() - t0)
            elif self.metrics is not None:
                self.metrics.snapshot_skipped()

    def _final_snapshot(self) -> None:
        if self.writer is None:
            return
        self.writer.flush()  # so the overlap policy cannot skip the last one
        if self.ledger is not None:
            self.ledger.sync()
        self.writer.submit(self.step_count, self.state(), world_size=self.dist.world_size, extra_meta=self._meta())
        self.writer.flush()
        log.info("%s finished at step %d (epoch %d); final snapshot durable in %s",
                 self._where, self.step_count, self.sampler.epoch, self.store.root)

    # ------------------------------------------------------------------ shutdown

    def _on_sigterm(self, signum: int, _frame: Any) -> None:
        if self._stop_signal is not None:
            raise SystemExit(128 + signum)  # second signal: stop waiting for the step boundary
        self._stop_signal = signum

    def _stop_on_signal(self) -> None:
        signum = self._stop_signal or signal.SIGTERM
        if self.dist.is_main:
            pending = self.writer.pending_step if self.writer else None
            log.info("%s got signal %d: stopping at step %d%s", self._where, signum, self.step_count,
                     f", flushing snapshot step {pending}" if pending is not None else "")
        self.close()
        raise SystemExit(128 + signum)

    def close(self) -> None:
        """Flush the pending snapshot, close the ledger, leave the process group if we joined it."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.writer is not None:
                self.writer.close()
        finally:
            if self.ledger is not None:
                self.ledger.close()
            if self._owns_process_group and dist.is_initialized():
                dist.destroy_process_group()

    def __enter__(self) -> "ElasticRun":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

