"""A model sharded with FSDP2 (``fully_shard``), alone or as HSDP: how the run recognises it and
what it refuses.

A sharded model already syncs its gradients inside its own backward (all-gather, then
reduce-scatter over the shard dimension and all-reduce over the replicate one), and its
parameters are ``DTensor``s on the script's device mesh. Wrapping it in DDP, as the run does
with a replicated model, fails in DDP's constructor ("c10d.broadcast_.default does not have a
sharding strategy registered"), so the run trains it as it is (:class:`elastic.grad_sync.GradSync`).

What is refused, each in one line (every rank hits it alike, so exit 2 and no restart):

* a mesh whose replicate dimension runs inside a node (a node's ranks would hold
  replicas of each other, and a lost node would take whole shards with it), or whose shard
  dimension spans nodes in an HSDP mesh, or whose shard size differs from the node's local
  rank count (the shard dimension must be exactly one node's ranks);
* DDP and FSDP mixed in one model (DDP around a sharded model, or inside one);
* an optimizer built before ``fully_shard`` (it holds the plain parameters that
  ``fully_shard`` replaced: it would step tensors the model no longer uses).

The pure decisions (:func:`mesh_problem`, :func:`optimizer_problem`) take plain values so
they are unit-tested in milliseconds.

**How a sharded run recovers.** HSDP (replicas across nodes, shards inside one) recovers in
place under ``elastic agent`` (:mod:`elastic.inplace.hsdp`): a lost node shrinks the
mesh's replicate dimension without a restart, a joiner is healed shard by shard from a live
replica. A model sharded across every node has no replica to heal from: with peer copies on
it recovers in place from them (:mod:`elastic.inplace.fsdp_in_place`); without, it takes the
restart path (one line says so, :func:`restart_reason`), as does any sharded run under
plain torchrun, and every restart resumes from the newest snapshot. Snapshots of a sharded
model hold its full state (:func:`full_state`, gathered to rank 0 by
``torch.distributed.checkpoint.state_dict``), so a resume works at another replica count
and at another shard count.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .distributed import ElasticRunError

#: Why a sharded run takes the restart path, in general (rank 0 says the specific reason
#: once, from :func:`restart_reason`; the agent is told).
RESTART_REASON = ("the model is sharded (FSDP2/HSDP) and cannot recover in place, so a lost or joining node "
                  "restarts the workers and they resume from the newest snapshot")


def restart_reason(model: nn.Module, layout: "MeshLayout | None", peer_copies: bool = False) -> str | None:
    """Why this model takes the restart path (None: not sharded, or HSDP, which recovers in place,
    or sharded across every node with peer copies asked for)."""
    if layout is None:
        return None
    from .inplace.hsdp import off_reason

    why = off_reason(model, layout.kinds, peer_copies)
    return None if why is None else f"the model is sharded (FSDP2/HSDP): {why}"


def take_over(module: nn.Module, layout: "MeshLayout | None", world: Any, sync: Any) -> Any:
    """HSDP in an in-place world: the run re-forms the script's mesh at every formation
    (:class:`elastic.inplace.hsdp.HsdpInPlace`); None otherwise (FSDP across every node:
    :func:`take_over_fsdp`)."""
    from .inplace.in_place_world import InPlaceWorld

    if layout is None or not isinstance(world, InPlaceWorld) or restart_reason(module, layout) is not None:
        return None
    from .inplace.hsdp import HsdpInPlace

    # its formations re-form the mesh (the mesh's groups on the world's socket fence) and pair heals
    world.hsdp = HsdpInPlace(module, layout.shard_size, sync, fence=world.membership.fence)
    world.membership.whole_node = True  # a node's shards are one unit: its agent starts its ranks again together
    return world.hsdp


def take_over_fsdp(module: nn.Module, optimizer: torch.optim.Optimizer, layout: "MeshLayout | None", world: Any,
                   sync: Any, copies: Any) -> Any:
    """FSDP across every node in an in-place world (peer copies on): the run re-forms the
    script's 1-D mesh at every formation and takes a lost node's shards from its buddies'
    memory (:class:`elastic.inplace.fsdp_in_place.FsdpInPlace`); None otherwise."""
    from .inplace.in_place_world import InPlaceWorld

    if layout is None or tuple(layout.kinds) != ("shard",) or not isinstance(world, InPlaceWorld):
        return None
    from .inplace.fsdp_in_place import FsdpInPlace

    world.fsdp = FsdpInPlace(module, optimizer, sync, copies, fence=world.membership.fence)
    world.membership.whole_node = True  # a node's ranks hold one node's positions: restarted together
    return world.fsdp


@dataclass(frozen=True)
class MeshLayout:
    """The device mesh a sharded model's parameters live on, as plain values.

    ``ranks`` is the mesh's global ranks, row-major, with ``shape``; ``kinds[d]`` is
    ``"replicate"`` or ``"shard"`` for mesh dimension ``d`` (from the parameters' placements)."""

    shape: tuple[int, ...]
    ranks: tuple[int, ...]
    kinds: tuple[str, ...]
    names: tuple[str, ...]

    def along(self, dim: int, rank: int) -> list[int]:
        """The ranks that share every coordinate with ``rank`` but the one of ``dim``."""
        index = self.ranks.index(rank)
        coords = list(_unravel(index, self.shape))
        out = []
        for i in range(self.shape[dim]):
            coords[dim] = i
            out.append(self.ranks[_ravel(coords, self.shape)])
        return out

    def label(self, dim: int) -> str:
        return repr(self.names[dim]) if self.names and self.names[dim] else f"dimension {dim}"

    @property
    def shard_size(self) -> int:
        size = 1
        for n, kind in zip(self.shape, self.kinds):
            if kind == "shard":
                size *= n
        return size

    @property
    def replicas(self) -> int:
        size = 1
        for n, kind in zip(self.shape, self.kinds):
            if kind == "replicate":
                size *= n
        return size


def _unravel(index: int, shape: Sequence[int]) -> tuple[int, ...]:
    out = []
    for n in reversed(shape):
        out.append(index % n)
        index //= n
    return tuple(reversed(out))


def _ravel(coords: Sequence[int], shape: Sequence[int]) -> int:
    index = 0
    for c, n in zip(coords, shape):
        index = index * n + c
    return index


def mesh_problem(layout: MeshLayout, world_size: int, local_world_size: int) -> str | None:
    """Why this mesh cannot be trained by the run (None: it can). Ranks are placed by node
    as torchrun places them: node ``k`` holds ranks ``k*L .. k*L+L-1`` (``L`` local ranks)."""
    if len(layout.ranks) != world_size:
        return (f"the model's device mesh covers {len(layout.ranks)} ranks but the world has {world_size}: build the "
                "mesh over every rank (init_device_mesh with the world's size)")
    if layout.replicas == 1:  # FSDP across every rank: no replica, nothing to place
        return None
    local = max(1, local_world_size)
    if layout.shard_size != local:
        return (f"this node runs {local} local ranks but the mesh's shard size is {layout.shard_size}: the shard "
                "dimension must be one node's ranks (replicas across nodes, shards inside one); start every node "
                f"with --nproc-per-node {layout.shard_size}, or build the mesh as init_device_mesh(device, (nodes, "
                f"{local}), mesh_dim_names=('replicate', 'shard'))")

    def node(rank: int) -> int:
        return rank // local

    for dim, kind in enumerate(layout.kinds):
        for rank in layout.ranks:
            nodes = [node(r) for r in layout.along(dim, rank)]
            if kind == "replicate" and layout.shape[dim] > 1 and len(set(nodes)) != len(nodes):
                return (f"the mesh's replicate dimension ({layout.label(dim)}) runs inside a node: a node's own ranks "
                        "would hold replicas of each other and a lost node would take whole shards with it; build "
                        f"the mesh as init_device_mesh(device, (nodes, {local}), mesh_dim_names=('replicate', "
                        "'shard')): replicas across nodes, shards inside one")
            if kind == "shard" and len(set(nodes)) != 1:
                return (f"the mesh's shard dimension ({layout.label(dim)}) spans nodes in an HSDP mesh: shard "
                        "inside a node and replicate across nodes, as init_device_mesh(device, (nodes, "
                        f"{local}), mesh_dim_names=('replicate', 'shard'))")
    return None


def optimizer_problem(model_params: set[int], optimizer_params: Sequence[tuple[int, bool]]) -> str | None:
    """Why this optimizer cannot train the sharded model (None: it can). ``model_params``:
    the ids of the model's parameters; ``optimizer_params``: (id, is a DTensor) per parameter
    the optimizer holds."""
    stale = [pid for pid, is_dtensor in optimizer_params if pid not in model_params or not is_dtensor]
    if not stale:
        return None
    return (f"the optimizer holds {len(stale)} parameter(s) that are not the sharded model's: it was built before "
            "fully_shard, which replaces every parameter with a sharded one; build the optimizer after fully_shard "
            "(optimizer = AdamW(model.parameters()) once the model is sharded)")


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` (or any module in it) is FSDP2-sharded: an ``FSDPModule`` or ``DTensor`` parameters."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    if any(isinstance(m, FSDPModule) for m in model.modules()):
        return True
    return any(isinstance(p, DTensor) for p in model.parameters())


def layout_of(model: nn.Module) -> MeshLayout | None:
    """The mesh of the model's first sharded parameter, with its placements (None: none is a DTensor)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    for p in model.parameters():
        if isinstance(p, DTensor):
            mesh = p.device_mesh
            kinds = tuple("replicate" if isinstance(pl, Replicate) else "shard" if isinstance(pl, Shard) else
                          type(pl).__name__ for pl in p.placements)
            ranks = tuple(int(r) for r in mesh.mesh.reshape(-1).tolist())
            return MeshLayout(tuple(int(n) for n in mesh.mesh.shape), ranks, kinds, tuple(mesh.mesh_dim_names or ()))
    return None


def check(model: nn.Module, optimizer: torch.optim.Optimizer, local_world_size: int) -> MeshLayout | None:
    """The sharded model's mesh (None: the model is not sharded); raises :class:`ElasticRunError`
    in one line for what the run cannot train (see the module's docstring)."""
    if not is_sharded(model):
        return None
    if isinstance(model, DistributedDataParallel) or any(isinstance(m, DistributedDataParallel)
                                                         for m in model.modules()):
        raise ElasticRunError("the model mixes DistributedDataParallel and FSDP (fully_shard): a sharded model syncs "
                              "its own gradients; pass the fully_shard-ed model itself, without DDP")
    from torch.distributed.tensor import DTensor

    problem = optimizer_problem({id(p) for p in model.parameters()},
                                [(id(p), isinstance(p, DTensor)) for g in optimizer.param_groups for p in g["params"]])
    if problem is not None:
        raise ElasticRunError(problem)
    layout = layout_of(model)
    if layout is None:
        raise ElasticRunError("the model is an FSDPModule but none of its parameters is sharded: call fully_shard "
                              "on its blocks and on the root before the optimizer is built")
    world = dist.get_world_size() if dist.is_initialized() else 1
    problem = mesh_problem(layout, world, local_world_size)
    if problem is not None:
        raise ElasticRunError(problem)
    return layout


def check_snapshots(every_seconds: float | None) -> None:
    """A sharded snapshot is captured by every rank at once, so it must be due on every rank at
    the same step: by steps, not by each rank's own clock."""
    if every_seconds is not None:
        raise ElasticRunError("a sharded model's snapshots are taken by every rank together, at the same step: give "
                              "SnapshotConfig(every_steps=N) instead of every_seconds")


# ---------------------------------------------------------------------- a peer lost in the script's backward

def quiet_lost_peer(where: Callable[[], str], step: Callable[[], int]) -> Callable[[], None]:
    """The prepare API with a sharded model on the restart path: FSDP2's gradient collectives run
    in the script's own ``loss.backward()``, where no comm hook can catch a lost peer. Such a
    failure then ends the worker as :func:`elastic.fixed_world.exit_for_restart` would: one line
    (also in torchrun's error file), no traceback, exit 1, and the agent restarts the world.
    Anything else is reported as before. Returns what puts the previous hook back."""
    global _lost_peer_line
    _lost_peer_line = (where, step)
    previous = sys.excepthook

    def hook(kind: type[BaseException], exc: BaseException, tb: Any) -> None:
        if not told_lost_peer(exc):
            previous(kind, exc, tb)

    sys.excepthook = hook  # a script run as ``python script.py``; a warm worker asks told_lost_peer

    def restore() -> None:
        global _lost_peer_line
        _lost_peer_line = None
        if sys.excepthook is hook:
            sys.excepthook = previous
    return restore


_lost_peer_line: tuple[Callable[[], str], Callable[[], int]] | None = None


def told_lost_peer(exc: BaseException) -> bool:
    """Whether ``exc`` (out of the script) is a lost peer of a sharded run on the restart path,
    now said in one line (and in torchrun's error file): then no traceback is due."""
    from .fixed_world import exit_for_restart
    from .collectives import is_collective_failure, noticed_of
    from .log import how_noticed

    if _lost_peer_line is None or not is_collective_failure(exc):
        return False
    where, step = _lost_peer_line
    try:
        exit_for_restart(where(), step(), how_noticed(noticed_of(exc)))
    except SystemExit:
        pass  # the process is on its way out already, with exit code 1
    return True


# ---------------------------------------------------------------------- state (restart path)

def full_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    """(model, optimizer) full state dicts, keyed by parameter name, on the CPU of rank 0
    (empty elsewhere). A collective over the model's mesh: every rank calls it at once."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from .collectives import collective_failures

    with collective_failures():  # a peer lost while gathering: the step is abandoned, as in its backward
        return get_state_dict(module, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full_state(module: nn.Module, optimizer: torch.optim.Optimizer, model_state: dict[str, Any],
                    optimizer_state: dict[str, Any]) -> None:
    """Every rank takes its own shards of a full state (any shard and replica count wrote it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    set_state_dict(module, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state,
                   options=StateDictOptions(full_state_dict=True))


def sharded_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    """(model, optimizer) state dicts of ``DTensor``s: each rank's own shards, as DCP saves them."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from .collectives import collective_failures

    with collective_failures():
        return get_state_dict(module, optimizer)


def load_dcp(module: nn.Module, optimizer: torch.optim.Optimizer, path: Any,
             files: Mapping[str, tuple[int, str] | tuple[int, str, str]] | None = None) -> None:
    """Every rank reads its own shards of a sharded snapshot (:mod:`checkpoints.sharded`),
    whatever shard and replica count wrote it: DCP reshards. A collective. The caller has
    verified every file against the signed manifest: DCP unpickles ``.metadata``. In an
    object store (``s3://``) each rank fetches only its shards' byte ranges, each checked
    against ``files``, the manifest's record and the version the load verified
    (:mod:`checkpoints.s3dcp`)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from checkpoints.location import is_remote
    from checkpoints.s3dcp import unwrapped

    from .collectives import collective_failures

    reader: Any
    if is_remote(str(path)):
        from checkpoints.s3dcp import S3DcpReader

        reader = S3DcpReader(str(path), files or {})
    else:
        reader = dcp.FileSystemReader(str(path))
    model_state, optimizer_state = get_state_dict(module, optimizer)
    problem = dcp_shape_problem(reader.read_metadata().state_dict_metadata,
                                {f"model.{k}": tuple(v.shape) for k, v in model_state.items()
                                 if isinstance(v, torch.Tensor)})
    if problem is not None:
        raise ElasticRunError(f"snapshot {path} {problem}; resume with the model that wrote it, or start with an "
                              "empty snapshot directory")
    state = {"model": model_state, "optimizer": optimizer_state}
    try:
        with collective_failures():
            dcp.load(state, storage_reader=reader)
    except dcp.api.CheckpointException as e:
        corrupt = unwrapped(e)
        if corrupt is not None:  # what a rank fetched is not what the manifest verified (checkpoints.s3dcp)
            raise corrupt from None
        first = (str(e).strip().splitlines() or ["?"])[0][:200]
        raise ElasticRunError(f"snapshot {path} does not match this model and optimizer ({first}); resume with "
                              "the same model and optimizer, or start with an empty snapshot directory") from None
    set_state_dict(module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def dcp_shape_problem(saved: dict[str, Any], wanted: dict[str, tuple[int, ...]]) -> str | None:
    """Why a snapshot's tensors (DCP's metadata by key) cannot load into ``wanted`` (global
    shapes by key), in a few words; None: every wanted tensor is there with its shape."""
    missing = [k for k in wanted if k not in saved]
    other = [(k, tuple(saved[k].size), shape) for k, shape in wanted.items()
             if k in saved and hasattr(saved[k], "size") and tuple(saved[k].size) != shape]
    if other:
        k, there, here = other[0]
        more = f" (and {len(other) - 1} more)" if len(other) > 1 else ""
        return f"holds another model: {k.removeprefix('model.')!r} is {there} there and {here} here{more}"
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        return f"holds another model: it has no {missing[0].removeprefix('model.')!r}{more}"
    return None


def full_shapes(module: nn.Module) -> dict[str, torch.Size]:
    """Each parameter and buffer's global shape, for comparing with a snapshot's."""
    return {name: t.shape for name, t in module.state_dict().items() if isinstance(t, torch.Tensor)}


__all__ = ["MeshLayout", "RESTART_REASON", "check", "check_snapshots", "dcp_shape_problem", "full_state",
           "load_dcp", "sharded_state", "is_sharded", "layout_of", "load_full_state",
           "restart_reason", "take_over", "take_over_fsdp",
           "mesh_problem", "optimizer_problem", "quiet_lost_peer",
           "told_lost_peer"]
