"""FSDP2's own collectives, made to record a lost peer instead of raising in the script's code.

A model sharded across every node all-gathers its parameters in the script's own forward and
reduce-scatters their gradients in its own ``loss.backward()``, over groups that span nodes.
A lost node then raises out of ``model(x)`` or ``loss.backward()``, where the run cannot
catch it: the worker crashes and the job takes the restart path. HSDP avoids this because
its groups across nodes are the run's own all-reduce (:mod:`.hsdp`); a 1-D mesh has no such
seam, so :func:`guard` wraps each FSDP2 parameter group's all-gather and reduce-scatter
(whatever they are: FSDP2's defaults or the run's timed ones, :mod:`elastic.metrics.fsdp_timing`):

* one that fails the way a lost peer makes it fail (:func:`elastic.collectives.is_collective_failure`)
  **returns** and records the failure in ``sink.failure``, its output left as it was;
* once one failed, the next ones of the step return at once without touching the group;
* each runs synchronously (FSDP2 takes ``None`` for a work already done), so a failure is
  seen here and not in FSDP2's own ``wait()``.

The forward and backward then run to their end on garbage, and the run abandons the step at
its commit point (nothing of it is applied), as it does for a DDP step whose all-reduce
failed. What this touches of FSDP2's private state is :func:`.fsdp_private.comms` and
:func:`.fsdp_private.set_comms` (the parameter group's ``_all_gather_comm`` and
``_reduce_scatter_comm``, which ``set_custom_all_gather``/``set_custom_reduce_scatter``
set), so that the run's timing wrappers stay inside.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..collectives import first_line, is_collective_failure
from . import fsdp_private


class _Guarded:
    """One FSDP2 comm (all-gather or reduce-scatter) around ``inner``; see the module's doc."""

    def __init__(self, inner: Any, sink: Any) -> None:
        self.inner, self.sink = inner, sink

    def allocate(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.inner.allocate(*args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        if self.sink.failure is not None:
            return None
        kwargs["async_op"] = False
        try:
            work = self.inner(*args, **kwargs)
            if work is not None:
                work.wait()
        except RuntimeError as exc:
            if not is_collective_failure(exc):
                raise
            self.sink.failure = first_line(exc)
        return None


def guard(model: nn.Module, sink: Any) -> int:
    """Wrap every FSDP2 parameter group's collectives in ``model`` (once each: a group already
    guarded is left as it is); returns how many groups are guarded. ``sink.failure``: None,
    or the first failure's line."""
    count = 0
    for group in fsdp_private.param_groups(model):
        gather, scatter = fsdp_private.comms(group)
        if not isinstance(gather, _Guarded):
            gather = _Guarded(gather, sink)
        if not isinstance(scatter, _Guarded):
            scatter = _Guarded(scatter, sink)
        fsdp_private.set_comms(group, gather, scatter)
        count += 1
    return count


__all__ = ["guard"]
