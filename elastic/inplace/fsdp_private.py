"""Every private torch attribute HSDP in place relies on, behind one small module.

FSDP2 and DeviceMesh keep their process groups where no public API can change them: a
mesh's groups are fixed when it is built, and each ``fully_shard`` parameter group caches
its mesh's groups, sizes and ranks in a mesh-info dataclass. To re-form a world in the same
processes (:mod:`.hsdp`), the run rebuilds the mesh over the current world and swaps it into
the very object the script's DTensors point at, and gives FSDP2 mesh infos of that mesh.
What that touches (torch 2.14.1):

* ``DeviceMesh.__dict__``: a fresh mesh's fields copied into the script's mesh object, so
  that every DTensor (parameters, gradients, optimizer state) follows without being rebuilt;
* ``torch.distributed.distributed_c10d._world.group_count``: the counter that names a new
  group; survivors and a joiner have made different numbers of groups, so the run agrees on
  one value before building the mesh's groups (every rank must name them alike);
* ``FSDPModule._get_fsdp_state()._fsdp_param_groups``, each group's ``fsdp_params``,
  ``mesh_info``, ``post_forward_mesh_info``, and each parameter's ``mesh_info`` (refreshed
  by its dataclass's ``__post_init__``) and ``_shard_mesh``;
* ``FSDPMeshInfo`` (``torch.distributed.fsdp._fully_shard._fsdp_common``): a shard-only mesh
  info, so that FSDP2 reduce-scatters inside a node and leaves the replicate all-reduce to
  the public ``set_all_reduce_hook``, where the run can catch a lost peer;
* for :func:`reshard` (a model cut anew over a mesh of another size, for FSDP across every
  node): ``FSDPParam._init_sharded_param``, ``_orig_size``, ``all_gather_outputs``,
  ``_unsharded_param``, ``sharded_param`` and ``_setattr_on_modules``, and the public
  ``torch.utils.swap_tensors`` that keeps each ``nn.Parameter`` object the optimizer holds;
* for :mod:`.fsdp_guard`: each parameter group's ``_all_gather_comm`` and
  ``_reduce_scatter_comm`` (:func:`comms`, :func:`set_comms`).

:func:`unsupported_reason` says in one line why this torch lacks any of it (the run then
takes the restart path), and ``tests/elastic/inplace/test_fsdp_private.py`` fails loudly if
a torch upgrade changes it.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch import nn


def unsupported_reason() -> str | None:
    """None if this torch has everything :mod:`.hsdp` touches; else what is missing, in one line."""
    try:
        import torch.distributed.distributed_c10d as c10d
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, HSDPMeshInfo  # noqa: F401
        from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    except ImportError as exc:
        return f"this torch ({torch.__version__}) lacks what HSDP in place needs ({exc})"
    checks = [
        (hasattr(c10d, "_world") and hasattr(c10d._world, "group_count"), "distributed_c10d._world.group_count"),
        (hasattr(FSDPModule, "_get_fsdp_state"), "FSDPModule._get_fsdp_state"),
        (hasattr(FSDPModule, "set_all_reduce_hook"), "FSDPModule.set_all_reduce_hook"),
        (hasattr(DeviceMesh, "get_group"), "DeviceMesh.get_group"),
        ("_all_reduce_process_group" in dir(FSDPParamGroup), "FSDPParamGroup._all_reduce_process_group"),
        (hasattr(FSDPParam, "_init_sharded_param"), "FSDPParam._init_sharded_param"),  # reshard
        (hasattr(FSDPParam, "_setattr_on_modules"), "FSDPParam._setattr_on_modules"),
        (hasattr(torch.utils, "swap_tensors"), "torch.utils.swap_tensors"),
        (hasattr(FSDPModule, "set_custom_all_gather"), "FSDPModule.set_custom_all_gather"),  # fsdp_guard
    ]
    for ok, name in checks:
        if not ok:
            return f"this torch ({torch.__version__}) has no {name}, which HSDP in place relies on"
    return None


def group_count() -> int:
    """How many process groups this process has named so far."""
    import torch.distributed.distributed_c10d as c10d

    return int(c10d._world.group_count)


def set_group_count(count: int) -> None:
    """Name the next group ``count`` (only ever raised: a name is never reused in a process)."""
    import torch.distributed.distributed_c10d as c10d

    c10d._world.group_count = max(int(c10d._world.group_count), int(count))


def swap_mesh(old: Any, new: Any) -> None:
    """Make ``old`` (the script's mesh, which every DTensor holds) into ``new``, in place."""
    old.__dict__.clear()
    old.__dict__.update(new.__dict__)


def param_groups(model: nn.Module) -> Iterator[Any]:
    """Every FSDP2 parameter group in ``model``, once each."""
    from torch.distributed.fsdp import FSDPModule

    seen: set[int] = set()
    for module in model.modules():
        if isinstance(module, FSDPModule):
            for group in module._get_fsdp_state()._fsdp_param_groups:
                if id(group) not in seen:
                    seen.add(id(group))
                    yield group


def shard_only(mesh: Any, shard_dim: int) -> Any:
    """A mesh info by which FSDP2 reduce-scatters over ``shard_dim`` and all-reduces nothing itself."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo

    return FSDPMeshInfo(mesh, shard_mesh_dim=shard_dim)


def point_at(group: Any, info: Any) -> None:
    """Make a parameter group use ``info`` for its collectives, before and after forward alike
    (the same object, so FSDP2 never reshards to another mesh after the forward), and refresh
    each parameter's cached groups, sizes and ranks from its (rebuilt) mesh."""
    group.mesh_info = info
    if group.post_forward_mesh_info is not None:  # None on the root, which keeps its parameters
        group.post_forward_mesh_info = info
    for param in group.fsdp_params:
        param.mesh_info.__post_init__()
        if param.post_forward_mesh_info is not None and param.post_forward_mesh_info is not param.mesh_info:
            param.post_forward_mesh_info = param.mesh_info
        param._shard_mesh = param._init_shard_mesh()


def reshard(model: nn.Module, mesh: Any, shard_dim: int = 0) -> None:
    """Cut every FSDP2 parameter of ``model`` anew over ``mesh``: another size (a node's spare,
    sharded over its node alone in its set-up world, joining a world across every node; a
    world that shrank), or another place in it. The ``nn.Parameter`` objects stay the same
    (``torch.utils.swap_tensors``), so the optimizer's references hold; their **values are
    not kept** (zeros): the caller loads the state for the new cut, and the optimizer's state
    of the old cut must be replaced too. Not a collective.

    Touches what ``fully_shard`` set up per parameter (``FSDPParam._init_sharded_param``,
    the all-gather buffers sized for the old cut, the unsharded parameter viewing them)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo

    info = FSDPMeshInfo(mesh, shard_mesh_dim=shard_dim)
    for group in param_groups(model):
        group.mesh_info = info
        if group.post_forward_mesh_info is not None:
            group.post_forward_mesh_info = info
        for param in group.fsdp_params:
            old = param.sharded_param
            local = old._local_tensor
            full = nn.Parameter(torch.zeros(param._orig_size, dtype=local.dtype, device=local.device),
                                requires_grad=old.requires_grad)
            if hasattr(param, "_unsharded_param"):  # views the all-gather buffers of the old cut
                del param._unsharded_param
            param.all_gather_outputs = []
            param._init_sharded_param(full, param.device, None, info)
            if param.post_forward_mesh_info is not None:
                param.post_forward_mesh_info = param.mesh_info
            torch.utils.swap_tensors(old, param.sharded_param)
            param.sharded_param = old
            param._setattr_on_modules(old)


def comms(group: Any) -> tuple[Any, Any]:
    """A parameter group's all-gather and reduce-scatter (what ``set_custom_all_gather`` and
    ``set_custom_reduce_scatter`` set, FSDP2's defaults otherwise)."""
    return group._all_gather_comm, group._reduce_scatter_comm


def set_comms(group: Any, gather: Any, scatter: Any) -> None:
    group._all_gather_comm, group._reduce_scatter_comm = gather, scatter


def post_forward_reshards_elsewhere(model: nn.Module) -> bool:
    """Whether a group reshards to another mesh after forward (``reshard_after_forward=int``):
    that mesh is FSDP2's own, not the script's, and the run cannot rebuild it."""
    for group in param_groups(model):
        pf = group.post_forward_mesh_info
        if pf is not None and pf is not group.mesh_info:
            return True
    return False


__all__ = ["comms", "group_count", "param_groups", "point_at", "post_forward_reshards_elsewhere", "reshard", "set_group_count",
           "shard_only", "swap_mesh", "unsupported_reason"]
