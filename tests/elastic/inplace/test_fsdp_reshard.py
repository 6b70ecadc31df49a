"""A model sharded over a node's ranks alone, cut anew over a world across every node, in the
same processes (``elastic.inplace.fsdp_private.reshard``): what a spare needs to take a lost
node's place in a job sharded across every node (it built its model in a set-up world of its
own node), and what a world that shrank needs to re-shard from memory (issue 52).

Real processes, a real gloo world of 4 under plain env:// (2 "nodes" x 2 ranks). Each
builds the reference model over a 1-D mesh of all four, and the same model over its own
node's two ranks (a 2-way cut). The reference trains a step; the 2-way model is re-cut
4-way (every ``nn.Parameter`` object kept: the optimizer built before still steps them),
takes the reference's shards and AdamW state as a heal sends them, and both train 5 more
steps: their shards and optimizer state are bitwise equal at every step, uneven shards
included (30 and 5 rows over 4 ranks: 8, 8, 8, 6 and 2, 2, 1, 0)."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.elastic import test_replica_check as ddp
from tests.support.spawn import python

SCRIPT = textwrap.dedent('''\
    import os
    import torch, torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from elastic.inplace import fsdp_private
    from elastic.inplace.hsdp import capture_local, load_local
    from elastic.inplace.peer_copies import host_copy

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    def build(mesh):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 30), nn.ReLU(), nn.Linear(30, 5))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step(model, optimizer, x):
        optimizer.zero_grad()
        model(x[rank * 2:rank * 2 + 2]).square().mean().backward()
        optimizer.step()

    def differ(a, b):
        (ma, oa), (mb, ob) = capture_local(*a), capture_local(*b)
        bad = [k for k in ma if not torch.equal(ma[k], mb[k])]
        bad += [f"{k}.{n}" for k, v in oa["state"].items() for n, t in v.items()
                if not torch.equal(t, ob["state"][k][n])]
        return bad

    ref = build(init_device_mesh("cpu", (world,), mesh_dim_names=("shard",)))
    nodes = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    base = 2 * (rank // 2)
    own = DeviceMesh.from_group(nodes[rank // 2], "cpu", mesh=torch.tensor([base, base + 1]), mesh_dim_names=("shard",))
    cut = build(own)  # its node's two ranks alone: each holds half of every parameter
    halves = {k: tuple(v.shape) for k, v in capture_local(*cut)[0].items()}
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(8, 16, generator=g) for _ in range(6)]
    step(*ref, xs[0])
    step(*cut, xs[0])  # trained in its own world: a state the heal must replace whole
    ids = [id(p) for p in cut[0].parameters()]
    fsdp_private.reshard(cut[0], DeviceMesh.from_group(dist.group.WORLD, "cpu", mesh=torch.arange(world),
                                                       mesh_dim_names=("shard",)))
    assert [id(p) for p in cut[0].parameters()] == ids, "a parameter object was replaced"
    assert [id(p) for g in cut[1].param_groups for p in g["params"]] == ids, "the optimizer lost its parameters"
    (model_state, optimizer_state), _ = host_copy(capture_local(*ref))  # as a heal delivers it: a copy
    load_local(cut[0], cut[1], model_state, optimizer_state)
    assert not differ(ref, cut), differ(ref, cut)
    for i, x in enumerate(xs[1:]):
        step(*ref, x)
        step(*cut, x)
        assert not differ(ref, cut), (i, differ(ref, cut))
    quarters = {k: tuple(v.shape) for k, v in capture_local(*cut)[0].items()}
    print(f"RESHARDED {rank} {halves} -> {quarters}", flush=True)
    dist.destroy_process_group()
''')


@pytest.mark.slow
def test_a_model_cut_over_its_node_alone_is_cut_anew_across_every_node_and_trains_bitwise_as_one_built_so(
        tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text(SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    store = dist.TCPStore("127.0.0.1", 0, 4, is_master=True, wait_for_workers=False)
    procs = []
    for rank in range(4):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "RANK": str(rank),
               "WORLD_SIZE": "4", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ddp.ROOT),
               "TORCHELASTIC_USE_AGENT_STORE": "True"}
        procs.append(python([str(tmp_path / "job.py")], out / f"rank{rank}.log", env=env, cwd=out))
    ddp._wait(procs, tmp_path, timeout=240)
    said = {rank: (out / f"rank{rank}.log").read_text() for rank in range(4)}
    assert "RESHARDED 3 {'0.weight': (15, 16), '0.bias': (15,), '2.weight': (2, 30), '2.bias': (2,)} -> " \
           "{'0.weight': (6, 16), '0.bias': (6,), '2.weight': (0, 30), '2.bias': (0,)}" in said[3], said[3]
    assert all(f"RESHARDED {rank}" in said[rank] for rank in range(4)), said
