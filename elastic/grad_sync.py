"""Gradient sync: DDP around the user's module, its comm hook, and the step's small collectives.

Every collective of a training step happens here, before the optimizer step, so that a
failure (a peer lost, a connection cut) always leaves this rank's state as it was after
the previous step: the step is abandoned whole, never half-applied.

* ``backward``: DDP's gradient all-reduce (through the metrics comm hook when it is on),
  then DDP's one-time bucket rebuild, which DDP itself would run in the next forward
  (:mod:`.ddp_buckets`).
* ``sync_buffers``: rank 0's buffers (BatchNorm statistics) to everyone, as DDP's own
  ``broadcast_buffers`` would do at the next forward; done here instead, so the user's
  forward never runs a collective that could fail outside the trainer's reach.
* ``start_control``/``finish_control``: one tiny all-reduce (MAX) per step, launched before
  the forward and waited for after the backward, so it overlaps them. In place, it carries
  the newest round every rank can switch to, so that all ranks switch at one boundary.

A model sharded with FSDP2 (``sharded``, :mod:`elastic.sharded`) is never wrapped in DDP:
its own backward reduce-scatters (and, as HSDP, all-reduces over replicas) and averages its
gradients, so ``run.model`` is the model itself, and under ``user_backward`` the step's loss
scale is put into the gradients after the backward (:meth:`GradSync.scale_sharded_grads`).

A sharded model's gradients are looked at for a NaN or an Inf after its backward
(``guard_nonfinite``, :mod:`.consistency.nonfinite`): each rank holds other shards, so the
flags meet in one tiny all-reduce, HSDP's failure verdict where it is made anyway
(:meth:`GradSync.agree_on_failure`); the run reads :attr:`GradSync.grads_nonfinite`.

DDP is built again after every change of world (:meth:`build`): its reducer keeps the
group's size and its bucket state, and a failed all-reduce leaves it unusable.

``user_backward`` (:mod:`elastic.prepare`): the script calls ``loss.backward()`` itself, out
of the trainer's reach, so a failed gradient all-reduce must not raise there. The comm hook
then records the failure (:attr:`GradSync.failure`) and completes with the bucket as it
was; the step's commit point sees it and abandons the step. The loss scale that
``ElasticRun.step`` puts into the loss is put into each bucket instead (``grad_scale``).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from . import ddp_buckets
from .consistency import nonfinite
# CollectiveFailure and is_collective_failure are imported from here too (their old home).
from .collectives import CollectiveFailure, collective_failures, first_line, is_collective_failure  # noqa: F401
from .distributed import DistInfo, collective_device
from .metrics.training import MetricsLike

class GradSync:
    def __init__(self, module: nn.Module, metrics: MetricsLike, user_backward: bool = False,
                 sharded: bool = False) -> None:
        self.module, self.metrics, self.user_backward, self.sharded = module, metrics, user_backward, sharded
        self.model: Any = None  # DistributedDataParallel, or the sharded module itself
        self.averages = True  # does DDP average (True) or does the loss carry 1/world (False)?
        self.grad_scale = 1.0  # user_backward: each bucket is multiplied by it (the step's loss scale)
        self.failure: str | None = None  # user_backward: the first gradient all-reduce of the step that failed
        # HSDP in place: the ranks agree on whether the step's all-reduces across replicas all
        # succeeded (see agree_on_failure); set by the run when it takes the mesh over
        self.agree_each_step = False
        self.guard_nonfinite = False  # sharded: each step's gradient shards looked at (set by the run)
        self.grads_nonfinite = False  # ... and the last backward's hold a NaN or an Inf on some rank
        self._buffers = [b for b in module.buffers()]
        self._info: DistInfo | None = None
        self._buckets_settled = False

    def build(self, info: DistInfo, init_sync: bool = False) -> DistributedDataParallel:
        """DDP for the current world. In place, replicas are already equal (healed) and
        nothing is broadcast; a world started by torchrun takes rank 0's parameters
        (``init_sync``), as DDP always did."""
        self._info = info
        self._buckets_settled = False
        self.failure = None
        if self.sharded:  # it syncs (and averages) its own gradients; DDP cannot wrap DTensors
            self.model, self.averages = self.module, True
            attach = getattr(self.metrics, "attach_sharded", None)  # FSDP2's collectives timed (metrics on)
            if attach is not None:
                attach(self.module)
            return self.model
        with warnings.catch_warnings():
            # torch 2.14 deprecates ``broadcast_buffers`` for ``forward_sync_buffers``, which
            # would sync buffers at init; in place, rank 0's buffers are healed and synced
            # here instead (``sync_buffers``), so False is what we mean, and the user can do
            # nothing about the warning: it is silenced here, and only here.
            warnings.filterwarnings("ignore", message="`broadcast_buffers` is deprecated", category=FutureWarning)
            # Gradients as views of DDP's buckets: autograd writes them into the buckets, so
            # a step copies no gradient into a bucket and none back (two passes over every
            # gradient fewer, and one copy of them less in memory). That pays for what the
            # Python comm hook costs over DDP's built-in all-reduce, and under prepare for
            # its pass that scales each bucket (docs/BENCHMARKS.md, "Bring your own loop").
            self.model = DistributedDataParallel(
                self.module, device_ids=[info.local_rank] if info.device.type == "cuda" else None,
                broadcast_buffers=False, init_sync=init_sync, gradient_as_bucket_view=True,
            )
        self.failure = None
        if self.user_backward:
            self._attach_recording_hook(self.model)
            return self.model
        # the hook sums and the loss carries 1/world; without the hook DDP averages
        self.averages = self.metrics.attach(self.model, average=False)
        return self.model

    def _attach_recording_hook(self, model: DistributedDataParallel) -> None:
        """The metrics hook (or a plain summing all-reduce) behind one that scales each bucket
        by ``grad_scale`` first and turns a failure into :attr:`failure` instead of an error."""
        catcher = _HookCatcher()
        self.metrics.attach(catcher, average=False)  # duck-typed: it only registers
        inner_state, inner = catcher.hooked if catcher.hooked is not None else (None, _sum_hook)
        self.averages = False
        model.register_comm_hook(self, _recording_hook(inner_state, inner))

    def take_failure(self) -> str | None:
        """The gradient all-reduce failure recorded in this step's backward (user_backward), once."""
        failure, self.failure = self.failure, None
        return failure

    def settle_buckets(self) -> None:
        """After a backward the script ran itself: DDP's one-time bucket rebuild, here (see backward)."""
        with collective_failures():
            if not self._buckets_settled and isinstance(self.model, DistributedDataParallel):
                self._buckets_settled = ddp_buckets.settle(self.model)

    def backward(self, loss: torch.Tensor, scaler: Any = None) -> None:
        with collective_failures():
            (scaler.scale(loss) if scaler is not None else loss).backward()
        if self.sharded:  # HSDP in place: its replicate all-reduce recorded a failure, on any rank
            recorded = self.agree_on_failure(self.take_failure()) if self.agrees_after_backward else self.take_failure()
            if recorded is not None:
                raise CollectiveFailure(recorded)
        self.settle_buckets()

    @property
    def agrees_after_backward(self) -> bool:
        """Whether the ranks meet in :meth:`agree_on_failure` after each backward."""
        return self.agree_each_step or (self.sharded and self.guard_nonfinite)

    def agree_on_failure(self, recorded: str | None) -> str | None:
        """Every rank's verdict on the step, after its backward: a failure if any rank recorded one.

        HSDP's all-reduces across replicas run on disjoint groups (local rank i of each node),
        so a node lost mid-step can fail one local rank's all-reduce and not another's; that
        rank committed the step while its node's other rank abandoned it and went to join the
        next world, and the committer waited for it in the next step's all-gather (seen: a
        survivor that never trained again). One tiny all-reduce over the world makes the
        verdict every rank's; if it fails itself, a peer is gone and every rank abandons.

        Under ``guard_nonfinite`` the same all-reduce carries whether this rank's gradient
        shards are finite (:func:`.consistency.nonfinite.flag`; a failure outranks it), so
        that every rank learns alike whether any shard's gradient holds a NaN or an Inf."""
        assert self._info is not None
        finite = recorded is not None or not self.guard_nonfinite or nonfinite.grads_finite(self.module.parameters())
        flag = torch.tensor([nonfinite.flag(recorded is not None, finite)], dtype=torch.int64,
                            device=collective_device(self._info))
        with collective_failures():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        value = int(flag.item())
        self.grads_nonfinite = value == nonfinite.NONFINITE
        if recorded is None and value >= nonfinite.FAILED:
            return "a peer's all-reduce across replicas failed in this step"
        return recorded

    def scale_sharded_grads(self, world_size: int) -> None:
        """``user_backward`` with a sharded model: no comm hook scales the buckets, so the step's
        loss scale (``grad_scale``, relative to a sum over ranks) goes into the averaged
        gradients here, before anything reads them (clipping, the optimizer)."""
        factor = self.grad_scale * world_size
        if not self.sharded or factor == 1.0:
            return
        with torch.no_grad():
            for p in self.module.parameters():
                if p.grad is not None:
                    p.grad.mul_(factor)

    def sync_buffers(self) -> None:
        """Rank 0's buffers to every rank, one broadcast per dtype."""
        info = self._info
        if not self._buffers or info is None or info.world_size == 1:
            return
        device = collective_device(info)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for buffer in self._buffers:
            by_dtype.setdefault(buffer.dtype, []).append(buffer)
        with collective_failures():
            for group in by_dtype.values():
                flat = torch.cat([b.detach().reshape(-1).to(device) for b in group])
                dist.broadcast(flat, 0)
                offset = 0
                for b in group:
                    b.detach().copy_(flat[offset:offset + b.numel()].view_as(b))
                    offset += b.numel()

    def start_control(self, value: int) -> tuple[torch.Tensor, Any]:
        assert self._info is not None
        tensor = torch.tensor([value], dtype=torch.int64, device=collective_device(self._info))
        with collective_failures():
            return tensor, dist.all_reduce(tensor, op=dist.ReduceOp.MAX, async_op=True)

    def finish_control(self, control: tuple[torch.Tensor, Any]) -> int:
        tensor, work = control
        with collective_failures():
            work.wait()
        return int(tensor.item())


class _HookCatcher:
    """Stands in for the DDP model while the metrics register their comm hook, to wrap it."""

    def __init__(self) -> None:
        self.hooked: tuple[Any, Any] | None = None

    def register_comm_hook(self, state: Any, hook: Any) -> None:
        self.hooked = (state, hook)


def _sum_hook(_state: Any, bucket: Any) -> Any:
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0])


def _recording_hook(inner_state: Any, inner: Any) -> Any:
    # No annotations: DDP compares them with the real dist.GradBucket and Future, and this
    # module's are strings (``from __future__ import annotations``).
    def hook(sync, bucket):
        tensor = bucket.buffer()
        if sync.failure is not None:  # the world is broken: later buckets need not wait on it
            return _done(tensor)
        if sync.grad_scale != 1.0:
            tensor.mul_(sync.grad_scale)
        try:
            fut = inner(inner_state, bucket)
        except RuntimeError as exc:
            if not is_collective_failure(exc):
                raise
            sync.failure = first_line(exc)
            return _done(tensor)

        def settled(f: Any) -> torch.Tensor:
            try:
                return f.value()
            except Exception as exc:  # noqa: BLE001 - a future carries any error; recorded, the step is abandoned
                sync.failure = sync.failure or first_line(exc)
                return tensor
        return fut.then(settled)
    return hook


def _done(tensor: torch.Tensor) -> Any:
    fut: Any = torch.futures.Future()
    fut.set_result(tensor)
    return fut
