"""A script's own process group and DDP wrapper, taken over so that in-place recovery stays on.

The most natural port of a DDP script keeps its set-up: ``init_process_group()``, then
``ddp = DDP(model)``, then ``ElasticRun(ddp, ...)``. In-place recovery needs a default
group created reconfigurable (it changes members without a restart), and the script's was
not: the run used to fall back to the restart path without a word, and a kill then rolled
the job back to its last snapshot. Now the run takes both over, and says so in one line:

* a :class:`DistributedDataParallel` passed as the model is **unwrapped**: the run trains
  its ``.module`` under a DDP of its own, built again for each world (``run.model``). The
  script's wrapper forwards its calls there, so a loop that still calls ``ddp(x)`` trains
  correctly; the wrapper's own reducer stays idle (it is never prepared for a backward).
* under ``elastic agent``, a default group the script made is **destroyed and made again**
  in the in-place form. A barrier first makes sure every rank is past its
  ``init_process_group`` (rank 0 hosts that group's store). Afterwards
  ``dist.get_rank()`` and ``dist.get_world_size()`` follow the current world; groups the
  script made with ``new_group`` go with the old one. The run then leaves the new group to
  the script, as it left the old one: a final ``destroy_process_group()`` still works.

A *joiner* (started into a world that already trains in place) made its group in the
set-up world its agent described (:meth:`elastic.worker_env.RankEnv.in_setup_world`: itself and
the workers started with it), so its ``init_process_group()`` returned at once; the run
takes that group over at the loop's first batch instead, when it joins the real world.
"""

from __future__ import annotations

import logging
import weakref
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .inplace.reconfigure import SUPPORTED_BACKENDS

log = logging.getLogger(__name__)


def unwrap_ddp(model: nn.Module, run: Any) -> tuple[nn.Module, bool]:
    """``(module to train, whether model was a DDP)``; a DDP's calls go to ``run.model`` from now on."""
    if not isinstance(model, DistributedDataParallel):
        return model, False
    owner = weakref.ref(run)  # the script's wrapper must not keep a finished run alive

    def forward(*args: Any, **kwargs: Any) -> Any:
        live = owner()
        if live is None:
            raise RuntimeError("the ElasticRun this DistributedDataParallel was handed to is gone; "
                               "call the module you built instead")
        return live.model(*args, **kwargs)

    model.forward = forward  # an instance attribute: Module.__call__ finds it before DDP's own
    return model.module, True


def own_backend(requested: str) -> str:
    """The backend to re-create a script's group with: what it asked for (``auto``: its own)."""
    if requested != "auto" or not dist.is_initialized():
        return requested
    backend = str(dist.get_backend())
    return backend if backend in SUPPORTED_BACKENDS else requested


def release_default_group(timeout_s: float) -> str:
    """Destroy the default group the script made; returns how to name it in the log line."""
    backend, world = str(dist.get_backend()), dist.get_world_size()
    try:
        dist.barrier(async_op=True).wait(timeout=timedelta(seconds=timeout_s))
    except RuntimeError as exc:  # a peer gone already: the in-place world forms without it
        log.debug("barrier before replacing the script's process group: %s", exc)
    dist.destroy_process_group()
    return f"{backend}, world of {world}"


def taken_over_line(ddp: bool, group: str | None) -> str:
    """The one line that says what the run took over from the script, and what it means."""
    parts = []
    if group is not None:
        parts.append(f"this script's own process group ({group}) was replaced by an in-place one, so a lost or "
                     "joining node does not restart the workers; dist.get_rank() and get_world_size() follow the "
                     "current world (or read run.rank, run.world_size)")
    if ddp:
        parts.append("the DistributedDataParallel passed as the model is unwrapped: the run trains its .module "
                     "under its own DDP, built for each world (run.model), and calls to your wrapper go there")
    return "; ".join(parts)


__all__ = ["own_backend", "release_default_group", "taken_over_line", "unwrap_ddp"]
