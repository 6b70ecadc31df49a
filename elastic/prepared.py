"""What ``Elastic.prepare`` hands back: the script's model, optimizer, loader, LR schedulers
and ``GradScaler``, each wrapped so that the script's own calls reach the run.

The call order they implement is :mod:`elastic.prepare`'s. Each wrapper stays what the
script's code expects (an ``nn.Module``, an ``Optimizer``, an iterable with ``len``) and
forwards everything it does not change to the object it wraps.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Callable, Iterator, NoReturn, Protocol

import torch
from torch import nn

from . import worker_env
from .sampler import split_sizes
from .step_result import StepResult
from .trainer import UsageExit

if TYPE_CHECKING:
    from .trainer import ElasticRun


class Elastic(Protocol):
    """What of :class:`elastic.prepare.Elastic` the wrappers use: prepare.py imports this
    module, so its class is named here by its shape rather than imported back."""

    @property
    def run(self) -> ElasticRun: ...

    dataset: Any
    accumulate: int
    last_step: StepResult | None

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def epoch(self) -> int: ...

    @property
    def sync_gradients(self) -> bool: ...

    @property
    def accumulating(self) -> bool: ...

    def _epoch_batches(self) -> Iterator[Any]: ...

    def _optimizer_step(self) -> StepResult: ...


class PreparedModel(nn.Module):
    """The script's model, trained under the run's DDP of the current world.

    Its parameters, ``state_dict`` (``module.``-prefixed, as DDP's) and ``train``/``eval`` are
    the script's module's; a call goes to ``run.model``, which is built again per world."""

    def __init__(self, ft: Elastic) -> None:
        super().__init__()
        self.module = ft.run.state.module
        object.__setattr__(self, "_ft", ft)  # not a submodule

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        ddp = self._ft.run.model
        if self._ft.sync_gradients:
            return ddp(*args, **kwargs)
        with ddp.no_sync():  # a micro-batch before its step's last: its backward only sums locally
            return ddp(*args, **kwargs)

    def no_sync(self) -> Any:
        if self._ft.accumulate > 1:
            _usage("drop `with model.no_sync():`: with Elastic(gradient_accumulation_steps=K) the run syncs only "
                   "each step's last micro-batch; call optimizer.step() after every backward")
        _usage("model.no_sync() (gradient accumulation): give Elastic(gradient_accumulation_steps=K) instead, and "
               "call optimizer.step() after every backward (a no-op until the step's last micro-batch)")


class PreparedOptimizer(torch.optim.Optimizer):
    """The script's optimizer, whose ``step()`` is the run's commit point (see the module's call order).

    An ``Optimizer`` to ``isinstance`` (LR schedulers check); everything else is the script's
    optimizer's. ``step()`` returns the :class:`StepResult`: false when the step was abandoned."""

    def __init__(self, ft: Elastic) -> None:  # noqa: D107 - no Optimizer.__init__: the state is the script's
        object.__setattr__(self, "_ft", ft)
        object.__setattr__(self, "_inner", ft.run.optimizer)

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "_inner"), name)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self._inner.param_groups

    @property
    def state(self) -> Any:
        return self._inner.state

    @property
    def defaults(self) -> dict[str, Any]:
        return self._inner.defaults

    def step(self, closure: Callable[[], float] | None = None) -> StepResult:
        if closure is not None:
            _usage("optimizer.step(closure) is not supported by prepare(): call loss.backward() yourself, then step()")
        if _has_scheduler(self):  # an LR scheduler built on this wrapper, after prepare
            _usage(_UNPREPARED_SCHEDULER)
        return self._ft._optimizer_step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._ft.accumulating:
            return  # within a step the micro-batches' gradients add up; the run zeroes them at the commit
        self._inner.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self._inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._inner.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self._inner.add_param_group(param_group)

    def __repr__(self) -> str:
        return f"PreparedOptimizer({self._inner!r})"


class _SamplerShim:
    """``loader.sampler``: the run's sampler decides; ``set_epoch`` is kept working when it agrees."""

    def __init__(self, ft: Elastic) -> None:
        self._ft = ft

    def set_epoch(self, epoch: int) -> None:
        if epoch != self._ft.epoch:
            _usage(f"loader.sampler.set_epoch({epoch}) but the run is in epoch {self._ft.epoch}: loop over "
                   "`for epoch in ft.epochs(N):` (a resumed or healed rank starts mid-way), not range(N)")


class PreparedLoader:
    """The rest of the current epoch's batches for this rank, from the run; iterate it inside
    ``ft.epochs(n)``. ``len()`` is the batches (micro-batches, with accumulation) of a whole
    epoch at the current world size."""

    def __init__(self, ft: Elastic, per_rank: int) -> None:
        self._ft, self.batch_size = ft, per_rank
        self.dataset = ft.dataset
        self.sampler = _SamplerShim(ft)

    def __iter__(self) -> Iterator[Any]:
        return self._ft._epoch_batches()

    def __len__(self) -> int:
        ft, plan = self._ft, self._ft.run.plan
        step = plan.batch_size(ft.world_size)
        steps, tail = divmod(len(self.dataset), step)
        if ft.accumulate == 1:
            return steps + (tail > 0)
        share = split_sizes(tail, ft.world_size)[ft.rank] if tail else 0
        return steps * ft.accumulate + (max(1, -(-share // self.batch_size)) if tail else 0)


class PreparedScheduler:
    """The script's LR scheduler: ``step()`` counts committed steps only (an abandoned step, or
    a micro-batch before its step's last, is not stepped); its state is healed and
    snapshotted with the model."""

    def __init__(self, ft: Elastic, scheduler: Any) -> None:
        self._ft, self._inner = ft, scheduler

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def step(self, *args: Any, **kwargs: Any) -> None:
        last = self._ft.last_step
        if last is not None and not last:
            return  # that step was abandoned: nothing was applied, and a healed rank already holds its schedule
        self._inner.step(*args, **kwargs)


class PreparedScaler:
    """The script's ``GradScaler``: ``step(optimizer)`` is the commit point; ``update()`` is
    done there, once per committed step, so the script's own call is a no-op."""

    def __init__(self, ft: Elastic, scaler: torch.amp.GradScaler) -> None:
        self._ft, self._inner = ft, scaler

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def scale(self, outputs: Any) -> Any:
        return self._inner.scale(outputs)

    def unscale_(self, optimizer: Any) -> None:
        if not self._ft.sync_gradients:
            return  # the step's gradients are not all summed yet: unscaled once, at its last micro-batch
        self._inner.unscale_(self._ft.run.optimizer if isinstance(optimizer, PreparedOptimizer) else optimizer)

    def step(self, optimizer: Any, *args: Any, **kwargs: Any) -> StepResult:
        if not isinstance(optimizer, PreparedOptimizer) or args or kwargs:
            _usage("scaler.step(optimizer) takes the optimizer ft.prepare returned, and nothing else")
        return self._ft._optimizer_step()

    def update(self, new_scale: Any = None) -> None:
        if new_scale is not None:
            _usage("scaler.update(new_scale) is not supported by prepare(): the run updates the scaler at each commit")


_UNPREPARED_SCHEDULER = ("an LR scheduler on this optimizer was not passed to ft.prepare: build it before, then "
                         "`model, optimizer, loader, scheduler = ft.prepare(model, optimizer, loader, scheduler)`, "
                         "so that it skips abandoned steps and heals with the model")


def _has_scheduler(optimizer: Any) -> bool:
    """Whether an LR scheduler was built on ``optimizer`` (torch's marks its wrapper of ``step``)."""
    return bool(getattr(optimizer.__dict__.get("step"), "_wrapped_by_lr_sched", False))


def _usage(message: str) -> NoReturn:
    """One ``error:`` line (rank 0 speaks for every rank) and exit code 2, as ElasticRun's."""
    if worker_env.read().me.place.rank == 0:
        print(f"error: {message}", file=sys.stderr, flush=True)
    raise UsageExit(message)


__all__ = ["PreparedLoader", "PreparedModel", "PreparedOptimizer", "PreparedScaler", "PreparedScheduler"]
