"""A resume from a sharded snapshot in S3 reads, on every rank, the shard versions rank 0
verified (issue 51, item 8): the window between rank 0's verification and another rank's
own look at the bucket is closed.

Real processes (a gloo world of two under plain env://, no agent), a model sharded with
FSDP2 ``fully_shard`` over both ranks, snapshots in a real S3 server (SeaweedFS), each rank
uploading its own shards. The world resumes through ``Snapshots.load_newest``, as a world
with no replica left does: rank 0 verifies the newest snapshot (every file hashed, each
shard's ETag bound), then every rank reads its shards through DCP, here the model alone (as
an evaluation reads it), so that rank 0 reads nothing of rank 1's file. (With the optimizer
too, DCP spreads the items every rank holds, its param_groups, over the other ranks' files,
and rank 0's own read of them catches a replacement; in a world with more ranks than such
items some files hold none, and the window is the same.) Rank 1's file of step 8 is replaced
by its file of step 4 (the same size, valid values) after rank 0 verified and before rank 1
looked: rank 1's process does it itself, just before its own look, so that the window is
hit every time (the replacement is real, its timing is the test's). Before, rank 1 bound the
ETag its own listing found, the replacement's, and read step 4's values as step 8's without
a word, beside rank 0's step 8: a model of two snapshots, resumed "from step 8". Now every
rank asks for the versions rank 0 hashed, rank 1's read is refused, and both fall back to
step 4 alike.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.elastic import test_replica_check as ddp
from tests.support.s3server import SeaweedS3
from tests.support.spawn import python

KEY = "k" * 32

SCRIPT = textwrap.dedent('''\
    import logging, os, time
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from checkpoints.reading import DCP_DIR_KEY, DCP_FILES_KEY
    from checkpoints.s3dcp import S3DcpReader, unwrapped
    from checkpoints.s3store import S3SnapshotStore
    from checkpoints.sharded import DeferredDcpWriter
    from elastic.distributed import DistInfo
    from elastic.metrics.training import NoMetrics
    from elastic.run_config import SnapshotConfig
    from elastic.snapshots import Snapshots

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    dist.init_process_group("gloo")
    rank, url = dist.get_rank(), os.environ["SNAPSHOTS"]
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = nn.Linear(8, 4)  # its weight's rows: two on each rank
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    store = S3SnapshotStore(url, key=os.environ["ELASTIC_RDZV_HMAC_KEY"].encode())

    def fill(value):
        with torch.no_grad():
            for p in model.parameters():
                p.to_local().fill_(value)

    for step in (4, 8):  # every rank uploads its own shards; rank 0 seals
        fill(float(step))
        box = [store.begin_parts(step) if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        model_state, optimizer_state = get_state_dict(model, optimizer)
        writer = DeferredDcpWriter(store.root, lambda: box[0])
        dcp.save({"model": model_state, "optimizer": optimizer_state}, storage_writer=writer)
        store.write_part(writer.part)
        if rank == 0:
            store.seal_parts(step, writer.part.temp, ranks=2, metadata=writer.metadata,
                             state={"progress": {"step": step}}, world_size=2, deadline=time.monotonic() + 60)
        dist.barrier()
    fill(0.0)

    snapshots = Snapshots(url, SnapshotConfig(every_steps=None, keep=5, writer="thread"), metrics=NoMetrics())
    info = DistInfo(rank=rank, world_size=2, local_rank=0, device=torch.device("cpu"), backend="gloo", node=f"n{rank}")
    snapshots.attach(info, check_dir=False)
    if rank == 1:  # after rank 0 verified step 8, before this rank's own look: its shard file replaced by step 4's
        own_load = snapshots.store.load

        def shard_file(step):  # found by listing (a load of step 8 now would look before the replacement)
            return [o["Key"] for o in store.objects.list(f"step-00000000000{step}/") if o["Key"].endswith("/__1_0.distcp")][0]

        def load(step, **kwargs):
            if step == 8:
                store.objects.put(shard_file(8), store.objects.get(shard_file(4))[0])
                print("REPLACED rank 1's shard file of step 8 by its file of step 4", flush=True)
            return own_load(step, **kwargs)

        snapshots.store.load = load
    taken = []

    def take(state):  # the model alone, as an evaluation reads it: rank 0 reads nothing of rank 1's file
        taken.append(state["progress"]["step"])
        wanted = {"model": get_state_dict(model, optimizer)[0]}
        try:
            dcp.load(wanted, storage_reader=S3DcpReader(str(state[DCP_DIR_KEY]), state[DCP_FILES_KEY]))
        except dcp.api.CheckpointException as e:
            raise unwrapped(e) or e from None
        set_model_state_dict(model, wanted["model"])

    step, _ = snapshots.load_newest(info, take)
    snapshots.close()
    values = sorted({float(v) for p in model.parameters() for v in p.detach().to_local().reshape(-1)})
    print(f"RESUMED step {step} taken {taken} values {values}", flush=True)
''')


@pytest.mark.slow
def test_every_rank_reads_the_shard_versions_rank_0_verified(
        tmp_path: Path, s3_server: SeaweedS3, monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    bucket = s3_server.bucket(f"bound-{os.getpid()}")
    (tmp_path / "job.py").write_text(SCRIPT)
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    out = tmp_path / "w"
    out.mkdir()
    procs = []
    for rank in range(2):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "RANK": str(rank),
               "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "OMP_NUM_THREADS": "1",
               "SNAPSHOTS": f"s3://{bucket}/p", "ELASTIC_RDZV_HMAC_KEY": KEY, "PYTHONPATH": str(ddp.ROOT),
               "TORCHELASTIC_USE_AGENT_STORE": "True"}
        env.pop("ELASTIC_HEARTBEAT_DIR", None)
        procs.append(python([str(tmp_path / "job.py")], out / f"rank{rank}.log", env=env, cwd=out))
    ddp._wait(procs, tmp_path, timeout=180)
    logs = [(out / f"rank{rank}.log").read_text() for rank in range(2)]
    assert "REPLACED rank 1's shard file of step 8 by its file of step 4" in logs[1], logs[1][-3000:]
    for rank in range(2):
        resumed = [line for line in logs[rank].splitlines() if line.startswith("RESUMED")]
        assert resumed == ["RESUMED step 4 taken [8, 4] values [4.0]"], logs[rank][-3000:]
    assert "changed since it was verified" in logs[0], logs[0][-3000:]
    del store
