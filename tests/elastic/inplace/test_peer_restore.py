"""A spare filled from its buddies' memory (issue 52): the moves of a recovery from peer copies,
and the spare's model cut anew, bitwise against an undisturbed run.

Real processes, a real gloo world of 6 under plain env:// (3 "nodes" x 2 ranks), an FSDP2
model over a 1-D mesh across all six, AdamW, peer copies after every step. After step 4,
node 1's two ranks drop everything, as a spare's fresh workers hold nothing: a model built
over their own node alone (their set-up world) and no copies. Then every rank reports what it
holds (``peer_restore.gather``), the plan seats the newcomers at node 1's positions and
takes their state from the copies node 2 keeps (``copy_plan``), the moves are carried out
(``peer_restore.carry_out``), the newcomers re-cut their model over the whole world
(``fsdp_private.reshard``) and load, and all train on: after 3 more steps every rank's
shards and AdamW state equal those of a model trained undisturbed beside it, bit for bit.

Not a node loss (that is a SIGKILL under agents, with the in-place world re-formed around
it, which is not built for this layout yet): the state is dropped inside live processes, to
test what the recovery from memory does once a world has formed."""

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
    from elastic.inplace.copy_plan import plan, seats
    from elastic.inplace.hsdp import capture_local, load_local
    from elastic.inplace.peer_copies import PeerCopies
    from elastic.inplace.peer_restore import carry_out, gather, holding

    dist.init_process_group("gloo")
    rank, world, local = dist.get_rank(), dist.get_world_size(), 2
    node = f"n{rank // local}"
    cpu = torch.device("cpu")

    def build(mesh):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 30), nn.ReLU(), nn.Linear(30, 5))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def whole():
        return DeviceMesh.from_group(dist.group.WORLD, "cpu", mesh=torch.arange(world), mesh_dim_names=("shard",))

    def train(pair, x):
        pair[1].zero_grad()
        pair[0](x[rank * 2:rank * 2 + 2]).square().mean().backward()
        pair[1].step()

    def capture(pair, step):
        model_state, optimizer_state = capture_local(*pair)
        return {"state": {"model": model_state, "optimizer": optimizer_state, "progress": {"step": step}}}

    ref = build(init_device_mesh("cpu", (world,), mesh_dim_names=("shard",)))
    live = build(whole())
    nodes = [dist.new_group(list(range(k, k + local))) for k in range(0, world, local)]  # every rank makes each
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(2 * world, 16, generator=g) for _ in range(8)]
    copies = PeerCopies(1)
    for step in range(1, 5):
        train(ref, xs[step])
        train(live, xs[step])
        assert copies.after_step(step, rank, world, node, local, lambda: capture(live, step), cpu)
    position = rank
    if node == "n1":  # a spare's fresh workers: a model over their own node alone, nothing held
        base = rank - rank % local
        live = build(DeviceMesh.from_group(nodes[1], "cpu", mesh=torch.arange(base, base + local),
                                           mesh_dim_names=("shard",)))
        copies, position = PeerCopies(1), None
    reports = gather(holding(copies, rank, position, 4), world)
    seated = dict(enumerate(seats([r.position for r in reports], world)))
    decided = plan(reports, world, seated)
    payload = carry_out(decided, seated, copies, rank, lambda: capture(live, 4))
    if position is None:
        fsdp_private.reshard(live[0], whole())
    if payload is not None:
        load_local(live[0], live[1], payload["state"]["model"], payload["state"]["optimizer"])
    print(f"PLAN {rank} step {decided.step} source {decided.sources[rank].kind} from {decided.sources[rank].rank} "
          f"loaded {payload is not None}", flush=True)
    for step in range(5, 8):
        train(ref, xs[step])
        train(live, xs[step])
    (ma, oa), (mb, ob) = capture_local(*ref), capture_local(*live)
    bad = [k for k in ma if not torch.equal(ma[k], mb[k])]
    bad += [f"{k}.{n}" for k, v in oa["state"].items() for n, t in v.items() if not torch.equal(t, ob["state"][k][n])]
    assert not bad, bad
    print(f"EQUAL {rank}", flush=True)
    dist.destroy_process_group()
''')


@pytest.mark.slow
def test_a_spare_is_filled_from_its_buddies_memory_and_trains_on_bitwise_as_an_undisturbed_run(tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text(SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    world = 6
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
    procs = []
    for rank in range(world):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "RANK": str(rank),
               "WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ddp.ROOT),
               "TORCHELASTIC_USE_AGENT_STORE": "True"}
        procs.append(python([str(tmp_path / "job.py")], out / f"rank{rank}.log", env=env, cwd=out))
    ddp._wait(procs, tmp_path, timeout=300)
    said = {rank: (out / f"rank{rank}.log").read_text() for rank in range(world)}
    # survivors keep their live state; node 1's positions come from the copies node 2 keeps
    expected = {0: "live from 0 loaded False", 1: "live from 1 loaded False", 2: "held from 4 loaded True",
                3: "held from 5 loaded True", 4: "live from 4 loaded False", 5: "live from 5 loaded False"}
    for rank, line in expected.items():
        assert f"PLAN {rank} step 4 source {line}" in said[rank], said[rank]
        assert f"EQUAL {rank}" in said[rank], said[rank]
