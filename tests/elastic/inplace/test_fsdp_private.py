"""What :mod:`elastic.inplace.fsdp_private` relies on in torch's private FSDP2 and DeviceMesh.

If this fails after a torch upgrade, HSDP in place must be re-checked before use: the run
would re-form a mesh whose internals changed. One process, a world of one, in milliseconds.
"""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace
from typing import Iterator

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from elastic.inplace import fsdp_private
from elastic.inplace.hsdp import HsdpInPlace, capture_local, load_local, off_reason


@pytest.fixture
def world_of_one() -> Iterator[None]:
    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=10))
    try:
        yield
    finally:
        dist.destroy_process_group()


def _hsdp() -> tuple[nn.Module, torch.optim.Optimizer, object]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2), mesh


def test_this_torch_has_what_hsdp_in_place_touches() -> None:
    assert fsdp_private.unsupported_reason() is None


def test_the_mesh_is_re_formed_in_the_object_the_dtensors_hold(world_of_one: None) -> None:
    model, optimizer, mesh = _hsdp()
    assert off_reason(model, ("replicate", "shard")) is None
    groups = list(fsdp_private.param_groups(model))
    assert len(groups) == 2  # one per block (the root holds no parameter of its own)
    for group in groups:  # what point_at rewrites
        assert {"mesh_info", "post_forward_mesh_info", "fsdp_params"} <= set(vars(group))
        for param in group.fsdp_params:
            assert {"mesh_info", "post_forward_mesh_info", "_shard_mesh"} <= set(vars(param))
            assert callable(param._init_shard_mesh)
    count = fsdp_private.group_count()
    takeover = HsdpInPlace(model, 1)
    takeover.rebuild(SimpleNamespace(world_size=1))
    assert fsdp_private.group_count() >= count
    assert model[0].weight.device_mesh is mesh and mesh.shape == (1, 1)
    for group in groups:  # FSDP2 now reduce-scatters only, the run's hook all-reduces
        assert type(group.mesh_info).__name__ == "FSDPMeshInfo"
        assert group._all_reduce_hook is not None
        assert group.post_forward_mesh_info in (None, group.mesh_info)
    x, y = torch.randn(3, 4), torch.randint(0, 2, (3,))
    F.cross_entropy(model(x), y).backward()
    assert takeover.take_failure() is None
    optimizer.step()

    # a heal's payload: local shards out, and back into a second model of the same shape
    model_state, optimizer_state = capture_local(model, optimizer)
    assert all(not hasattr(t, "device_mesh") for t in model_state.values())
    other, other_opt, _ = _hsdp()
    load_local(other, other_opt, model_state, optimizer_state)
    for a, b in zip(model.parameters(), other.parameters()):
        assert torch.equal(a.to_local(), b.to_local())
    state = other_opt.state_dict()["state"]
    assert state and all(hasattr(s["exp_avg"], "device_mesh") for s in state.values())


def test_a_mesh_sharded_across_every_node_takes_the_restart_path() -> None:
    assert "restarts the workers" in (off_reason(nn.Linear(1, 1), ("shard",)) or "")


def test_the_shard_size_a_world_keeps_is_the_one_of_the_ranks_that_hold_state() -> None:
    from elastic.inplace.hsdp import refused_shard_size

    assert refused_shard_size([(2, True), (2, True)]) is None
    assert refused_shard_size([(2, True), (2, True), (3, False), (3, False), (3, False)]) == 2
    assert refused_shard_size([(3, False), (3, False), (3, False), (2, True), (2, True)]) == 2
    assert refused_shard_size([(2, False), (2, False), (3, False), (3, False), (3, False)]) == 3  # the start: most
