"""A model sharded with FSDP2: recognised, never wrapped in DDP, bad input refused in one line.

The mesh and optimizer rules are pure functions (milliseconds); the rest runs FSDP2 in this
process, in a world of one (a 1-D mesh), as a user's script would build it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from elastic import ElasticRun, SnapshotConfig
from elastic.distributed import ElasticRunError
from elastic.sharded import MeshLayout, check, is_sharded, mesh_problem, optimizer_problem


def _grid(rows: list[list[int]], kinds: tuple[str, ...] = ("replicate", "shard")) -> MeshLayout:
    return MeshLayout((len(rows), len(rows[0])), tuple(r for row in rows for r in row), kinds, ("replicate", "shard"))


# ---------------------------------------------------------------------- the mesh (pure)

def test_hsdp_with_replicas_across_nodes_and_shards_inside_one_is_trained() -> None:
    assert mesh_problem(_grid([[0, 1], [2, 3], [4, 5]]), world_size=6, local_world_size=2) is None


def test_fsdp_across_every_rank_has_no_replica_to_place() -> None:
    assert mesh_problem(MeshLayout((6,), tuple(range(6)), ("shard",), ("shard",)), 6, 2) is None
    assert mesh_problem(_grid([[0, 1, 2, 3]]), 4, 2) is None  # a replicate dimension of one: no replica either


def test_a_replicate_dimension_inside_a_node_is_refused() -> None:
    problem = mesh_problem(_grid([[0, 2], [1, 3]]), world_size=4, local_world_size=2)  # replicas 0 and 1: node 0
    assert problem is not None and "replicate dimension ('replicate') runs inside a node" in problem
    assert "init_device_mesh(device, (nodes, 2)" in problem and "\n" not in problem


def test_a_shard_size_other_than_the_nodes_rank_count_is_refused() -> None:
    problem = mesh_problem(_grid([[0, 1, 2], [3, 4, 5]]), world_size=6, local_world_size=2)
    assert problem is not None and "runs 2 local ranks but the mesh's shard size is 3" in problem


def test_a_shard_dimension_across_nodes_is_refused() -> None:
    # shard groups {0, 2} and {1, 3}: the right size, but each spans nodes 0 and 1
    problem = mesh_problem(MeshLayout((2, 2), (0, 1, 2, 3), ("shard", "replicate"), ()), 4, 2)
    assert problem is not None and "shard dimension (dimension 0) spans nodes" in problem


def test_a_mesh_over_part_of_the_world_is_refused() -> None:
    problem = mesh_problem(_grid([[0, 1]], ("shard", "shard")), world_size=4, local_world_size=2)
    assert problem is not None and "covers 2 ranks but the world has 4" in problem


def test_an_optimizer_of_plain_parameters_was_built_before_fully_shard() -> None:
    assert optimizer_problem({1, 2}, [(1, True), (2, True)]) is None
    problem = optimizer_problem({1, 2}, [(7, False), (8, False)])
    assert problem is not None and "built before fully_shard" in problem and "2 parameter(s)" in problem


# ---------------------------------------------------------------------- FSDP2 in a world of one

class _Data(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(3)
        self.x, self.y = torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def _plain() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _sharded() -> nn.Sequential:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("shard",))
    model = _plain()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def test_a_sharded_model_is_recognised_and_a_plain_one_is_not(world_of_one: None) -> None:
    model = _sharded()
    assert is_sharded(model) and not is_sharded(_plain())
    layout = check(model, torch.optim.AdamW(model.parameters()), local_world_size=1)
    assert layout is not None and layout.kinds == ("shard",) and layout.ranks == (0,)
    assert check(_plain(), torch.optim.SGD(_plain().parameters(), lr=0.1), 1) is None


def test_an_optimizer_built_before_fully_shard_is_refused(world_of_one: None) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _plain()
    optimizer = torch.optim.AdamW(model.parameters())
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    with pytest.raises(ElasticRunError, match="built before fully_shard"):
        check(model, optimizer, 1)


def test_ddp_and_fsdp_mixed_in_one_model_are_refused(world_of_one: None) -> None:
    model = nn.Sequential(DistributedDataParallel(nn.Linear(8, 8)), _sharded())
    with pytest.raises(ElasticRunError, match="mixes DistributedDataParallel and FSDP"):
        check(model, torch.optim.AdamW(model.parameters()), 1)


def _train(model: nn.Module, snapshot_dir: Path, steps: int, **kwargs: Any) -> ElasticRun:
    run = ElasticRun(model, torch.optim.AdamW(model.parameters(), lr=0.01), _Data(48), global_batch_size=8,
                     steps=steps, snapshot_dir=snapshot_dir, metrics=False, handle_sigterm=False, **kwargs)
    for x, y in run:
        run.step(F.cross_entropy(run.model(x), y))
    return run


def _local(model: nn.Module) -> list[torch.Tensor]:
    return [p.to_local().detach().clone() for p in model.parameters()]


def test_a_sharded_model_trains_as_it_is_and_resumes_from_its_snapshot(world_of_one: None, tmp_path: Path) -> None:
    config = SnapshotConfig(every_steps=3, writer="thread")
    whole = _sharded()
    run = _train(whole, tmp_path / "whole", 6, snapshots=config)
    assert run.model is whole and not isinstance(run.model, DistributedDataParallel)
    first = _sharded()
    _train(first, tmp_path / "split", 3, snapshots=config)
    resumed = _sharded()  # a new process's model, resumed from step 3's snapshot
    again = _train(resumed, tmp_path / "split", 6, snapshots=config)
    assert again.resumed_from == 3
    assert all(torch.equal(a, b) for a, b in zip(_local(whole), _local(resumed)))


def test_a_sharded_models_snapshots_by_time_are_refused_in_one_line(
        world_of_one: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        _train(_sharded(), tmp_path / "snap", 2, snapshots=SnapshotConfig(every_seconds=5.0, writer="thread"))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "SnapshotConfig(every_steps=N) instead of every_seconds" in err


def test_a_lost_peer_in_the_scripts_own_backward_is_one_line_and_anything_else_a_traceback(
        caplog: pytest.LogCaptureFixture) -> None:
    from elastic.sharded import quiet_lost_peer, told_lost_peer
    from tests.support.torch_errors import raised_in_torch  # a mock: gloo's lost peer, raised as torch raises it

    assert not told_lost_peer(RuntimeError("Connection closed by peer"))  # not installed: as before
    restore = quiet_lost_peer(lambda: "[a rank 1]", lambda: 8)
    try:
        assert not told_lost_peer(ValueError("boom"))  # the script's own bug keeps its traceback
        with caplog.at_level("WARNING"):
            assert told_lost_peer(raised_in_torch("[pair.cc:561] Connection closed by peer [127.0.0.1]:4"))
        assert not told_lost_peer(RuntimeError("[pair.cc:561] Connection closed by peer"))  # the script's own words
        assert "[a rank 1] lost a peer in step 8 (its connection closed); the agent restarts this worker" in caplog.text
    finally:
        restore()
    assert not told_lost_peer(RuntimeError("Connection closed by peer"))


def test_a_sharded_snapshot_is_written_per_rank_in_dcps_layout_and_loads_with_dcp_once_verified(
        world_of_one: None, tmp_path: Path) -> None:
    """What docs/training.md says to do outside the service: verify the snapshot with the store
    (checksums, signature), then ``dcp.load`` it straight from its directory into a model of
    any shard count; no copy, no gather."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    from checkpoints import SnapshotStore
    from checkpoints.reading import DCP_DIR_KEY

    trained = _sharded()
    _train(trained, tmp_path / "snap", 3, snapshots=SnapshotConfig(every_steps=3, writer="thread"))
    store = SnapshotStore(tmp_path / "snap", create=False)
    found = store.load_latest()
    assert found is not None and found[0].step == 3
    step_dir = found[1][DCP_DIR_KEY]
    assert "model" not in found[1] and {"sampler", "progress", "rng"} <= set(found[1])
    assert sorted(p.name for p in step_dir.iterdir()) == [".metadata", "000-sampler.pt", "001-progress.pt",
                                                         "002-rng.pt", "MANIFEST.json", "__0_0.distcp"]
    assert store.check(3) == []

    fresh = _sharded()
    target = {"model": get_model_state_dict(fresh)}
    dcp.load(target, checkpoint_id=str(step_dir))
    set_model_state_dict(fresh, target["model"], options=StateDictOptions())
    assert all(torch.equal(a, b) for a, b in zip(_local(trained), _local(fresh)))

    # A flipped byte in a shard file: the store refuses the snapshot before DCP reads it.
    shard = step_dir / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    problems = store.check(3)
    assert problems and "__0_0.distcp: sha256 mismatch" in problems[0]
    assert store.load_latest() is None


def test_fsdp2s_timed_collectives_are_installed_without_changing_a_bit(world_of_one: None) -> None:
    """A world of one issues no collective; tests/agent/test_sharded_restart.py reads the timings."""
    from elastic.metrics.fsdp_timing import time_fsdp_collectives

    def train(timed: bool) -> tuple[list[torch.Tensor], list[Any]]:
        model = _sharded()
        timers = time_fsdp_collectives(model, "gloo") if timed else []
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        data = _Data(16)
        for i in range(0, 16, 4):
            optimizer.zero_grad()
            F.cross_entropy(model(data.x[i:i + 4]), data.y[i:i + 4]).backward()
            optimizer.step()
        return _local(model), timers

    plain, _ = train(False)
    timed, timers = train(True)
    assert all(torch.equal(a, b) for a, b in zip(plain, timed))
    assert [t.op for t in timers] == ["allgather", "reducescatter"]
    assert time_fsdp_collectives(_plain(), "gloo") == []  # nothing sharded: nothing to time


def test_a_snapshot_of_another_models_shapes_is_refused_in_one_line(
        world_of_one: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    config = SnapshotConfig(every_steps=2, writer="thread")
    _train(_sharded(), tmp_path / "snap", 2, snapshots=config)
    wider = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    mesh = init_device_mesh("cpu", (1,))
    for layer in wider:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(wider, mesh=mesh)
    with pytest.raises(SystemExit) as exit_info:
        _train(wider, tmp_path / "snap", 4, snapshots=config)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "holds another model: '0.weight' is (16, 8) there and (32, 8) here" in err, err
