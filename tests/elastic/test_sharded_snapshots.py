"""Sharded snapshots: every rank writes its own shards, and the job resumes at another
replica count and another shard count, from DCP's own files.

Real processes, real gloo worlds under plain env:// (no agent), an HSDP model trained by
``ElasticRun`` as FSDP2's docs build it, snapshots in a real S3 server (SeaweedFS): each
rank uploads its own shards, rank 0 commits the manifest, no gather. World ``a`` (2
replicas x 2 shards) trains to step 8 with a snapshot every 4 steps; its bucket prefix is
then resumed, copied, by ``b`` (1 replica x 2 shards: another replica count) and by ``c``
(one rank: 1 shard, another shard count, with ``a``'s newest shard object torn so that
``c`` must fall back to step 4), each rank reading only its own byte ranges. Both train on
to step 12 and must end where an undisturbed run ``r`` ends (float tolerance: another mesh
sums in another order). The snapshot loads with ``torch.distributed.checkpoint`` straight
from the bucket outside the service once the store has verified it. (A directory's
sharded snapshots, written by the ranks of several nodes under the agents, are
tests/agent/test_sharded_restart.py's.)
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.elastic import test_replica_check as ddp
from tests.support.s3server import SeaweedS3
from tests.support.spawn import Process, python

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


def _world(tmp: Path, tag: str, mesh: str, steps: int, snapshots: Path | str,
           stores: list[dist.TCPStore]) -> list[Process]:
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
        procs.append(python([str(tmp / "job.py")], out / f"rank{rank}.log", env=env, cwd=out))
    return procs


def _final(tmp: Path, tag: str) -> dict[str, torch.Tensor]:
    return torch.load(tmp / tag / "final.pt", weights_only=True)


@pytest.mark.slow
def test_every_rank_uploads_its_shards_and_the_job_resumes_at_other_replica_and_shard_counts(
        tmp_path: Path, s3_server: SeaweedS3, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed.checkpoint as dcp

    from checkpoints.reading import DCP_DIR_KEY, DCP_FILES_KEY
    from checkpoints.s3dcp import S3DcpReader
    from checkpoints.s3store import S3SnapshotStore

    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)  # the worlds inherit them
    bucket = s3_server.bucket(f"sharded-worlds-{os.getpid()}")
    url = lambda tag: f"s3://{bucket}/snap-{tag}"  # noqa: E731
    (tmp_path / "job.py").write_text(SCRIPT)
    stores: list[dist.TCPStore] = []
    first = _world(tmp_path, "a", "2x2", 8, url("a"), stores)
    reference = _world(tmp_path, "r", "1x2", STEPS, tmp_path / "snap-r", stores)
    ddp._wait(first + reference, tmp_path, timeout=240)

    store = S3SnapshotStore(url("a"), create=False)
    assert [s.step for s in store.list()] == [4, 8]
    newest = store.load_latest()
    assert newest is not None and newest[0].step == 8
    step_dir = str(newest[1][DCP_DIR_KEY])
    where = step_dir[len(url("a")) + 1:]  # step-<8>/<writer>: the prefix every rank uploaded under
    names = sorted(o["Key"].rsplit("/", 1)[-1] for o in store.objects.list(where + "/"))
    assert [n for n in names if n.endswith(".distcp")] == [f"__{r}_0.distcp" for r in range(4)]  # no gather
    assert not [n for n in names if n.startswith("part-")]  # the ranks' records went once the manifest said it

    # Outside the service: verified by the store above, then dcp.load from the bucket into a plain model.
    plain = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    target = {"model": plain.state_dict()}
    dcp.load(target, storage_reader=S3DcpReader(step_dir, newest[1][DCP_FILES_KEY]))
    assert set(target["model"]) == set(_final(tmp_path, "a"))
    for name, tensor in _final(tmp_path, "a").items():
        assert torch.equal(target["model"][name], tensor), name

    client: Any = s3_server.client()
    for o in client.list_objects_v2(Bucket=bucket, Prefix="snap-a/")["Contents"]:
        for tag in ("b", "c"):
            client.copy_object(Bucket=bucket, Key=o["Key"].replace("snap-a/", f"snap-{tag}/", 1),
                               CopySource={"Bucket": bucket, "Key": o["Key"]})
    torn = f"snap-c/{where}/__2_0.distcp"
    body = client.get_object(Bucket=bucket, Key=torn)["Body"].read()
    client.put_object(Bucket=bucket, Key=torn, Body=body[:-100])  # a torn shard: the whole step is refused
    resumed = _world(tmp_path, "b", "1x2", STEPS, url("b"), stores)
    resharded = _world(tmp_path, "c", "1", STEPS, url("c"), stores)
    ddp._wait(resumed + resharded, tmp_path, timeout=240)

    assert "RESUMED_FROM 8" in ddp._log(tmp_path, "b")
    said = ddp._log(tmp_path, "c")
    assert "RESUMED_FROM 4" in said and "__2_0.distcp: size" in said, said[-3000:]
    want = _final(tmp_path, "r")
    for tag in ("b", "c"):
        got = _final(tmp_path, tag)
        for name, tensor in want.items():
            torch.testing.assert_close(got[name], tensor, rtol=1e-5, atol=1e-6, msg=f"world {tag}: {name}")
