"""A non-finite gradient or loss, caught at the step it appears: what to do, as pure decisions.

A NaN in one replica does not stay there: the next gradient all-reduce sums it into every
replica, and an optimizer step applies it everywhere; a check at the next interval then
sees every replica non-finite, which cannot be told from a diverged training. So the step
looks at its own all-reduced gradients before the optimizer applies them. The all-reduce
is the flag's collective (the ``GradScaler`` trick): a NaN or an Inf on any rank is a NaN
or an Inf in the sum on every rank, so every rank sees the same thing with no collective
of its own (:func:`grads_finite`, a local pass: a sum per gradient, one host sync).

On a non-finite step nothing is applied, and the replicas vote at once (:mod:`.vote`).
:func:`decide` turns that verdict into one of :class:`Do`:

* some replicas hold non-finite values, a finite majority agrees: those are the outliers,
  and since no non-finite gradient was ever applied the majority's state is the true one;
  the outliers are healed from it and the step is trained again: 0 steps lost (``HEAL``);
* every replica finite and agreeing: a transient fault in one node's compute (each rank's
  loss flag names it); the step is computed again, once (``RECOMPUTE``); non-finite again
  is a true divergence: the job stops at this finite agreed state, one line and a non-zero
  exit (``STOP``), or, if the user asked for it, the batch is skipped (``SKIP``);
* every replica non-finite: diverged; every replica returns to the last agreed (finite)
  state and the job stops (``STOP``);
* replicas that differ otherwise (a flipped bit as well): the replica check's own answer,
  a return to the last agreed state (``ROLLBACK``).

The same rule serves the periodic check (:func:`heals_in_place`): non-finite outliers
beside a finite majority are healed where they stand when every applied step's gradients
were looked at, never rolled back.

A sharded model (FSDP2, HSDP) holds each gradient's shard on one rank only (HSDP: on one
local rank of each replica), so one rank's look is not every rank's: the flags meet in one
tiny all-reduce after the backward (:func:`flag`). HSDP in place already makes that
all-reduce (each step's failure verdict), and the flag rides in it; 1-D FSDP has no
collective after its reduce-scatters to reuse, so it makes one. HSDP's replicas then vote
as DDP's do. 1-D FSDP has no replica of any shard: :func:`decide_unreplicated`.
"""

from __future__ import annotations

import enum
import os
from typing import Iterable

import torch

from .. import contract
from .vote import Verdict


class Do(enum.Enum):
    APPLY = "apply"  # the gradients are finite: the optimizer applies the step
    HEAL = "heal"  # non-finite outliers healed from the finite majority; the step trained again
    RECOMPUTE = "recompute"  # every replica finite and agreeing: compute the step once more
    SKIP = "skip"  # non-finite again, and the user asked to skip such a batch: no update for it
    STOP = "stop"  # a true divergence: stop at the last finite agreed state, non-zero exit
    ROLLBACK = "rollback"  # replicas differ otherwise: every replica back to the last agreed state


def heals_in_place(v: Verdict) -> bool:
    """The outliers are exactly replicas holding non-finite values, beside a finite majority."""
    return (not v.agreed and not v.diverged and v.has_majority and bool(v.suspects)
            and all(r in v.nonfinite for r in v.suspects))


def decide(grads_finite: bool, verdict: Verdict | None, recomputed: bool, skip: bool) -> Do:
    """What a step does with its all-reduced gradients (``grads_finite``) and, when they are
    not finite, the replicas' vote taken right then (``verdict``); ``recomputed``: this step
    was already computed again once; ``skip``: the user asked to skip such a batch."""
    if grads_finite:
        return Do.APPLY
    if verdict is None:
        raise ValueError("non-finite gradients: the replicas vote before anything is decided")
    if verdict.diverged:
        return Do.STOP
    if heals_in_place(verdict):
        return Do.HEAL
    if not verdict.agreed:
        return Do.ROLLBACK
    if not recomputed:
        return Do.RECOMPUTE
    return Do.SKIP if skip else Do.STOP


def decide_unreplicated(state_finite: bool, recomputed: bool, skip: bool) -> Do:
    """What a step of a model sharded with no replica (1-D FSDP) does with non-finite
    gradients, given whether every rank's shards of the state are finite. A non-finite shard
    has no replica to heal it from, and since every applied step's gradients were finite it
    was not trained there (a fault wrote it): the job stops, snapshotting nothing, so its
    newest snapshot is the last finite state (``STOP``). Every shard finite: a transient
    fault in a node's compute is recomputed once (``RECOMPUTE``); non-finite again is a
    true divergence (``STOP`` at this finite state, or ``SKIP`` if the user asked)."""
    if not state_finite:
        return Do.STOP
    if not recomputed:
        return Do.RECOMPUTE
    return Do.SKIP if skip else Do.STOP


# The flag of one rank's look after a backward, in an all-reduce (MAX) that may also carry a
# failure: the failure outranks it (a step that failed is abandoned whatever its gradients).
FINITE, NONFINITE, FAILED = 0, 1, 2


def flag(failed: bool, finite: bool) -> int:
    """This rank's value in the step's all-reduce (MAX) after the backward."""
    return FAILED if failed else FINITE if finite else NONFINITE


def grads_finite(params: Iterable[torch.Tensor]) -> bool:
    """Whether every gradient is finite (:func:`all_finite` over the parameters' gradients;
    of a sharded parameter, this rank's shard)."""
    return all_finite([local(p.grad) for p in params if p.grad is not None])


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a look at the DTensor itself would dispatch collectives);
    any other tensor as it is."""
    if type(t) is not torch.Tensor:
        from torch.distributed.tensor import DTensor

        if isinstance(t, DTensor):
            return t.to_local()
    return t


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every tensor is finite. First one sum per tensor, added up in float64, one host
    sync: a NaN or an Inf anywhere makes it non-finite (an Inf beside a -Inf: a NaN). Only
    finite values that overflow a sum make it non-finite wrongly, so a non-finite total is
    confirmed exactly (``aminmax`` per tensor: a NaN reaches both ends, an Inf one)."""
    tensors = [t.detach() for t in tensors if t.numel()]
    if all(_finite_on_each_device([t.sum() for t in tensors], total=True)):
        return True
    return all(_finite_on_each_device([e for t in tensors for e in torch.aminmax(t)], total=False))


def _finite_on_each_device(scalars: list[torch.Tensor], total: bool) -> list[bool]:
    """Per device (a GPU's parameters beside an optimizer's CPU step counts), whether the
    float64 sum of ``scalars`` (``total``) or each of them is finite: one sync per device."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for x in scalars:
        by_device.setdefault(x.device, []).append(x.double())
    stacked = [torch.stack(xs) for xs in by_device.values()]
    return [bool(torch.isfinite(x.sum() if total else x).all()) for x in stacked]


def skip_setting(raw: str | None = None) -> bool:
    """``$ELASTIC_SKIP_NONFINITE``: ``1`` skips a batch whose gradients stay non-finite."""
    value = (os.environ.get(contract.SKIP_NONFINITE_ENV, "") if raw is None else raw).strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{contract.SKIP_NONFINITE_ENV}={value!r}: use 1 (skip a batch whose gradients stay non-finite) or 0 (stop)")


def state_finite(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether every floating tensor holds only finite values (what a snapshot may hold; of a
    sharded tensor, this rank's shard)."""
    return all_finite([local(t) for t in tensors if t.is_floating_point()])


__all__ = ["FAILED", "FINITE", "NONFINITE", "Do", "all_finite", "decide", "decide_unreplicated", "flag", "grads_finite",
           "heals_in_place", "local", "skip_setting", "state_finite"]
