"""A plain torchrun DDP loop, changed only by the prepare API's lines, recovers in place.

The script is what a DDP tutorial writes (its own ``init_process_group``, ``DDP(model)``,
a ``DataLoader`` with a ``DistributedSampler`` and ``set_epoch``, ``zero_grad``,
``backward``, ``step``, a ``dist.get_rank() == 0`` line per epoch), plus the three lines
marked ``# added`` and the one marked ``# was:``. Rank 0's node is SIGKILLed: the
survivor goes on in its own process from the step it stood at, the node comes back and is
healed from the survivor, and the ledger shows every sample of every epoch once.
"""

from __future__ import annotations

import textwrap
import time
from pathlib import Path
from typing import Callable

import pytest

from agent.etcd import EmbeddedEtcd
from tests.elastic.inplace.support import metric, read_rows, rows, start_script, train_together
from tests.elastic.inplace.test_user_code import (
    DATASET,
    assert_trained_once,
    assert_went_on_from_where_it_stood,
    no_tracebacks,
    write_script,
)
from tests.support.nodes import TorchrunNode as Node

PLAIN_DDP_LOOP = textwrap.dedent('''\
    import json, logging, os, time
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn import functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler
    from elastic.jobs.mlp import SyntheticClassification, as_batch
    import elastic                                                                    # added

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = SyntheticClassification(int(os.environ["DATASET"]), seed=1)
    sampler = DistributedSampler(data)
    loader = DataLoader(data, batch_size=8, sampler=sampler, collate_fn=as_batch)
    ft = elastic.Elastic(snapshot_dir=os.environ["SNAPSHOTS"], seed=3,  # added
                         snapshots=elastic.SnapshotConfig(every_steps=10, ledger=os.environ["LEDGER"]))
    model, optimizer, loader = ft.prepare(model, optimizer, loader)                   # added
    progress, main = open(os.environ["PROGRESS"], "a"), open(os.environ["MAIN"], "a")

    def note(out, **row):  # the test's eyes: one JSON line per trained step
        out.write(json.dumps({"node": os.environ["ELASTIC_NODE_NAME"], "pid": os.getpid(), "time": time.time(),
                              "step": ft.step_count, "rank": ft.rank, "world_size": ft.world_size, **row}) + "\\n")
        out.flush()

    for epoch in ft.epochs(1000):                                                     # was: range(1000)
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            if ft.last_step:
                note(progress, epoch=epoch)
            time.sleep(0.03)
        if dist.get_rank() == 0:  # kept: in place, the default group follows the current world
            print(f"epoch {epoch} done at step {ft.step_count}", flush=True)
            note(main, epoch=epoch)
''')


@pytest.mark.slow
def test_a_plain_ddp_loop_with_the_prepare_lines_recovers_in_place(
    etcd_server: EmbeddedEtcd, run_id: str, nodes: Callable[..., Node], tmp_path: Path
) -> None:
    script = write_script(tmp_path, "plain_ddp.py", PLAIN_DDP_LOOP)
    env = {"DATASET": str(DATASET), "MAIN": str(tmp_path / "main.jsonl")}
    group = [start_script(nodes, name, etcd_server, run_id, tmp_path, script, nnodes="1:2", env=env)
             for name in ("a", "b")]
    train_together(group, tmp_path, 2, steps=6)
    victim = next(n for n in group if rows(n, tmp_path)[-1]["rank"] == 0)
    survivor = next(n for n in group if n is not victim)
    pid = rows(survivor, tmp_path)[-1]["pid"]

    killed_at = time.time()
    victim.kill()  # the whole tree, SIGKILL
    dead_at = time.time()
    # 9 steps of 8 samples alone cross an epoch's end (64 samples), wherever the kill fell
    train_together([survivor], tmp_path, 1, steps=9, after=killed_at, timeout=60)
    assert_went_on_from_where_it_stood(survivor, tmp_path, killed_at, 1)
    back_at = time.time()
    victim.start()
    train_together(group, tmp_path, 2, steps=6, after=back_at)

    assert {r["pid"] for r in rows(survivor, tmp_path)} == {pid}, "the survivor's worker was restarted"
    assert metric(survivor, "elastic_agent_restarts_total") == 0
    assert metric(victim, "elastic_restores_total", source="replica") >= 1
    no_tracebacks(*group)
    # The joiner and the survivor train the same steps after the heal, in the same epochs.
    joined = {r["step"]: r["epoch"] for r in rows(victim, tmp_path) if r["time"] > back_at}
    kept = {r["step"]: r["epoch"] for r in rows(survivor, tmp_path) if r["time"] > back_at}
    common = sorted(set(joined) & set(kept))
    assert len(common) >= 5 and all(joined[s] == kept[s] for s in common)
    # The survivor took over rank 0's epoch lines while alone.
    said = [r for r in read_rows(tmp_path / "main.jsonl") if dead_at < r["time"] < back_at]
    assert said and {r["node"] for r in said} == {survivor.name}
    assert_trained_once(tmp_path)
