"""In-place recovery of the code users actually write (real etcd, real ``elastic agent`` nodes).

Two scripts, written here as a user would write them:

* a DDP tutorial loop ported to ``ElasticRun``: its loop state (epoch, step counts, a
  running sum of a validation loss, the best loss) in dicts registered with the run, an
  epoch report at the top of the loop that divides by the epoch's step count (a fresh
  joiner's zero), per-step rows written only ``if run.step(loss)``, and rank 0's lines
  chosen by ``run.is_main``. Rank 0's node is killed and comes back.
* the most natural minimal port: its own ``init_process_group``, its own ``DDP(model)``,
  handed to ``ElasticRun`` and still called in the loop. A kill must keep the survivor
  in its process, in place, rather than roll back through the restart path.
"""

from __future__ import annotations

import re
import textwrap
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import pytest

from agent.etcd import EmbeddedEtcd
from elastic.ledger import check_ledger
from tests.elastic.inplace.support import at_world, ledger_steps, metric, read_rows, rows, start_script, train_together
from tests.support.nodes import TorchrunNode as Node

DATASET = 64  # four steps an epoch: epochs end often, so the kill and the heal fall among them

PORTED_TUTORIAL = textwrap.dedent('''\
    import json, logging, os, time
    import torch
    from torch import nn
    from torch.nn import functional as F
    import elastic
    from elastic.jobs.mlp import SyntheticClassification, as_batch

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    data = SyntheticClassification(int(os.environ["DATASET"]), seed=1)
    x_val, y_val = data.x[:32], data.y[:32]
    run = elastic.ElasticRun(model, torch.optim.Adam(model.parameters(), lr=1e-2), data, global_batch_size=16,
                             steps=100000, snapshot_dir=os.environ["SNAPSHOTS"],
                             snapshots=elastic.SnapshotConfig(every_steps=10, ledger=os.environ["LEDGER"]),
                             data=elastic.DataConfig(collate_fn=as_batch), seed=3)
    counters = run.register("counters", {"epoch": 0, "steps": 0, "steps_in_epoch": 0, "val_sum": 0.0})
    best = run.register("best", {"loss": float("inf"), "step": 0})
    rows, main = open(os.environ["PROGRESS"], "a"), open(os.environ["MAIN"], "a")

    def say(out, **row):
        out.write(json.dumps({"node": os.environ["ELASTIC_NODE_NAME"], "pid": os.getpid(), "time": time.time(),
                              **row}) + "\\n")
        out.flush()

    for x, y in run:
        if run.epoch != counters["epoch"]:  # the last epoch ended: its mean validation loss
            mean = counters["val_sum"] / counters["steps_in_epoch"]
            if run.is_main:
                say(main, kind="epoch", epoch=counters["epoch"], mean=mean, rank=run.rank)
            counters.update(epoch=run.epoch, steps_in_epoch=0, val_sum=0.0)
        loss = F.cross_entropy(run.model(x), y)
        if run.step(loss):
            with torch.no_grad():
                val = float(F.cross_entropy(run.model.module(x_val), y_val))  # the same on every rank
            counters["steps"] += 1
            counters["steps_in_epoch"] += 1
            counters["val_sum"] += val
            if val < best["loss"]:
                best.update(loss=val, step=run.step_count)
            say(rows, step=run.step_count, rank=run.rank, world_size=run.world_size, round=run.round,
                env={k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "GROUP_RANK", "LOCAL_WORLD_SIZE")},
                counters=dict(counters), best=dict(best))
            if run.is_main:
                say(main, kind="step", step=run.step_count, rank=run.rank)
        time.sleep(0.03)
''')

OWN_GROUP_AND_DDP = textwrap.dedent('''\
    import json, logging, os, time
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn import functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    import elastic
    from elastic.jobs.mlp import SyntheticClassification, as_batch

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    ddp_model = DDP(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)))
    run = elastic.ElasticRun(ddp_model, torch.optim.Adam(ddp_model.parameters(), lr=1e-3),
                             SyntheticClassification(int(os.environ["DATASET"]), seed=1), global_batch_size=16,
                             steps=100000, snapshot_dir=os.environ["SNAPSHOTS"],
                             snapshots=elastic.SnapshotConfig(every_steps=10, ledger=os.environ["LEDGER"]),
                             data=elastic.DataConfig(collate_fn=as_batch), seed=3)
    rows = open(os.environ["PROGRESS"], "a")
    for x, y in run:
        loss = F.cross_entropy(ddp_model(x), y)
        if run.step(loss):
            rows.write(json.dumps({"step": run.step_count, "rank": dist.get_rank(), "world_size": dist.get_world_size(),
                                   "run_rank": run.rank, "pid": os.getpid(), "time": time.time(),
                                   "round": run.round}) + "\\n")
            rows.flush()
        time.sleep(0.03)
''')


def write_script(tmp: Path, name: str, text: str) -> Path:
    path = tmp / name
    path.write_text(text)
    return path


def assert_trained_once(tmp: Path) -> None:
    """Every committed step has one ledger line, and every sample is used once per epoch."""
    twice = sorted(s for s, n in Counter(ledger_steps(tmp)).items() if n > 1)
    assert not twice, f"steps committed twice (trained again after being committed): {twice}"
    report = check_ledger(tmp / "ledger.jsonl", DATASET)
    assert report.ok, report.violations


def assert_went_on_from_where_it_stood(node: Node, tmp: Path, killed_at: float, world: int) -> None:
    """Zero steps rolled back: the first step of the new world follows the old world's last.
    "Before" is by the node's own row order, not the test's clock: killing a whole tree takes
    a moment, and the old world may commit a step or two after ``killed_at`` was read."""
    history = rows(node, tmp)
    first = at_world(node, tmp, world, killed_at)[0]
    before = [r["step"] for r in history[:history.index(first)] if r["world_size"] != world or r["time"] < killed_at]
    first_after = first["step"]
    assert first_after in (before[-1] + 1, before[-1] + 2), (before[-1], first_after)


def no_tracebacks(*group: Node) -> None:
    for node in group:
        text = node.log_path.read_text()
        assert "Traceback" not in text and "ZeroDivisionError" not in text, node.log_tail(60)


@pytest.mark.slow
def test_registered_loop_state_heals_into_the_joiner_and_rank_0_moves_with_its_lines(
    etcd_server: EmbeddedEtcd, run_id: str, nodes: Callable[..., Node], tmp_path: Path
) -> None:
    script = write_script(tmp_path, "ported_tutorial.py", PORTED_TUTORIAL)
    env = {"DATASET": str(DATASET), "MAIN": str(tmp_path / "main.jsonl")}
    # a kill is seen at once (the connection resets): the lease only has to outlast a loaded
    # machine (at 2 s a whole-suite run starved the survivor's keep-alive and restarted it)
    group = [start_script(nodes, name, etcd_server, run_id, tmp_path, script, nnodes="1:2", env=env,
                          agent_args=["--lease-ttl", "5"]) for name in ("a", "b")]
    train_together(group, tmp_path, 2, steps=6)
    victim = next(n for n in group if rows(n, tmp_path)[-1]["rank"] == 0)
    survivor = next(n for n in group if n is not victim)
    pid = rows(survivor, tmp_path)[-1]["pid"]
    assert rows(survivor, tmp_path)[-1]["rank"] == 1

    killed_at = time.time()
    victim.kill()
    dead_at = time.time()  # the victim writes nothing after this
    train_together([survivor], tmp_path, 1, steps=4, after=killed_at, timeout=60)
    assert_went_on_from_where_it_stood(survivor, tmp_path, killed_at, 1)
    back_at = time.time()
    victim.start()
    train_together(group, tmp_path, 2, steps=6, after=back_at)

    assert {r["pid"] for r in rows(survivor, tmp_path)} == {pid}, "the survivor's worker was restarted"
    assert metric(survivor, "elastic_agent_restarts_total") == 0
    assert metric(victim, "elastic_restores_total", source="replica") >= 1
    no_tracebacks(*group)  # the joiner's epoch report divided by its healed step count, not by 0

    # Every rank's counters stand at its own step, always: the joiner's first row included.
    for node in group:
        for row in rows(node, tmp_path):
            assert row["counters"]["steps"] == row["step"], (node.name, row)
            assert row["env"]["RANK"] == str(row["rank"]) and row["env"]["GROUP_RANK"] == str(row["rank"]), row
            assert row["env"]["WORLD_SIZE"] == str(row["world_size"]) and row["env"]["LOCAL_WORLD_SIZE"] == "1", row
    # ... and equal, bit for bit, between the joiner and the survivor at every step both trained.
    joined = {r["step"]: (r["counters"], r["best"]) for r in rows(victim, tmp_path) if r["time"] > back_at}
    kept = {r["step"]: (r["counters"], r["best"]) for r in rows(survivor, tmp_path) if r["time"] > back_at}
    common = sorted(set(joined) & set(kept))
    assert len(common) >= 5 and all(joined[s] == kept[s] for s in common), [(s, joined[s], kept[s]) for s in common]

    # The survivor became rank 0: its own RANK says so, and it wrote rank 0's lines from then on.
    said = read_rows(tmp_path / "main.jsonl")
    alone = [r for r in said if dead_at < r["time"] < back_at]
    assert alone and {r["node"] for r in alone} == {survivor.name} and {r["rank"] for r in alone} == {0}
    assert at_world(survivor, tmp_path, 1, killed_at)[0]["env"]["RANK"] == "0"
    steps = [r["step"] for r in said if r["time"] > dead_at and r["kind"] == "step"]
    assert len(steps) == len(set(steps)) and steps == sorted(steps), "rank 0 logged a step twice"
    epochs = [r["epoch"] for r in said if r["kind"] == "epoch"]
    assert len(epochs) >= 3 and epochs == sorted(epochs)
    assert_trained_once(tmp_path)


@pytest.mark.slow
def test_a_script_with_its_own_process_group_and_ddp_keeps_in_place_recovery(
    etcd_server: EmbeddedEtcd, run_id: str, nodes: Callable[..., Node], tmp_path: Path
) -> None:
    script = write_script(tmp_path, "own_group.py", OWN_GROUP_AND_DDP)
    group = [start_script(nodes, name, etcd_server, run_id, tmp_path, script, nnodes="1:2",
                          env={"DATASET": str(DATASET)}) for name in ("a", "b")]
    train_together(group, tmp_path, 2, steps=6)
    rank0 = next(n for n in group if rows(n, tmp_path)[-1]["rank"] == 0)
    other = next(n for n in group if n is not rank0)
    # world of 2, or of 1 when the other node was late to the first round on a loaded machine
    line = re.compile(r"this script's own process group \(gloo, world of [12]\) was replaced by an in-place one")
    assert len(line.findall(rank0.log_path.read_text())) == 1, rank0.log_tail(40)
    assert "the DistributedDataParallel passed as the model is unwrapped" in rank0.log_path.read_text()
    assert "in-place recovery off" not in rank0.log_path.read_text() + other.log_path.read_text()
    pid = rows(other, tmp_path)[-1]["pid"]

    killed_at = time.time()
    rank0.kill()
    train_together([other], tmp_path, 1, steps=5, after=killed_at, timeout=60)
    after: list[dict[str, Any]] = at_world(other, tmp_path, 1, killed_at)
    assert {r["pid"] for r in rows(other, tmp_path)} == {pid}, "the survivor's worker was restarted"
    assert {(r["rank"], r["run_rank"]) for r in after} == {(0, 0)}  # dist.get_rank() follows the world too
    assert metric(other, "elastic_agent_restarts_total") == 0
    assert metric(other, "elastic_agent_inplace_reforms_total") >= 1
    assert metric(other, "elastic_restores_total", source="disk") == 0
    assert_went_on_from_where_it_stood(other, tmp_path, killed_at, 1)
    no_tracebacks(other)
    assert_trained_once(tmp_path)
