"""A world that lost a node and has no spare re-shards the whole state over the smaller world
from memory, and the result equals a snapshot reload at the new size (issue 52).

Real processes, a real gloo world of 6 under plain env:// (3 "nodes" x 2 ranks), an FSDP2
model over a 1-D mesh across all six (30- and 5-row layers: uneven cuts), AdamW, peer copies
after every step. At step 4 every rank also writes a DCP snapshot of the same state (the
restart path's reference). Then node 1 leaves, and the four ranks left (nodes 0 and 2)
form a world of their own: each reports what it holds, the plan takes node 1's positions
from the copies node 2 keeps, and each rank gathers its rows of the new 4-way cut of every
parameter and of AdamW's moments from whichever rank holds them (``peer_restore.regather``),
re-cuts its model (``fsdp_private.reshard``) and loads them. A model built 4-way and loaded
from the snapshot with DCP (which re-shards itself) must hold the same shards and optimizer
state, bit for bit, and both train two more steps alike.

The model has a BatchNorm, whose running stats FSDP2 leaves each rank whole and its own
(they differ: each rank saw its own batches). Rank 4 reports as a newcomer would (no
position of its own, only the copies it keeps), so it takes position 2 of the new cut: its
buffers must be rank 2's (which left) bit for bit, and each survivor's its own.

Not a node loss under agents (node 1's processes end on their own; the in-place world that
would re-form around a SIGKILL is not built for this layout yet): what is tested is the
re-shard from memory once the smaller world has formed."""

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
    import torch.distributed.checkpoint as dcp
    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from elastic.inplace import fsdp_private
    from elastic.inplace.copy_plan import by_position
    from elastic.inplace.hsdp import capture_local, load_local
    from elastic.inplace.peer_copies import PeerCopies
    from elastic.inplace.peer_restore import gather, holding, regather

    dist.init_process_group("gloo")
    rank, world, local = dist.get_rank(), dist.get_world_size(), 2
    node = f"n{rank // local}"
    cpu = torch.device("cpu")
    snapshot = os.environ["SNAPSHOT"]

    def build(mesh):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 30), nn.BatchNorm1d(30), nn.ReLU(), nn.Linear(30, 5))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def train(pair, x, r, n):
        pair[1].zero_grad()
        share = x.shape[0] // n
        pair[0](x[r * share:(r + 1) * share]).square().mean().backward()
        pair[1].step()

    def capture(pair, step):
        model_state, optimizer_state = capture_local(*pair)
        return {"state": {"model": model_state, "optimizer": optimizer_state, "progress": {"step": step}}}

    live = build(init_device_mesh("cpu", (world,), mesh_dim_names=("shard",)))
    left = [0, 1, 4, 5]
    smaller = dist.new_group(left)  # every rank makes it
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(24, 16, generator=g) for _ in range(8)]
    copies = PeerCopies(1)
    for step in range(1, 5):
        train(live, xs[step], rank, world)
        assert copies.after_step(step, rank, world, node, local, lambda: capture(live, step), cpu)
    params = {n for n, _ in live[0].named_parameters()}
    buffers = {k: v.clone() for k, v in capture_local(*live)[0].items() if k not in params}
    torch.save(buffers, f"buffers{rank}.pt")  # before the save's collective: every rank is past it below
    model_sd, optim_sd = get_state_dict(*live)
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=snapshot)
    if rank not in left:  # node 1 leaves
        dist.barrier()
        dist.destroy_process_group()
        raise SystemExit(0)
    me = left.index(rank)
    names = [n for n, _ in live[0].named_parameters()]
    lengths = {n: p.shape[0] for n, p in live[0].named_parameters()}
    # rank 4 reports as a newcomer would (no position, no live state, only the copies it keeps):
    # it takes position 2 in the new cut, so the buffers of rank 2, which left
    reports = gather(holding(copies, me, None if rank == 4 else rank, 4), len(left), group=smaller)
    decided = by_position(reports, world)
    state = regather(decided, copies, me, left, world, names, lengths, lambda: capture(live, 4), group=smaller)
    mesh = DeviceMesh.from_group(smaller, "cpu", mesh=torch.tensor(left), mesh_dim_names=("shard",))
    fsdp_private.reshard(live[0], mesh)
    for k, v in live[0].named_buffers():
        v.fill_(7)  # what the load must overwrite
    load_local(live[0], live[1], state["model"], state["optimizer"])
    # buffers (BatchNorm's running stats, each rank's own): a survivor keeps its own, rank 4 takes rank 2's
    wanted = torch.load(f"buffers{2 if rank == 4 else rank}.pt")
    other = torch.load(f"buffers{3 if rank == 4 else (rank + 1) % 2}.pt")
    got = {k: v for k, v in live[0].named_buffers()}
    assert set(got) == set(wanted) == {"1.running_mean", "1.running_var", "1.num_batches_tracked"}, set(got)
    assert all(torch.equal(got[k], wanted[k]) for k in wanted), rank
    assert not torch.equal(got["1.running_mean"], other["1.running_mean"])  # the ranks' stats do differ
    print(f"BUFFERS {rank} of rank {2 if rank == 4 else rank}", flush=True)
    # the reference: the same model built 4-way and loaded from the snapshot by DCP
    ref = build(DeviceMesh.from_group(smaller, "cpu", mesh=torch.tensor(left), mesh_dim_names=("shard",)))
    model_sd, optim_sd = get_state_dict(*ref)
    loaded = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(loaded, checkpoint_id=snapshot, process_group=smaller)
    set_state_dict(*ref, model_state_dict=loaded["model"], optim_state_dict=loaded["optimizer"])
    with torch.no_grad():  # a snapshot holds one rank's buffers: the reference takes this rank's
        for (_, a), (_, b) in zip(ref[0].named_buffers(), live[0].named_buffers()):
            a.copy_(b)

    def differ():
        (ma, oa), (mb, ob) = capture_local(*ref), capture_local(*live)
        bad = [k for k in ma if not torch.equal(ma[k], mb[k])]
        return bad + [f"{k}.{n}" for k, v in oa["state"].items() for n, t in v.items()
                      if not torch.equal(t, ob["state"][k][n])]

    assert not differ(), differ()
    print(f"SOURCES {rank} {sorted((p, s.kind, left[s.rank]) for p, s in decided.sources.items())}", flush=True)
    for step in range(5, 7):
        train(ref, xs[step], me, len(left))
        train(live, xs[step], me, len(left))
        assert not differ(), (step, differ())
    shapes = {k: tuple(v.shape) for k, v in capture_local(*live)[0].items()}
    print(f"EQUAL {rank} {shapes}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
''')


@pytest.mark.slow
def test_a_smaller_world_re_shards_from_memory_to_what_a_snapshot_reload_at_its_size_gives(tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text(SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    world = 6
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
    procs = []
    for rank in range(world):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "RANK": str(rank),
               "WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ddp.ROOT),
               "TORCHELASTIC_USE_AGENT_STORE": "True", "SNAPSHOT": str(tmp_path / "snapshot")}
        procs.append(python([str(tmp_path / "job.py")], out / f"rank{rank}.log", env=env, cwd=out))
    ddp._wait(procs, tmp_path, timeout=300)
    said = {rank: (out / f"rank{rank}.log").read_text() for rank in range(world)}
    # node 1's positions from node 2's copies; position 4 (rank 4 reports as a newcomer) from the copy
    # node 0 keeps; every other position from the rank that trained at it
    sources = "[(0, 'live', 0), (1, 'live', 1), (2, 'held', 4), (3, 'held', 5), (4, 'held', 0), (5, 'live', 5)]"
    for rank in (0, 1, 4, 5):
        assert f"SOURCES {rank} {sources}" in said[rank], said[rank]
        assert f"EQUAL {rank}" in said[rank], said[rank]
        # BatchNorm's running stats: a survivor keeps its own; the newcomer at position 2 takes rank 2's
        assert f"BUFFERS {rank} of rank {2 if rank == 4 else rank}" in said[rank], said[rank]
    stats = "'1.running_mean': (30,), '1.running_var': (30,), '1.num_batches_tracked': ()"
    assert (f"EQUAL 0 {{'0.weight': (8, 16), '0.bias': (8,), '1.weight': (8,), '1.bias': (8,), {stats}, "
            "'3.weight': (2, 30), '3.bias': (2,)}") in said[0], said[0]
    assert (f"EQUAL 5 {{'0.weight': (6, 16), '0.bias': (6,), '1.weight': (6,), '1.bias': (6,), {stats}, "
            "'3.weight': (0, 30), '3.bias': (0,)}") in said[5], said[5]
