"""An FSDP2 script sharded across every node (a 1-D mesh) under ``elastic agent``: a lost
node restarts the world.

The script is written here as a user would write it from FSDP2's docs (``init_device_mesh``
over every rank, ``fully_shard`` per block and on the root, AdamW after sharding) plus the
prepare lines. No live replica holds a lost node's shards, so this run takes the restart
path (HSDP recovers in place: tests/agent/test_hsdp_in_place.py): what is checked is that it
trains at all (a sharded model crashed in DDP's constructor, and crash-looped in the heal),
that a killed node costs one line and a resume from the newest snapshot at the smaller
shard count, the node's return a resume at the larger one (DCP reshards), that every
sample of each epoch is trained once (the ledger), and that every rank wrote its own shards
of the snapshot, which loads unsharded with ``torch.distributed.checkpoint``."""

from __future__ import annotations

import textwrap
import time
from pathlib import Path
from typing import Callable

import torch.distributed.checkpoint as dcp
from torch import nn

from checkpoints import SnapshotStore
from checkpoints.reading import DCP_DIR_KEY
from agent.etcd import EmbeddedEtcd
from agent.local.local_node import AUTO_METRICS_PORT
from elastic.ledger import check_ledger
from tests.support.nodes import TorchrunNode as Node
from tests.support.waiting import wait_until
from tests.elastic.inplace.support import read_rows

FORM_TIMEOUT = 150
DATASET = 512

HSDP = textwrap.dedent('''\
    import json, os, sys, time
    import torch, torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    import elastic

    class Data(torch.utils.data.Dataset):
        def __init__(self, n):
            g = torch.Generator().manual_seed(3)
            self.x, self.y = torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g)
        def __len__(self): return len(self.x)
        def __getitem__(self, i): return self.x[i], self.y[i]

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(Data(int(sys.argv[1])), batch_size=4)
    ft = elastic.Elastic(snapshots=elastic.SnapshotConfig(every_steps=4, ledger=os.environ["LEDGER"]))  # + the prepare lines
    model, optimizer, loader = ft.prepare(model, optimizer, loader)
    for epoch in ft.epochs(2):
        for x, y in loader:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            # Alone (world 2), each step is slower: the run must outlast node b's return, whose
            # agent imports torch and waits out its old lease (18 s seen on a loaded machine).
            time.sleep(0.05 if ft.world_size == 4 else 0.25)
            if ft.is_main:
                with open(os.environ["ROWS"], "a") as f:
                    f.write(json.dumps({"step": ft.step_count, "world": ft.world_size, "pid": os.getpid(),
                                        "time": time.time()}) + "\\n")
''')


def _rows(path: Path) -> list[dict]:
    # (read while the ranks append: a line being written, or cut by a SIGKILL, is skipped)
    return read_rows(path)


def test_an_fsdp_script_resumes_from_its_snapshot_at_fewer_shards_when_a_node_is_lost_and_more_when_back(
        etcd_server: EmbeddedEtcd, run_id: str, nodes: Callable[..., Node], tmp_path: Path) -> None:
    script, rows, ledger = tmp_path / "hsdp.py", tmp_path / "rows.jsonl", tmp_path / "ledger.jsonl"
    script.write_text(HSDP)
    env = {"OMP_NUM_THREADS": "1", "ROWS": str(rows), "LEDGER": str(ledger),
           "ELASTIC_SNAPSHOT_DIR": str(tmp_path / "snapshots")}
    a, b = (nodes(name=n, endpoint=etcd_server.endpoint, run_id=run_id, script=str(script), module_args=[str(DATASET)],
                  nnodes="1:2", nproc_per_node=2, metrics_port=AUTO_METRICS_PORT, env=env,
                  agent_args=["--lease-ttl", "2"]) for n in ("a", "b"))
    both = lambda: "\n".join(n.log_tail(60) for n in (a, b))  # noqa: E731
    wait_until(lambda: any(r["world"] == 4 and r["step"] >= 6 for r in _rows(rows)), FORM_TIMEOUT,
               "FSDP over 2 nodes x 2 ranks to pass its first snapshot", on_timeout=both)

    for op in ("allgather", "reducescatter"):  # FSDP2's own collectives, timed as DDP's all-reduce is
        wait_until(lambda: (a.metric("elastic_collective_duration_seconds_count", op=op) or 0) > 0, 30,
                   f"node a to export {op} timings", on_timeout=both)

    killed_at = time.time()
    b.kill()
    wait_until(lambda: any(r["world"] == 2 and r["time"] > killed_at for r in _rows(rows)), FORM_TIMEOUT,
               "node a to train on alone (2 shards)", on_timeout=both)
    b.start()  # the node back: the world restarts at 4 shards again, from the newest snapshot
    back_at = time.time()
    wait_until(lambda: any(r["world"] == 4 and r["time"] > back_at for r in _rows(rows)), FORM_TIMEOUT,
               "node b back in a world of 4 shards", on_timeout=both)
    wait_until(lambda: not a.alive() and not b.alive(), FORM_TIMEOUT, "both nodes to finish", on_timeout=both)
    assert a.process is not None and a.process.returncode == 0, both()
    assert b.process is not None and b.process.returncode == 0, both()

    log = a.log_tail(400)
    assert "in-place recovery off: the model is sharded (FSDP2/HSDP): it is sharded across every node" in log
    assert "resumed from snapshot step" in log and "Traceback" not in log, log
    assert "lost a peer in step" in log  # the script's own backward lost it: one line, not a traceback
    report = check_ledger(ledger, dataset_size=DATASET, expect_epochs=2)
    assert report.ok, report.violations

    # The last snapshot: every rank of the world of 4 wrote its own shards (DCP's files, no
    # gather), and once the store has verified it, it loads with torch.distributed.checkpoint
    # into the same model unsharded (a shard count of 1), at the step the job ended at.
    found = SnapshotStore(tmp_path / "snapshots", create=False).load_latest()
    assert found is not None and found[0].step == _rows(rows)[-1]["step"]
    step_dir = found[1][DCP_DIR_KEY]
    assert sorted(p.name for p in step_dir.glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(4)]
    plain = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    target = {"model": plain.state_dict()}
    dcp.load(target, checkpoint_id=str(step_dir))  # every key, global shapes
    plain.load_state_dict(target["model"])
