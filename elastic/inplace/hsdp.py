"""HSDP in place: the script's 2-D mesh re-formed over each world, in the same processes.

An HSDP script builds its mesh once (``init_device_mesh(device, (nodes, local),
mesh_dim_names=("replicate", "shard"))``) and calls ``fully_shard`` once. Every DTensor it
makes (parameters, gradients, optimizer state) points at that mesh object, and FSDP2 caches
the mesh's process groups in each parameter group. When the world changes, the run:

1. builds a fresh mesh over the current world (``(nodes now, local)``: the replicate
   dimension grows or shrinks, each node's shard group is its own ranks again) and swaps it
   into the script's mesh object, so every DTensor follows (:func:`.fsdp_private.swap_mesh`);
2. points every FSDP2 parameter group at a *shard-only* view of it: FSDP2 reduce-scatters
   inside the node, and the replicate all-reduce runs in the run's own hook
   (``set_all_reduce_hook``, public), where a lost peer is *recorded* instead of raised out
   of the script's ``loss.backward()``; the step is then abandoned at its commit point, as a
   DDP step is, and nothing of it is applied;
3. heals whoever needs state **shard by shard from a live replica**: local rank ``i`` from a
   peer node's local rank ``i``, each sending its DTensors' local shards (parameters and
   optimizer state) and the rest of the training state, no disk (:func:`pair`,
   :func:`capture_local`, :func:`load_local`).

Numerics: FSDP2 averages over the shard group, the hook sums over replicas and divides by
their count, i.e. the same mean as native HSDP's, in another order of float additions.

What needs torch's private attributes is in :mod:`.fsdp_private` (and its test).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..distributed import DistInfo, ElasticRunError
from ..grad_sync import is_collective_failure
from ..metrics.comm_hook import CollectiveTimer, timed_all_reduce
from . import fsdp_guard, fsdp_private
from .agreement import HealPlan, Holding, pair_shards
from .fence import SocketFence

log = logging.getLogger("elastic.trainer")

REPLICATE, SHARD = 0, 1  # the mesh's dimensions, as FSDP2's HSDP has them


def off_reason(model: nn.Module, kinds: Sequence[str], peer_copies: bool = False) -> str | None:
    """Why this sharded model cannot train in place (None: it can, as HSDP, or sharded across
    every node with ``peer_copies`` asked for: :mod:`.fsdp_in_place`)."""
    if tuple(kinds) == ("shard",) and peer_copies:
        pass  # FSDP across every node: a lost node's shards come from its buddies' memory
    elif tuple(kinds) != ("replicate", "shard"):
        return ("it is sharded across every node (FSDP2 without a replicate dimension): no live replica holds a "
                "lost node's shards, so a lost or joining node restarts the workers and they resume from the newest "
                "snapshot; set peer_copy_every (ELASTIC_PEER_COPY_EVERY=on) to recover in place from copies in a "
                "peer's memory, or build an HSDP mesh (init_device_mesh(device, (nodes, local), "
                "mesh_dim_names=('replicate', 'shard'))) to recover in place from a replica")
    why = fsdp_private.unsupported_reason()
    if why is not None:
        return why + "; a lost or joining node restarts the workers and they resume from the newest snapshot"
    if fsdp_private.post_forward_reshards_elsewhere(model):
        return ("fully_shard(reshard_after_forward=<int>) reshards to a mesh FSDP2 builds itself, which the run "
                "cannot re-form; use reshard_after_forward=True or False to recover in place")
    return None


class HsdpInPlace:
    """The takeover of one HSDP model's mesh: :meth:`rebuild` at every formation."""

    def __init__(self, model: nn.Module, shard_size: int, sync: Any = None, fence: SocketFence | None = None) -> None:
        from torch.distributed.tensor import DTensor

        self.model, self.shard_size, self.fence = model, shard_size, fence
        self.sink: Any = sync if sync is not None else self  # where a failure is recorded (the run's GradSync)
        mesh = next(p.device_mesh for p in model.parameters() if isinstance(p, DTensor))
        self.mesh, self.names = mesh, tuple(mesh.mesh_dim_names or ("replicate", "shard"))
        self.device_type = mesh.device_type
        self.replicate_group: Any = None
        self.replicas = 1
        self.failure: str | None = None  # the replicate all-reduce that failed in this step's backward
        # times the replicate all-reduce into elastic_collective_duration_seconds{op="allreduce"}
        # (the run's metrics set it; None: collective metrics off)
        self.timer: CollectiveTimer | None = None
        from torch.distributed.fsdp import FSDPModule

        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_all_reduce_hook(self._all_reduce)

    # ------------------------------------------------------------------ every formation

    def rebuild(self, info: DistInfo, has_state: bool = False) -> None:
        """The mesh over the current world: ``(world / local, local)``, ranks by node. A collective.

        A node whose local rank count is not the mesh's shard size cannot hold whole shards:
        its ranks leave with one line and exit code 2 (they hold nothing yet: nothing is lost),
        and every other rank waits for the round without it (:class:`CollectiveFailure`)."""
        device = info.device if getattr(info, "backend", "gloo") == "nccl" else torch.device("cpu")
        rows = _all_gather_ints([fsdp_private.group_count(), self.shard_size, int(has_state)], info.world_size,
                                device)
        expected = refused_shard_size([(shard, bool(held)) for _, shard, held in rows])
        if expected is not None:
            misfits = sorted(r for r, (_, shard, _h) in enumerate(rows) if shard != expected)
            line = (f"ranks {misfits} run {rows[misfits[0]][1]} local ranks per node but the job's mesh shards "
                    f"over {expected}: a node's local ranks must be exactly one shard group; start it with "
                    f"--nproc-per-node {expected}")
            if self.shard_size != expected:
                _leave_refused(line)
            if info.rank == 0:
                log.warning("refused a node: %s; the world forms again without it", line)
            from ..grad_sync import CollectiveFailure

            raise CollectiveFailure(f"refused a node: {line}")
        fsdp_private.set_group_count(max(count for count, _, _ in rows))  # every rank names the new groups alike
        fresh = self._fresh_mesh(dist.get_rank(), info.world_size, self.shard_size)
        fsdp_private.swap_mesh(self.mesh, fresh)
        info_ = fsdp_private.shard_only(self.mesh, SHARD)
        for group in fsdp_private.param_groups(self.model):
            fsdp_private.point_at(group, info_)
        self.replicas = info.world_size // self.shard_size
        self.replicate_group = self.mesh.get_group(REPLICATE)
        self.sink.failure = None

    def _fresh_mesh(self, rank: int, world: int, local: int) -> Any:
        """``(world / local, local)`` over the current world, its groups made here (every rank
        makes every group, in one order, as ``new_group`` asks).

        Every group goes on the world's socket fence. Across replicas: a peer frozen in the
        all-reduce across replicas then gets the survivors out at once when the agents write
        it off, as in a DDP step (without it they waited for gloo's timeout, and the hang
        watchdog restarted them first). A node's own shard group too: when a round replaces
        the world, a rank whose node peer has left the step for the new round must not wait
        in an all-gather for it (a survivor's local rank 1 did, for ever, in the whole suite).
        FSDP2's collectives are guarded (:meth:`guard`), so a shard
        group shut in the script's own forward or backward records the failure there
        instead of raising out of the script."""
        from torch.distributed.device_mesh import DeviceMesh

        layout = torch.arange(world).reshape(world // local, local)
        mine: list[Any] = [None, None]
        with self.fence.adding() if self.fence is not None else contextlib.nullcontext():
            for ranks in layout.t().tolist():  # local rank i of every node
                group = dist.new_group(ranks=ranks)
                mine[REPLICATE] = group if rank in ranks else mine[REPLICATE]
            for ranks in layout.tolist():  # one node's ranks
                group = dist.new_group(ranks=ranks)
                mine[SHARD] = group if rank in ranks else mine[SHARD]
        return DeviceMesh.from_group(mine, self.device_type, mesh=layout, mesh_dim_names=self.names)

    # ------------------------------------------------------------------ every step

    def _all_reduce(self, grad: torch.Tensor) -> None:
        """FSDP2's post-reduce-scatter hook: the mean over replicas. A failure is recorded for
        the step's commit point (and the rest of the backward skips its all-reduces)."""
        if self.replicas <= 1 or self.sink.failure is not None:
            return
        try:
            if self.timer is not None:
                timed_all_reduce(self.timer, grad, self.replicate_group)
            else:
                dist.all_reduce(grad, group=self.replicate_group)
        except RuntimeError as exc:
            if not is_collective_failure(exc):
                raise
            self.sink.failure = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            return
        grad.div_(self.replicas)

    def guard(self) -> None:
        """FSDP2's collectives record a lost peer in the run's ``GradSync.failure``
        (:mod:`.fsdp_guard`): the shard group is on the fence, and a trip must not raise out
        of the script's forward or backward. After the run's timing wrappers, which it keeps."""
        fsdp_guard.guard(self.model, self.sink)

    def take_failure(self) -> str | None:
        failure, self.sink.failure = self.sink.failure, None
        return failure

    # ------------------------------------------------------------------ healing

    def pair(self, plan: HealPlan, reports: Sequence[Holding]) -> HealPlan:
        """``plan`` with each healed rank's source a holder of the same local rank (the same
        shards) on another node (:func:`.agreement.pair_shards`)."""
        return pair_shards(plan, reports, self.shard_size)


def refused_shard_size(rows: Sequence[tuple[int, bool]]) -> int | None:
    """The shard size every rank must have, when some rank's differs (None: all agree).
    ``rows``: (shard size, holds state) per rank; those holding state are the job's."""
    sizes = {shard for shard, _ in rows}
    if len(sizes) == 1:
        return None
    held = [shard for shard, holds in rows if holds]
    pool = held or [shard for shard, _ in rows]
    return max(set(pool), key=lambda s: (pool.count(s), -pool.index(s)))


def _all_gather_ints(row: list[int], world: int, device: torch.device) -> list[list[int]]:
    mine = torch.tensor(row, dtype=torch.int64, device=device)
    out = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(out, mine)
    return [t.tolist() for t in out]


def _leave_refused(line: str) -> None:
    """A refused node's ranks: one line (local rank 0 says it) and exit code 2, which its agent
    does not restart; the process group is not left (its peers carry on without it)."""
    import os
    import sys

    from .. import worker_env
    from .reconfigure import skip_leave_at_exit

    if worker_env.read().me.local_rank == 0:
        print(f"error: {line}", file=sys.stderr, flush=True)
    skip_leave_at_exit()
    os._exit(2)


# ---------------------------------------------------------------------- local shards, for a heal

def _local(value: Any) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.to_local().detach()
    if isinstance(value, dict):
        return type(value)((k, _local(v)) for k, v in value.items())
    if isinstance(value, list):
        return [_local(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_local(v) for v in value)
    return value


def capture_local(module: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    """This rank's own shards of the model and optimizer state (no collective)."""
    with torch.no_grad():
        return _local(module.state_dict()), _local(optimizer.state_dict())


def load_local(module: nn.Module, optimizer: torch.optim.Optimizer, model_state: dict[str, Any],
               optimizer_state: dict[str, Any]) -> None:
    """Take a peer's shards of the same local rank: copied into this rank's DTensors in place;
    optimizer state wrapped as DTensors like their parameters (no collective)."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        own = dict(module.named_parameters())
        own.update(dict(module.named_buffers()))
        for name, target in module.state_dict().items():
            source = model_state.get(name)
            if source is None:
                raise ElasticRunError(f"the replica's state has no {name!r}: the nodes run different models")
            held = own.get(name, target)
            local = held.to_local() if isinstance(held, DTensor) else held
            if tuple(local.shape) != tuple(source.shape):
                raise ElasticRunError(f"{name!r}: this rank's shard is {tuple(local.shape)}, the replica's "
                                      f"{tuple(source.shape)}: the nodes shard the model differently")
            local.copy_(source)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    ids = [i for group in optimizer_state["param_groups"] for i in group["params"]]
    by_id = dict(zip(ids, params))
    state: dict[Any, Any] = {}
    for key, entry in optimizer_state["state"].items():
        param = by_id.get(key)
        wrapped = {}
        for name, value in entry.items():
            if isinstance(param, DTensor) and isinstance(value, torch.Tensor) and value.dim() > 0 \
                    and tuple(value.shape) == tuple(param.to_local().shape):
                value = DTensor.from_local(value, param.device_mesh, param.placements, run_check=False,
                                           shape=param.shape, stride=param.stride())
            wrapped[name] = value
        state[key] = wrapped
    optimizer.load_state_dict({"state": state, "param_groups": optimizer_state["param_groups"]})


__all__ = ["HsdpInPlace", "capture_local", "load_local", "off_reason"]
