"""Every rank's side of a sharded snapshot: a short collective at the step, the disk after.

A sharded model's snapshot (:mod:`checkpoints.sharded`) is written by every rank, so every
rank holds one :class:`ShardedWriter`, and every decision that decides whether a rank joins
the snapshot's collectives is taken by all of them alike: a snapshot due while the previous
one is still being written anywhere is skipped everywhere (one small all-reduce says so),
never on one rank alone, which would leave the others waiting in ``dcp.save`` for ever.

Call order, on every rank of the world at the same step: :meth:`ShardedWriter.submit` (the
collective: DCP's plan, then this rank's shards copied into memory), training goes on,
:meth:`~ShardedWriter.flush` where a snapshot must be durable (the last one, a stop).
:meth:`~ShardedWriter.abandon` at every new formation: a peer lost with its shards unwritten
must not hold rank 0's seal until its deadline.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import torch
import torch.distributed as dist

from checkpoints import SnapshotError, SnapshotFencedError, SnapshotStore
from checkpoints.sharded import DeferredDcpWriter, Part
from checkpoints.writer import WriterStats, round_taken_in

from checkpoints.tree import iter_tensors

from .collectives import collective_failures
from .consistency.nonfinite import state_finite
from .distributed import DistInfo
from .host_shards import HostShards

log = logging.getLogger("elastic.snapshots")

#: The model and optimizer keys of a snapshot go to DCP; the rest (sampler, progress, RNG,
#: the loop's state) are rank 0's ordinary files.
DCP_KEYS = ("model", "optimizer")

#: How long rank 0 waits for the slowest rank's shards before it gives the snapshot up.
PART_TIMEOUT_S = 600.0


class PinnedStage:
    """Where a GPU's shards are copied at the step: pinned host buffers, one per item, kept
    from one snapshot to the next (a snapshot is taken only once the previous one is written,
    so they are free again), filled by non-blocking copies on the current stream. The step
    then waits only for the copies to be queued; the optimizer's kernels queue behind them,
    and the background writer waits for :meth:`copied`'s event before it reads a buffer.
    CPU tensors are cloned. Host memory: one copy of this rank's shards, pinned."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}
        self._pending = False

    def stage(self, index: Any, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type != "cuda":
            return tensor.clone()
        key = (index.fqn, tuple(index.offset or ()))
        buf = self._buffers.get(key)
        if buf is None or buf.shape != tensor.shape or buf.dtype != tensor.dtype:
            buf = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self._buffers[key] = buf
        buf.copy_(tensor, non_blocking=True)
        self._pending = True
        return buf

    def copied(self) -> Any:
        """An event recorded behind this snapshot's copies (None: nothing was on a GPU)."""
        if not self._pending:
            return None
        self._pending = False
        event = torch.cuda.Event()
        event.record()
        return event


class ShardedWriter:
    """One rank's sharded snapshots (see the module docstring for the call order)."""

    def __init__(self, store: SnapshotStore, on_durable: Callable[[WriterStats], None] | None = None,
                 part_timeout_s: float = PART_TIMEOUT_S, fence: Any = None) -> None:
        self.store, self.on_durable, self.part_timeout_s = store, on_durable, part_timeout_s
        self.fence = fence  # in place: the world's socket fence (elastic.inplace.fence), which the group joins
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="sharded-snapshot")
        self._future: Future[None] | None = None
        self._abandoned = threading.Event()
        self._errors: collections.deque[BaseException] = collections.deque()
        self._stats = WriterStats()
        self._group: Any = None  # the snapshots' own gloo group in this world (formed)
        self._pinned = PinnedStage()
        self.pending_step: int | None = None
        self.last_submitted: int | None = None  # the same on every rank: submits are decided together
        # rank 0 in place: the newest round whose fence it raised; its seal of an older round's
        # snapshot is then refused by that fence, on its own behalf (as AsyncSnapshotWriter's)
        self.own_round = -1

    @property
    def stats(self) -> WriterStats:
        return dataclasses.replace(self._stats)

    def wait_capture(self) -> None:
        """Nothing to wait for: :meth:`submit` returns with the copy made."""

    def formed(self) -> None:
        """A new world formed (every rank, at the same point): any snapshot still waiting for
        a lost rank is given up, and the next one makes the snapshots' collectives a gloo
        group of their own in this world (:meth:`_own_group`)."""
        self.abandon()
        self._group = None

    def _own_group(self) -> Any:
        """The snapshots' gloo group in this world, made at its first snapshot (every rank, at
        the same step). On the default group they met FSDP2's own (a 1-D mesh over the world
        runs on that very group) and a rank took one collective's answer for another's (seen:
        a rank returned from ``dcp.save`` without its write phase). Made here rather than at
        the formation: in place, the run agrees on the name of the world's next group only
        as it builds HSDP's mesh, after the snapshots attach, and a joiner named it apart
        from the survivors. In place it goes on the world's socket fence: a peer frozen in
        ``dcp.save`` gets the others out at once, as in a step."""
        if self._group is None:
            import contextlib

            with self.fence.adding() if self.fence is not None else contextlib.nullcontext():
                self._group = dist.new_group(backend="gloo")
        return self._group

    def submit(self, step: int, state: dict[str, Any], *, world_size: int, info: DistInfo,
               extra_meta: dict[str, Any] | None = None, host: HostShards | None = None) -> bool:
        """A collective: every rank, at ``step``. False (on every rank) if skipped because an
        earlier snapshot is still being written somewhere. ``host``: this rank's complete host
        copy of ``step`` (:mod:`elastic.host_shards`, the caller's to vouch for): its shards are
        written from it as they are, not copied again; the plan and the files are the same.
        Each rank decides alone: either way it writes the same bytes under the same plan."""
        t0 = time.perf_counter()
        with collective_failures():  # a peer lost here: the step is abandoned, as in its backward
            return self._submit(step, state, world_size, info, dict(extra_meta or {}), t0, host)

    def _submit(self, step: int, state: dict[str, Any], world_size: int, info: DistInfo,
                extra_meta: dict[str, Any], t0: float, host: HostShards | None) -> bool:
        group = self._own_group()
        # with it, whether this rank's shards are finite: a snapshot of a NaN would be the newest,
        # and prune would delete the finite ones behind it (each rank sees only its own shards)
        finite = state_finite(iter_tensors({k: state[k] for k in DCP_KEYS if k in state}))
        busy = torch.tensor([int(self._future is not None and not self._future.done()), int(not finite)])
        dist.all_reduce(busy, op=dist.ReduceOp.MAX, group=group)
        if int(busy[1].item()):
            self._stats.snapshots_skipped += 1
            if info.is_main:
                log.error("not snapshotting step %d: its state holds non-finite values (a NaN or an Inf) in a rank's "
                          "shards; the newest snapshot stays the last finite one", step)
            return False
        if int(busy[0].item()):
            self._stats.snapshots_skipped += 1
            if info.is_main:
                log.info("snapshot step %d skipped: step %s is still being written", step, self.pending_step)
            return False
        import torch.distributed.checkpoint as dcp

        stage = host.stage(self._pinned.stage) if host is not None else self._pinned.stage
        writer = DeferredDcpWriter(self.store.root, lambda: self.store.begin_parts(step), stage)
        dcp.save({k: state[k] for k in DCP_KEYS}, storage_writer=writer, process_group=group)
        assert writer.part is not None
        copied = self._pinned.copied()  # the device-to-host copies run on; the writer waits for them
        rest = copy.deepcopy({k: v for k, v in state.items() if k not in DCP_KEYS}) if info.is_main else None
        stall = time.perf_counter() - t0
        self._stats.last_stall_s = stall
        self._stats.total_stall_s += stall
        self._abandoned = abandoned = threading.Event()
        self.pending_step = self.last_submitted = step
        self._future = self._pool.submit(self._write, step, writer.part, writer.metadata, rest, world_size,
                                         extra_meta, abandoned, stall, copied)
        return True

    def _write(self, step: int, part: Part, metadata: Any, rest: dict[str, Any] | None, world_size: int,
               extra_meta: dict[str, Any], abandoned: threading.Event, stall: float, copied: Any) -> None:
        t0 = time.perf_counter()
        try:
            if copied is not None:
                copied.synchronize()
            self.store.write_part(part)  # into the snapshot's temp dir, or uploaded (checkpoints.s3parts)
            if rest is None:
                return
            assert metadata is not None
            info = self.store.seal_parts(step, part.temp, ranks=world_size, metadata=metadata, state=rest,
                                         world_size=world_size, extra_meta=extra_meta,
                                         deadline=time.monotonic() + self.part_timeout_s,
                                         abandoned=abandoned.is_set, housekeeping=False)
        except BaseException as exc:  # noqa: BLE001 - kept for flush, said once here
            taken_in = round_taken_in(extra_meta)
            if isinstance(exc, SnapshotFencedError) and 0 <= taken_in < self.own_round:
                log.info("snapshot step %d not committed: it was taken in round %d, and this rank went on into "
                         "round %d in place, whose fence it raised; the next snapshot is that round's", step,
                         taken_in, self.own_round)
                self.store.drop_parts(part.temp)
                return
            self._stats.errors += 1
            self._stats.last_error = str(exc)
            if not isinstance(exc, SnapshotFencedError):
                log.warning("snapshot step %d not written (%s): %s", step, "sharded" if rest is None else "seal", exc)
            self._errors.append(exc)
            if rest is not None:
                self.store.drop_parts(part.temp)
            return
        finally:
            if self.pending_step == step:
                self.pending_step = None
        took = time.perf_counter() - t0
        s = self._stats
        s.snapshots_written += 1
        s.last_capture_s, s.last_write_s, s.last_bytes = stall, took, info.size_bytes
        s.last_durable_step, s.last_durable_time = info.step, time.time()
        log.info("snapshot step %d durable: %.1f MB of shards from %d ranks in %.2fs (%.2f GB/s), training stalled "
                 "%.1f ms", step, info.size_bytes / 1e6, world_size, took, info.size_bytes / max(took, 1e-9) / 1e9,
                 stall * 1e3)
        if self.on_durable is not None:
            try:
                self.on_durable(self.stats)
            except Exception:  # a metrics bug must not fail snapshots
                log.exception("on_durable callback failed")
        self.store.housekeep()

    def abandon(self) -> None:
        """The world changed: a snapshot still waiting for a lost rank's shards is given up."""
        self._abandoned.set()

    def flush(self, timeout: float | None = None) -> None:
        """Wait for this rank's pending write (rank 0: the seal); re-raise a failure."""
        future = self._future
        if future is not None:
            future.result(timeout)
        errors = []
        while self._errors:
            errors.append(self._errors.popleft())
        if errors:
            err = errors[-1]
            if isinstance(err, SnapshotError):
                raise err
            raise SnapshotError(f"background snapshot write failed: {type(err).__name__}: {err}") from err

    def close(self) -> None:
        try:
            self.flush()
        finally:
            self._pool.shutdown(wait=True)


__all__ = ["DCP_KEYS", "PART_TIMEOUT_S", "ShardedWriter"]
