"""The replica check under HSDP: one bit flipped in one rank's shard is found, named by
that shard's replicas, and undone.

Real processes, a real gloo world of 3 "nodes" x 2 local ranks, an HSDP model (replicas
across nodes, shards inside one) trained by ``ElasticRun``. A script flips one bit of one
rank's own shard of a parameter right after a committed step; the check (every 4 steps)
votes within each shard class (the ranks of one local rank), names that node, and every
rank loads its own kept shards of the last agreed step and retrains the steps since; at the
end every rank's shards are bitwise those of an undisturbed run, so the replicas of each
shard are bitwise equal.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.elastic import test_replica_check as ddp
from tests.elastic.trainer_support import assert_state_equal
from tests.support.spawn import Process, python

NODES, LOCAL = 3, 2

SCRIPT = textwrap.dedent('''\
    import json, logging, os
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn import functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from elastic import DataConfig, ElasticRun, SnapshotConfig
    from elastic.consistency.inject import flip_bit, target
    from elastic.inplace.hsdp import capture_local
    from elastic.jobs.mlp import SyntheticClassification, as_batch

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    dist.init_process_group("gloo")
    local = int(os.environ["LOCAL_WORLD_SIZE"])
    mesh = init_device_mesh("cpu", (dist.get_world_size() // local, local), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    run = ElasticRun(model, torch.optim.Adam(model.parameters(), lr=1e-2), SyntheticClassification(96, seed=1),
                     global_batch_size=12, steps=int(os.environ["STEPS"]), snapshot_dir=os.environ["SNAPSHOTS"],
                     snapshots=SnapshotConfig(every_steps=0, ledger=os.environ["LEDGER"]),
                     data=DataConfig(collate_fn=as_batch), seed=3,
                     check_every_steps=int(os.environ["EVERY"]))
    flips = json.loads(os.environ.get("FLIPS", "[]"))  # [step, rank, what], each done once
    done = set()
    for x, y in run:
        if run.step(F.cross_entropy(run.model(x), y)):
            for i, (step, on, what) in enumerate(flips):
                if i not in done and run.step_count == step and on == dist.get_rank():
                    done.add(i)
                    flip_bit(target(run.state.module, run.optimizer, what).to_local(), 1, 22)
                    print(f"FLIPPED {what} on rank {on} after step {step}", flush=True)
    model_state, optimizer_state = capture_local(run.state.module, run.optimizer)
    torch.save({"model": model_state, "optimizer": optimizer_state["state"]},
               os.environ["OUT"] + f"/final-{dist.get_rank()}.pt")
''')


def _world(tmp: Path, tag: str, flips: str, stores: list[dist.TCPStore]) -> list[Process]:
    """NODES x LOCAL ranks, nodes ``{tag}0..``, under plain env:// (no agent), as
    :func:`tests.elastic.test_replica_check._world` starts them."""
    out = tmp / tag
    out.mkdir()
    store = dist.TCPStore("127.0.0.1", 0, NODES * LOCAL, is_master=True, wait_for_workers=False)
    stores.append(store)
    procs = []
    for rank in range(NODES * LOCAL):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "RANK": str(rank),
               "WORLD_SIZE": str(NODES * LOCAL), "LOCAL_RANK": str(rank % LOCAL), "LOCAL_WORLD_SIZE": str(LOCAL),
               "GROUP_RANK": str(rank // LOCAL), "ELASTIC_NODE_NAME": f"{tag}{rank // LOCAL}",
               "OMP_NUM_THREADS": "1", "STEPS": str(ddp.STEPS), "EVERY": str(ddp.EVERY), "FLIPS": flips,
               "SNAPSHOTS": str(out / "snapshots"), "LEDGER": str(out / "ledger.jsonl"), "OUT": str(out),
               "PYTHONPATH": str(ddp.ROOT), "TORCHELASTIC_USE_AGENT_STORE": "True"}
        env.pop("ELASTIC_HEARTBEAT_DIR", None)
        procs.append(python([str(tmp / "job.py")], out / f"rank{rank}.log", env=env, cwd=out))
    return procs


@pytest.mark.slow
def test_a_flipped_bit_in_one_shard_is_named_by_its_replicas_and_rolled_back(tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text(SCRIPT)
    stores: list[dist.TCPStore] = []
    reference = _world(tmp_path, "r", "[]", stores)
    ddp._wait(reference, tmp_path)
    chaos = _world(tmp_path, "c", '[[9, 2, "0.weight"]]', stores)
    ddp._wait(chaos, tmp_path)

    log = ddp._log(tmp_path, "c")
    assert log.count("FLIPPED") == 1, log[-3000:]
    named = [line for line in log.splitlines() if "silent data corruption at step" in line]
    assert len(named) == 1, log[-4000:]
    assert "at step 12: node c1 (rank 2; differs in 0.weight" in named[0], named[0]
    assert "returns to step 8" in named[0], named[0]
    for rank in range(NODES * LOCAL):  # every rank's shards as an undisturbed run's: replicas bitwise equal
        assert_state_equal(ddp._final(tmp_path, "c", rank), ddp._final(tmp_path, "r", rank), f"rank {rank}")
    for rank in range(LOCAL, NODES * LOCAL):
        assert_state_equal(ddp._final(tmp_path, "c", rank), ddp._final(tmp_path, "c", rank % LOCAL),
                           f"rank {rank} against its shard's replica on node 0")
