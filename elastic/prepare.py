"""``elastic.Elastic``: in-place recovery for a plain DDP loop that keeps its own shape.

The script keeps its loop (``zero_grad``, forward, ``loss.backward()``, ``optimizer.step()``)
and adds three lines (``import elastic`` and the two below) and changes its epoch loop, as
with Accelerate's ``prepare`` or Fabric's ``setup``::

    ft = elastic.Elastic(snapshot_dir="/shared/ckpt/job1")                 # 1. one object
    model, optimizer, loader = ft.prepare(model, optimizer, loader)        # 2. wrap (+ scheduler)
    for epoch in ft.epochs(10):                                            # 3. the run's epochs
        for x, y in loader:
            optimizer.zero_grad(); loss_fn(model(x), y).backward(); optimizer.step()

It is :class:`elastic.ElasticRun` underneath, so there is one recovery path; only the
call order differs. **Call order**, per batch, and what each call is:

1. ``for x, y in loader``: the run's iterator. It joins or re-forms a world when one is
   due (at the batch boundary, after the loop's code for the last step), seeds the RNGs
   from ``(seed, step, rank)``, launches the step's control all-reduce, and yields this
   rank's share of the next global batch. Each epoch yields every sample once across
   the world, whatever world sizes it goes through.
2. ``model(x)``: the run's DDP of the current world (built again when the world changes).
3. ``loss.backward()``: the script's own. DDP's gradient all-reduce runs in it through a
   comm hook that records a lost peer instead of raising (:mod:`elastic.grad_sync`), so a
   peer lost here never crashes the script's line; the hook also applies the loss scale.
4. ``optimizer.step()``: the **commit point**, what ``run.step(loss)`` does after its
   backward: the step's remaining collectives, the commit of the previous step (ledger,
   snapshot), then the real optimizer step, only when every collective of this step
   succeeded. It returns an :class:`elastic.StepResult`: false when the step was abandoned
   (nothing applied; the world formed again; the loader yields the same samples again
   in a later batch or they were trained by the ranks that completed the step).
5. ``scheduler.step()`` (when prepared): skipped after an abandoned step, so the schedule
   counts committed steps only.

With AMP, a prepared ``GradScaler`` takes the optimizer's place in 4: ``scaler.step(optimizer)``
is the commit point (the run steps and updates the scaler there, once, as ``ElasticRun``
does), ``scaler.update()`` is then a no-op, and ``scaler.unscale_(optimizer)`` before
clipping works as usual.

**Batch size.** A DataLoader's ``batch_size`` is per rank (the DDP idiom); it stays per
rank at every world size, so the global batch is ``batch_size * world`` as it was under
torchrun, with the learning rate as the script set it. Why not hold the global batch:
after a shrink each rank would carry more samples than the script sized its GPU memory
for, and no rank can know the world the job first started at (a joiner, a resume at
another size). ``global_batch_size=`` holds the global batch instead (``ElasticRun``'s
default policy: the gradient is the same at every world size).

**Gradient accumulation** (``Elastic(gradient_accumulation_steps=K)``, Accelerate's idiom):
the loader yields micro-batches of its ``batch_size``; a step, the unit that commits,
heals and is counted, is K of them per rank (fewer at an epoch's end), and the sampler
moves by whole steps. The script calls ``loss.backward()`` and ``optimizer.step()`` for
every micro-batch, as it would without accumulation: ``step()`` (and ``zero_grad()``,
``scheduler.step()``, ``scaler.unscale_``) are no-ops until the step's last micro-batch.
Only that one's backward all-reduces (the others' forwards run under DDP's ``no_sync``),
so the gradient is plain DDP's accumulation: the mean over ranks of the sum of the
micro-batches' gradients (divide the loss by K, as under DDP, for their mean). A peer lost
anywhere in the step abandons it at its last ``optimizer.step()``; the run then yields the
whole step again, re-split. The script's own ``model.no_sync()`` and ``if (i + 1) % K``
are refused at the first micro-batch: they would drift from the run's step boundaries
after a re-formation or at an epoch's end. ``ft.sync_gradients`` says whether the
micro-batch in hand is its step's last (clip under it).

Under plain torchrun this is the restart path with snapshots and exact resume; without a
launcher, a world of one. The wrappers themselves are :mod:`elastic.prepared`.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any, Iterator, TypeVar

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, default_collate

from checkpoints.location import LocationError
from checkpoints.stores import location_of

from . import worker_env
from .prepared import (
    _UNPREPARED_SCHEDULER,
    PreparedLoader,
    PreparedModel,
    PreparedOptimizer,
    PreparedScaler,
    PreparedScheduler,
    _has_scheduler,
    _usage,
)
from .run_config import FLAT_KEYWORDS, DataConfig, refuse_flat_keywords
from .step_result import StepResult
from .trainer import ElasticRun

log = logging.getLogger(__name__)
_T = TypeVar("_T")
_UNTIL_EPOCHS = sys.maxsize  # the run is built before epochs(n) says how many


class Elastic:
    """One object per training script: ``prepare`` what the loop uses, then ``epochs(n)``.

    ``snapshot_dir`` defaults to ``$ELASTIC_SNAPSHOT_DIR`` (set by ``elastic local``).
    ``epochs``/``steps`` may be given here or as ``epochs(n)``; ``global_batch_size``
    switches from a fixed per-rank batch (the DataLoader's) to a fixed global one;
    ``gradient_accumulation_steps=K`` makes a step K of the loader's batches (see the
    module's docstring). Any
    other keyword goes to :class:`ElasticRun` (``seed``, ``snapshots=SnapshotConfig(...)``,
    ``collective_timeout``, ...).
    """

    def __init__(self, snapshot_dir: str | Path | None = None, *, epochs: int | None = None,
                 steps: int | None = None, global_batch_size: int | None = None, batch_size: int | None = None,
                 gradient_accumulation_steps: int = 1, **run_kwargs: Any) -> None:
        snapshot_dir = snapshot_dir or worker_env.read().node.snapshot_dir
        if not snapshot_dir:
            _usage("give Elastic(snapshot_dir=...) (a directory every node shares), or set ELASTIC_SNAPSHOT_DIR")
        if int(gradient_accumulation_steps) < 1:
            _usage(f"gradient_accumulation_steps must be >= 1, got {gradient_accumulation_steps}")
        if gradient_accumulation_steps > 1 and global_batch_size is not None:
            _usage("give Elastic(gradient_accumulation_steps=) or Elastic(global_batch_size=), not both: with "
                   "accumulation the micro-batch is the DataLoader's batch_size, per rank")
        self.accumulate = int(gradient_accumulation_steps)
        self._micro_left = 0  # micro-batches of the step in hand after the one in hand (accumulation)
        self._micro_index = 0  # the micro-batch in hand's place in its step
        self._micro_stepped = False  # optimizer.step() was called for the micro-batch in hand
        for taken in ("scheduler", "scaler", "max_grad_norm", "user_backward", "batch_policy", "per_rank_batch_size",
                      "data"):
            if taken in run_kwargs:
                _usage(f"Elastic(..., {taken}=) is not an option of the prepare API: "
                       + _TAKEN.get(taken, "it is decided by prepare()"))
        for loader_setting in ("num_workers", "collate_fn", "pin_memory"):
            if loader_setting in run_kwargs:
                raise TypeError(f"Elastic({loader_setting}=) is gone since 0.1.0: the DataLoader's is kept, give "
                                f"DataLoader({loader_setting}=...)")
        refuse_flat_keywords({k: v for k, v in run_kwargs.items() if k in FLAT_KEYWORDS}, caller="Elastic")
        try:
            location = location_of(snapshot_dir)
        except LocationError as e:  # s3:/x: as a directory, the job would snapshot into ./s3:/x/
            _usage(str(e))
        self.snapshot_dir, self.epochs_target, self.steps_target = location, epochs, steps
        self.global_batch_size, self.batch_size, self.run_kwargs = global_batch_size, batch_size, run_kwargs
        self._run: ElasticRun | None = None
        self.dataset: Any = None  # the script's, as prepared (the run's is wrapped under accumulation)
        self._batches: Iterator[Any] | None = None  # the run's own iterator, shared by every epoch
        self._held: Any = None  # a batch the run yielded that the loader has not handed out yet
        self._has_held = False
        self._held_epoch = -1
        self._consumed = False  # whether the loader handed out a batch since the last pull
        self._epoch: int | None = None  # the epoch the script's loop is in (inside epochs())
        self.last_step: StepResult | None = None

    # ------------------------------------------------------------------ set-up

    def prepare(self, model: nn.Module, optimizer: torch.optim.Optimizer, data: DataLoader[Any] | Dataset[Any],
                *extras: Any) -> tuple[Any, ...]:
        """``(model, optimizer, loader, *extras)``, wrapped, in the order given. ``data`` is the
        script's DataLoader (its dataset, batch size, collate_fn, num_workers and pin_memory are kept; its
        sampler is replaced by the run's) or a dataset (then give ``Elastic(batch_size=)``).
        ``extras``: LR schedulers and at most one ``GradScaler``, in any order."""
        if self._run is not None:
            _usage("ft.prepare(...) is called once per Elastic object")
        on_meta = _on_meta(model)
        if on_meta:  # it would die healing a peer or being healed ("Cannot copy out of meta tensor"), on every node
            _usage(f"the model's {on_meta} is on the meta device (built under torch.device('meta')): call "
                   "model.to_empty(device=...) and initialise or load its weights before ft.prepare")
        scalers = [x for x in extras if isinstance(x, torch.amp.GradScaler)]
        schedulers = [x for x in extras if not isinstance(x, torch.amp.GradScaler)]
        if len(scalers) > 1:
            _usage("ft.prepare takes one GradScaler")
        for sched in schedulers:
            if not callable(getattr(sched, "step", None)) or not hasattr(sched, "state_dict"):
                _usage(f"ft.prepare(model, optimizer, loader, ...) takes LR schedulers and a GradScaler, "
                       f"not {type(sched).__name__}")
        if _has_scheduler(optimizer) and not schedulers:
            _usage(_UNPREPARED_SCHEDULER)
        dataset, per_rank, collate_fn, num_workers, pin, replaced = _loader_settings(data, self.batch_size)
        kwargs = dict(self.run_kwargs)
        self.dataset = dataset
        if self.accumulate > 1:
            dataset, collate_fn = MicroBatches(dataset, collate_fn or default_collate, per_rank), _as_is
        if self.global_batch_size is not None:
            kwargs.update(global_batch_size=self.global_batch_size,
                          data=DataConfig(num_workers=num_workers, collate_fn=collate_fn, pin_memory=pin))
        else:
            step_share = per_rank * self.accumulate  # a step is this rank's micro-batches together
            kwargs.update(global_batch_size=step_share, data=DataConfig(
                batch_policy="fixed-per-rank", per_rank_batch_size=step_share, num_workers=num_workers,
                collate_fn=collate_fn, pin_memory=pin))
        kwargs.setdefault("device", next((p.device for p in model.parameters()), None))  # where the script put it
        epochs = self.epochs_target if self.epochs_target is not None or self.steps_target is not None \
            else _UNTIL_EPOCHS
        self._run = ElasticRun(model, optimizer, dataset, snapshot_dir=self.snapshot_dir, steps=self.steps_target,
                               epochs=epochs, user_backward=True, scaler=scalers[0] if scalers else None, **kwargs)
        self._run.plan.scale_lr = False  # per rank as the script had it: its learning rate, unscaled
        if replaced and self._run.is_main:
            log.info("[%s rank 0] prepare: the loader's %s is replaced by the run's elastic sampler (every sample "
                     "once per epoch at any world size, shuffled by seed %d); set_epoch is not needed",
                     self._run.dist.node, replaced, self._run.seed)
        out: list[Any] = [PreparedModel(self), PreparedOptimizer(self), PreparedLoader(self, per_rank)]
        for i, extra in enumerate(extras):
            if isinstance(extra, torch.amp.GradScaler):
                out.append(PreparedScaler(self, extra))  # its state is the run's (ElasticRun(scaler=))
            else:
                self._run.register(f"elastic.prepare.scheduler.{i}", extra)
                out.append(PreparedScheduler(self, extra))
        return tuple(out)

    def register(self, name: str, obj: _T) -> _T:
        """Loop state healed and snapshotted with the model (``ElasticRun.register``)."""
        return self.run.register(name, obj)

    # ------------------------------------------------------------------ views

    @property
    def prepared(self) -> bool:
        """Whether :meth:`prepare` built the run. ``ft.run`` before that is a usage error
        (exit 2), so code that cleans up after a ``prepare`` that may have been refused asks
        this first."""
        return self._run is not None

    @property
    def run(self) -> ElasticRun:
        if self._run is None:
            _usage("call ft.prepare(model, optimizer, loader) first")
        assert self._run is not None
        return self._run

    @property
    def rank(self) -> int:
        return self.run.rank

    @property
    def local_rank(self) -> int:
        return self.run.local_rank

    @property
    def world_size(self) -> int:
        return self.run.world_size

    @property
    def is_main(self) -> bool:
        """Rank 0 now (it moves when rank 0's node dies): print and save under it."""
        return self.run.is_main

    @property
    def epoch(self) -> int:
        return self.run.epoch

    @property
    def step_count(self) -> int:
        return self.run.step_count

    # ------------------------------------------------------------------ the loop

    def epochs(self, n: int | None = None) -> Iterator[int]:
        """The run's epochs, from where it stands (a resume or a heal may start mid-way): yields
        the epoch number; the prepared loader yields that epoch's batches. Ends after the
        final snapshot of the last epoch."""
        run = self.run
        if self._batches is not None:
            _usage("ft.epochs() is iterated once per Elastic object: the run ends with its last epoch")
        if n is not None:
            if self.epochs_target is not None and n != self.epochs_target:
                _usage(f"ft.epochs({n}) differs from Elastic(epochs={self.epochs_target}); give it once")
            run.epochs_target = n
        elif run.epochs_target == _UNTIL_EPOCHS:
            run.epochs_target = None
            if run.steps_target is None:
                _usage("give the number of epochs: ft.epochs(N), or Elastic(epochs=N) or Elastic(steps=N)")
        self._batches = iter(run)
        while True:
            if not self._pull():
                return
            epoch = self._epoch = run.epoch
            try:
                yield epoch
            finally:
                self._epoch = None
            if self._has_held and not self._consumed and self._held_epoch == epoch:
                _usage("the body of `for epoch in ft.epochs(N):` must iterate the prepared loader")

    def _pull(self) -> bool:
        """Next batch from the run into the hold; False when the run has ended."""
        if self._has_held:
            return True
        run = self.run
        if run.step_in_hand:
            _usage("optimizer.step() was not called for the last batch: call it once for every batch the prepared "
                   "loader yields (for gradient accumulation give Elastic(gradient_accumulation_steps=K))")
        assert self._batches is not None
        try:
            self._held = next(self._batches)
        except StopIteration:
            return False
        self._has_held, self._held_epoch, self._consumed = True, run.epoch, False
        return True

    def _epoch_batches(self) -> Iterator[Any]:
        if self._epoch is None:
            _usage("iterate the prepared loader inside `for epoch in ft.epochs(N):` (the run decides the epochs: "
                   "a resumed or healed rank starts mid-way)")
        epoch = self._epoch
        run = self.run
        while True:
            if not self._has_held:
                if run.plan.sampler.epoch != epoch or run.done:
                    return  # the epoch's last step was committed
                if not self._pull():
                    return
            if self._held_epoch != epoch:
                return  # healed forward past this epoch: the held batch opens the next one
            batch, self._held, self._has_held = self._held, None, False
            self._consumed = True
            if self.accumulate == 1:
                yield batch
            else:
                yield from self._micro_batches(batch)

    def _micro_batches(self, micro: list[Any]) -> Iterator[Any]:
        """One step's micro-batches (accumulation). Only the last one's backward all-reduces
        (the others' forwards run under DDP's ``no_sync``) and only its ``optimizer.step()``
        commits; a step abandoned there is yielded again whole, re-split, by the run."""
        for i, batch in enumerate(micro):
            self._micro_index, self._micro_left, self._micro_stepped = i, len(micro) - 1 - i, False
            try:
                yield batch
            finally:
                self._micro_index = self._micro_left = 0
            if not self._micro_stepped:
                _usage("with Elastic(gradient_accumulation_steps=K) call optimizer.step() after every backward: it "
                       "is a no-op until the step's last micro-batch, which the run knows (an `if (i + 1) % K` in "
                       "the loop would drift after a re-formation or at an epoch's end)")

    @property
    def sync_gradients(self) -> bool:
        """Whether the micro-batch in hand is its step's last (Accelerate's name): its backward
        all-reduces and its ``optimizer.step()`` commits. Always true without accumulation.
        Clip under it: ``if ft.sync_gradients: clip_grad_norm_(...)``."""
        return self._micro_left == 0

    @property
    def accumulating(self) -> bool:
        """A step's gradients are being summed: a micro-batch after its step's first is in hand."""
        return self.accumulate > 1 and self._micro_index > 0 and self.run.step_in_hand

    def _optimizer_step(self) -> StepResult:
        if self.accumulate > 1 and self.run.step_in_hand:
            if self._micro_stepped:
                _usage("optimizer.step() called twice for one micro-batch: call it once after every backward")
            self._micro_stepped = True
            if self._micro_left > 0:  # the step's gradients are still being summed: nothing to apply yet
                self.last_step = StepResult(False, self.run.step_count + 1, self.run.epoch)
                return self.last_step
        if not self.run.step_in_hand:
            _usage("optimizer.step() called twice for one batch, or outside the prepared loader's loop: call it once "
                   "for every batch the loader yields")
        result = self.run.step_after_backward()
        self.last_step = result
        scaler = self.run.state.scaler
        if not result and scaler is not None and hasattr(scaler, "_per_optimizer_states"):
            # what GradScaler.update() resets: an abandoned step's unscale_ must not block the next one
            scaler._per_optimizer_states.clear()
        return result


_TAKEN = {
    "scheduler": "pass it to ft.prepare(model, optimizer, loader, scheduler) and step it yourself",
    "scaler": "pass the GradScaler to ft.prepare(model, optimizer, loader, scaler)",
    "max_grad_norm": "call torch.nn.utils.clip_grad_norm_(model.parameters(), ...) before optimizer.step()",
    "batch_policy": "the DataLoader's batch_size stays per rank; give global_batch_size= to hold the global batch",
    "per_rank_batch_size": "it is the DataLoader's batch_size",
    "data": "the DataLoader's batch_size, num_workers and collate_fn are kept; give global_batch_size= to hold the "
            "global batch",
}


class MicroBatches(Dataset[Any]):
    """The run's dataset under accumulation: fetching a step's share of ids gives its
    micro-batches of the loader's ``batch_size``, each fetched and collated as the script's
    DataLoader would (its ``__getitems__`` if it has one, its ``collate_fn``: a padding
    collate pads each micro-batch alone, as under plain DDP). Picklable, for ``num_workers``."""

    def __init__(self, dataset: Dataset[Any], collate_fn: Any, size: int) -> None:
        self.dataset, self.collate_fn, self.size = dataset, collate_fn, size

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> Any:
        return self.dataset[i]

    def __getitems__(self, ids: list[int]) -> list[Any]:
        return [self.collate_fn(self._fetch(ids[i:i + self.size])) for i in range(0, len(ids), self.size)]

    def _fetch(self, ids: list[int]) -> Any:
        many = getattr(self.dataset, "__getitems__", None)
        return many(ids) if many is not None else [self.dataset[i] for i in ids]


def _as_is(batch: Any) -> Any:
    """The run's collate_fn under accumulation: :class:`MicroBatches` has collated already."""
    return batch


def _loader_settings(data: Any, batch_size: int | None) -> tuple[Dataset[Any], int, Any, int, bool | None, str]:
    """(dataset, per-rank batch size, collate_fn, num_workers, pin_memory, the sampler replaced or '').
    pin_memory is the loader's own (a plain DataLoader does not pin); None for a bare dataset."""
    if isinstance(data, DataLoader):
        if data.batch_size is None:
            if batch_size is None:
                _usage("the DataLoader has a batch_sampler of its own: give Elastic(batch_size=N) (per rank); "
                       "the run's elastic sampler decides which samples each rank takes")
        per_rank = batch_size or int(data.batch_size)
        dataset, collate_fn, num_workers, pin = data.dataset, data.collate_fn, data.num_workers, bool(data.pin_memory)
        replaced = type(data.sampler).__name__ if data.batch_size is not None else type(data.batch_sampler).__name__
    else:
        if batch_size is None:
            _usage("ft.prepare(model, optimizer, dataset) needs Elastic(batch_size=N) (per rank), or pass a DataLoader")
        per_rank, dataset, collate_fn, num_workers, pin, replaced = int(batch_size), data, None, 0, None, ""
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
        _usage("prepare() needs a map-style dataset (with __len__ and __getitem__): exactly-once per epoch is "
               "by sample index")
    if per_rank < 1:
        _usage(f"the per-rank batch size must be >= 1, got {per_rank}")
    return dataset, per_rank, collate_fn, num_workers, pin, replaced


def _on_meta(model: nn.Module) -> str:
    """The first parameter or buffer of ``model`` left on the meta device (it holds no data), or ''."""
    for kind, named in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, tensor in named:
            if tensor.is_meta:
                return f"{kind} {name!r}"
    return ""


def prepare(model: nn.Module, optimizer: torch.optim.Optimizer, data: DataLoader[Any] | Dataset[Any],
            *extras: Any, **elastic_kwargs: Any) -> tuple[Any, ...]:
    """``Elastic(**elastic_kwargs).prepare(...)`` plus the ``Elastic`` object last: ``model,
    optimizer, loader, ft = elastic.prepare(model, optimizer, loader, snapshot_dir=...)``."""
    ft = Elastic(**elastic_kwargs)
    return (*ft.prepare(model, optimizer, data, *extras), ft)


__all__ = ["Elastic", "PreparedLoader", "PreparedModel", "PreparedOptimizer", "PreparedScaler", "PreparedScheduler",
           "prepare"]
