"""Sharded snapshots: every rank writes its own shards, and the job resumes at another
replica count and another shard count, from DCP's own files.

Real processes, real gloo worlds under plain env:// (no agent), an HSDP model trained by
``ElasticRun`` as FSDP2's docs build it. World ``a`` (2 replicas x 2 shards) trains to
step 8 with a snapshot every 4 steps; its snapshot directory is then resumed, copied, by
``b`` (1 replica x 2 shards: another replica count) and by ``c`` (one rank: 1 shard,
another shard count, with ``a``'s newest shard file torn so that ``c`` must fall
back to step 4). Both train on to step 12 and must end where an undisturbed run ``r`` ends
(float tolerance: another mesh sums in another order). The snapshot loads
with ``torch.distributed.checkpoint`` outside the service once the store has verified it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.elastic import test_replica_check as ddp

STEPS = 12

SCRIPT = textwrap.dedent('''\
    import logging, os
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn import functional as F
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from elastic import DataConfig, ElasticRun, SnapshotConfig
    from elastic.jobs.mlp import SyntheticClassification, as_batch

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    dist.init_process_group("gloo")
    shape = tuple(int(n) for n in os.environ["MESH"].split("x"))
    names = ("replicate", "shard") if len(shape) == 2 else ("shard",)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    run = ElasticRun(model, torch.optim.Adam(model.parameters(), lr=1e-2), SyntheticClassification(96, seed=1),
                     global_batch_size=12, steps=int(os.environ["STEPS"]), snapshot_dir=os.environ["SNAPSHOTS"],
                     snapshots=SnapshotConfig(every_steps=4), data=DataConfig(collate_fn=as_batch), seed=3)
    for x, y in run:
        run.step(F.cross_entropy(run.model(x), y))
    print(f"RESUMED_FROM {run.resumed_from}", flush=True)
    full = get_model_state_dict(run.state.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        torch.save(full, os.environ["OUT"] + "/final.pt")
''')


def _world(tmp: Path, tag: str, mesh: str, steps: int, snapshots: Path,
           stores: list[dist.TCPStore]) -> list[subprocess.Popen[bytes]]:
    """A gloo world of ``mesh``'s ranks (``RxS``: 2 local ranks per node; ``N``: one per node)."""
    shape = [int(n) for n in mesh.split("x")]
    world, local = (shape[0] * shape[1], shape[1]) if len(shape) == 2 else (shape[0], 1)
    out = tmp / tag
    out.mkdir()
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
    stores.append(store)  # the world's store, on a port the kernel picked; lives until the test ends
    procs = []
    for rank in range(world):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "RANK": str(rank),
               "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank % local), "LOCAL_WORLD_SIZE": str(local),
               "GROUP_RANK": str(rank // local), "ELASTIC_NODE_NAME": f"{tag}{rank // local}",
               "OMP_NUM_THREADS": "1", "STEPS": str(steps), "MESH": mesh, "SNAPSHOTS": str(snapshots),
               "OUT": str(out), "PYTHONPATH": str(ddp.ROOT), "TORCHELASTIC_USE_AGENT_STORE": "True"}
        env.pop("ELASTIC_HEARTBEAT_DIR", None)
        log = open(out / f"rank{rank}.log", "wb")
        procs.append(subprocess.Popen([sys.executable, str(tmp / "job.py")], env=env, stdout=log,
                                      stderr=subprocess.STDOUT, cwd=out))
    return procs


def _final(tmp: Path, tag: str) -> dict[str, torch.Tensor]:
    return torch.load(tmp / tag / "final.pt", weights_only=True)


@pytest.mark.slow
def test_every_rank_writes_its_shards_and_the_job_resumes_at_other_replica_and_shard_counts(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from checkpoints import SnapshotStore
    from checkpoints.reading import DCP_DIR_KEY

    (tmp_path / "job.py").write_text(SCRIPT)
    stores: list[dist.TCPStore] = []
    first = _world(tmp_path, "a", "2x2", 8, tmp_path / "snap-a", stores)
    reference = _world(tmp_path, "r", "1x2", STEPS, tmp_path / "snap-r", stores)
    ddp._wait(first + reference, tmp_path, timeout=240)

    store = SnapshotStore(tmp_path / "snap-a", create=False)
    assert [s.step for s in store.list()] == [4, 8]
    newest = store.load_latest()
    assert newest is not None and newest[0].step == 8
    step_dir = newest[1][DCP_DIR_KEY]
    shard_files = sorted(p.name for p in step_dir.glob("*.distcp"))
    assert shard_files == [f"__{r}_0.distcp" for r in range(4)]  # every rank wrote its own part, no gather
    assert not list(tmp_path.glob("snap-a/.tmp-*")) and not list(step_dir.glob("part-*"))

    # Outside the service: verified by the store above, then dcp.load into a plain model.
    plain = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    target = {"model": plain.state_dict()}
    dcp.load(target, checkpoint_id=str(step_dir))
    assert set(target["model"]) == set(_final(tmp_path, "a"))
    for name, tensor in _final(tmp_path, "a").items():
        assert torch.equal(target["model"][name], tensor), name

    shutil.copytree(tmp_path / "snap-a", tmp_path / "snap-b")
    shutil.copytree(tmp_path / "snap-a", tmp_path / "snap-c")
    torn = tmp_path / "snap-c" / step_dir.name / "__2_0.distcp"
    torn.write_bytes(torn.read_bytes()[:-100])  # a torn shard: the whole step is refused, step 4 used
    resumed = _world(tmp_path, "b", "1x2", STEPS, tmp_path / "snap-b", stores)
    resharded = _world(tmp_path, "c", "1", STEPS, tmp_path / "snap-c", stores)
    ddp._wait(resumed + resharded, tmp_path, timeout=240)

    assert "RESUMED_FROM 8" in ddp._log(tmp_path, "b")
    said = ddp._log(tmp_path, "c")
    assert "RESUMED_FROM 4" in said and "__2_0.distcp: size" in said, said[-3000:]
    want = _final(tmp_path, "r")
    for tag in ("b", "c"):
        got = _final(tmp_path, tag)
        for name, tensor in want.items():
            torch.testing.assert_close(got[name], tensor, rtol=1e-5, atol=1e-6, msg=f"world {tag}: {name}")
