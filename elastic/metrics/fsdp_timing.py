"""FSDP2's own collectives, timed like DDP's all-reduce (:mod:`elastic.metrics.comm_hook`).

A sharded model (:mod:`elastic.sharded`) has no DDP comm hook: it all-gathers its
parameters before each block's forward and backward and reduce-scatters their gradients
after. FSDP2 lets a caller replace those two collectives (``set_custom_all_gather``,
``set_custom_reduce_scatter``); the replacements here issue the very same calls as FSDP2's
defaults (so the numerics do not change) and time each one from enqueue to completion,
into ``elastic_collective_duration_seconds{op="allgather"|"reducescatter"}`` and the byte
and error counters, as the all-reduce hook does. Timing is host wall time through the work's
future, which on gloo completes when the collective has; on NCCL it would time the enqueue
(not measured here, for lack of a GPU).

HSDP's all-reduce across replicas runs inside FSDP2 with no such seam, so it is not timed
here; in place the run issues it itself and times it there (:mod:`elastic.inplace.hsdp`,
:func:`elastic.metrics.comm_hook.timed_all_reduce`).
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .comm_hook import CollectiveTimer

OP_ALLGATHER = "allgather"
OP_REDUCESCATTER = "reducescatter"


def _bases() -> tuple[type, type] | None:
    """FSDP2's default all-gather and reduce-scatter (their buffer allocation is kept), or None
    where this torch has no such seam."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter
    except ImportError:
        return None
    return DefaultAllGather, DefaultReduceScatter


def _timed(timer: CollectiveTimer, output: torch.Tensor, issue: Any) -> Any:
    """Issue one collective; observe its time when it completes (at once if synchronous)."""
    timer.bytes.inc(output.numel() * output.element_size())
    t0 = time.perf_counter()
    try:
        work = issue()
    except Exception:
        timer.errors.inc()
        raise
    if work is None:
        timer.observe(time.perf_counter() - t0)
        return None

    def done(fut: torch.futures.Future[Any]) -> None:
        try:
            fut.value()
        except Exception:  # noqa: BLE001 - counted; FSDP2's own wait raises it where it belongs
            timer.errors.inc()
            return
        timer.observe(time.perf_counter() - t0)

    work.get_future().then(done)
    return work


def time_fsdp_collectives(model: nn.Module, backend: str) -> list[CollectiveTimer]:
    """Time every FSDP2 module's all-gather and reduce-scatter in ``model``; the timers (empty:
    nothing to time, or this torch has no seam)."""
    from torch.distributed.fsdp import FSDPModule

    bases = _bases()
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if bases is None or not modules:
        return []
    gather_base, scatter_base = bases
    gathered = CollectiveTimer(backend, op=OP_ALLGATHER)
    scattered = CollectiveTimer(backend, op=OP_REDUCESCATTER)

    class TimedAllGather(gather_base):  # type: ignore[misc, valid-type]  # a base found at run time (_bases)
        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                     async_op: bool = False) -> Any:
            return _timed(gathered, output_tensor, lambda: dist.all_gather_single(
                output_tensor, input_tensor, group=group, async_op=async_op))

    class TimedReduceScatter(scatter_base):  # type: ignore[misc, valid-type]  # as TimedAllGather
        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                     async_op: bool = False) -> Any:
            return _timed(scattered, input_tensor, lambda: dist.reduce_scatter_single(
                output=output_tensor, input=input_tensor, group=group, op=op, async_op=async_op))

    for module in modules:
        try:
            module.set_custom_all_gather(TimedAllGather())
            module.set_custom_reduce_scatter(TimedReduceScatter())
        except ValueError:  # several parameter groups in one module: FSDP2 refuses a custom comm
            continue
    return [gathered, scattered]


__all__ = ["OP_ALLGATHER", "OP_REDUCESCATTER", "time_fsdp_collectives"]
