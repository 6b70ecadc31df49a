"""A DDP communication hook that is DDP's own all-reduce, plus timing, byte and error counts.

Averaging (the default): gradients stay bitwise identical to DDP without a hook. DDP then
multiplies each gradient by ``1 / world`` (a double scalar) while copying it into the bucket
and all-reduces by sum; this hook multiplies the bucket by the same scalar and all-reduces by
sum. (torch's reference ``allreduce_hook`` divides instead, which differs in the last bit at
world sizes that are not powers of two.)

Summing (``average=False``): for a caller that has already put ``1 / world`` into its loss, as
``ElasticRun`` does. With a hook DDP no longer fuses the scaling into its copy, so averaging
costs one more pass over every bucket; on a small CPU model that pass was most of the
hook's cost (docs/BENCHMARKS.md).

Timing: gloo's future completes when the all-reduce is done, so host wall time from enqueue
to the ``then`` callback is the collective's time. NCCL's future completes when the work is
*enqueued*; there the hook records CUDA events on the current stream before the call and in
the callback (whose stream waits for the NCCL work), and reads them later, once the GPU has
passed them (``drain``, also run at each hook call), so the step is never synchronised.

No ``from __future__ import annotations`` here: DDP's ``register_comm_hook`` compares the
hook's annotations with the real ``dist.GradBucket`` and ``Future[Tensor]`` objects.
"""

import threading
import time
from collections import deque
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from .catalogue import Families, families

OP_ALLREDUCE = "allreduce"
_MAX_PENDING = 4096  # CUDA event pairs not yet read; beyond this the oldest timings are dropped


class CollectiveTimer:
    """The hook's state: the bound series for (op, backend) and CUDA timings not yet read."""

    def __init__(self, backend: str, process_group: dist.ProcessGroup | None = None,
                 op: str = OP_ALLREDUCE, fam: Families | None = None, average: bool = True) -> None:
        f = fam or families()
        self.backend, self.op, self.average = backend, op, average
        self.process_group = process_group
        group = process_group if process_group is not None else dist.group.WORLD
        self.world_size = dist.get_world_size(group)
        self.scale = 1.0 / self.world_size  # as DDP's reducer: x * (1/n), then sum
        self.duration = f.collective_duration.labels(op, backend)
        self.bytes = f.collective_bytes.labels(op, backend)
        self.errors = f.collective_errors.labels(op, backend)
        self._pending: deque[tuple[torch.cuda.Event, torch.cuda.Event]] = deque()
        self._free: list[torch.cuda.Event] = []
        self._drain_lock = threading.Lock()
        self.seconds = 0.0  # every timing observed so far, summed: a step's share is the difference

    def observe(self, seconds: float) -> None:
        self.duration.observe(seconds)
        self.seconds += seconds

    def drain(self) -> None:
        """Observe the durations of finished CUDA-timed collectives; never blocks on the GPU."""
        if not self._pending or not self._drain_lock.acquire(blocking=False):
            return
        try:
            while self._pending and self._pending[0][1].query():
                start, end = self._pending.popleft()
                self.observe(start.elapsed_time(end) / 1000.0)
                self._free += (start, end)
        finally:
            self._drain_lock.release()

    def _event(self) -> torch.cuda.Event:
        try:
            return self._free.pop()
        except IndexError:
            return torch.cuda.Event(enable_timing=True)

    def begin(self, tensor: torch.Tensor) -> tuple[Any, float]:
        """Count ``tensor``'s bytes and start its clock: (a recorded CUDA start event on a GPU
        backend, else None; the host time). :meth:`end` takes both."""
        self.bytes.inc(tensor.numel() * tensor.element_size())
        start: Any = None
        if tensor.is_cuda and self.backend != "gloo":
            self.drain()
            start = self._event()
            start.record()
        return start, time.perf_counter()

    def end(self, start: Any, t0: float) -> None:
        """The collective begun with ``(start, t0)`` completed (on a GPU: on this stream)."""
        if start is not None:
            end = self._event()
            end.record()
            self._timed_on_gpu(start, end)
        else:
            self.observe(time.perf_counter() - t0)

    def _timed_on_gpu(self, start: torch.cuda.Event, end: torch.cuda.Event) -> None:
        if len(self._pending) >= _MAX_PENDING:
            self._pending.popleft()
        self._pending.append((start, end))


def timed_all_reduce(state: CollectiveTimer, tensor: torch.Tensor, group: Any) -> None:
    """A synchronous all-reduce of ``tensor`` over ``group``, timed and counted as the hook's
    are (HSDP's all-reduce across replicas, which the run issues itself): host time on gloo,
    CUDA events on a GPU backend (read later by :meth:`CollectiveTimer.drain`)."""
    start, t0 = state.begin(tensor)
    try:
        dist.all_reduce(tensor, group=group)
    except Exception:
        state.errors.inc()
        raise
    state.end(start, t0)


def allreduce_hook(state: CollectiveTimer, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's all-reduce of one bucket (averaging unless ``state.average`` is off), timed and counted."""
    tensor = bucket.buffer()
    if state.average and state.world_size > 1:  # x * 1.0 is x: skip a pass over the bucket
        tensor.mul_(state.scale)
    start, t0 = state.begin(tensor)
    try:
        fut = dist.all_reduce(tensor, group=state.process_group, async_op=True).get_future()
    except Exception:
        state.errors.inc()
        raise

    def done(f: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        try:
            result = f.value()[0]
        except Exception:
            state.errors.inc()
            raise
        state.end(start, t0)  # on a GPU, this callback's stream already waits for the NCCL work
        return result

    return fut.then(done)


def register_comm_hook(model: DistributedDataParallel, backend: str,
                       process_group: dist.ProcessGroup | None = None, average: bool = True) -> CollectiveTimer:
    """Install the hook on ``model`` (before its first backward); call ``drain()`` once per step.

    ``average=False`` sums the gradients: only for a caller whose loss already carries ``1 / world``.
    """
    state = CollectiveTimer(backend, process_group, average=average)
    model.register_comm_hook(state, allreduce_hook)
    return state
