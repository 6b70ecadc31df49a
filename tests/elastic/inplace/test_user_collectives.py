"""The script's own collectives, in place (real etcd, real ``elastic agent`` nodes, a node killed).

What users hit with scripts we did not write: set-up collectives right after building the
run (a joiner's met the survivors' step collectives), a metric all-reduce in the loop body
(a lost peer in it crashed every survivor, and the job went back to disk), and a script's
own ``init_process_group()`` (a joiner waited for peers that never call it again). The
script below does all three, as a user would; each test kills a node and checks what a
user would: nobody hangs, the survivors keep their processes, the joiner is healed from a
replica, every step is trained once. Also: a joining node of two workers sets up among
them, the per-world hook runs on every rank, a collective after the last step spans the
world that finished it. Plus the pure rules they rest on, without processes.
"""

from __future__ import annotations

import textwrap
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from agent.etcd import EmbeddedEtcd
from agent.local.local_node import AUTO_METRICS_PORT
from elastic.contract import SETUP_WORLD_ENV
from elastic.worker_env import Place, RankEnv, in_setup_world, joins_live_world, update_env
from tests.elastic.inplace.support import at_world, metric, read_rows, rows, start_script, train_together
from tests.elastic.inplace.test_user_code import DATASET, assert_trained_once, no_tracebacks, write_script
from tests.support.nodes import TorchrunNode as Node
from tests.support.waiting import wait_until

USER_SCRIPT = textwrap.dedent('''\
    import json, logging, os, time
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn import functional as F
    import elastic
    from elastic.jobs.mlp import SyntheticClassification, as_batch

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    events = open(os.environ["EVENTS"], "a")

    def say(out, **row):
        out.write(json.dumps({"node": os.environ["ELASTIC_NODE_NAME"], "pid": os.getpid(), "time": time.time(),
                              **row}) + "\\n")
        out.flush()

    own = os.environ.get("OWN_GROUP") == "1"
    if own:  # the most natural port keeps its own set-up
        dist.init_process_group("gloo")
        dist.barrier()
        say(events, kind="own_group", world=dist.get_world_size(), rank=dist.get_rank(),
            setup=os.environ.get("ELASTIC_SETUP_WORLD", ""))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    if own:
        model = nn.parallel.DistributedDataParallel(model)
    run = elastic.ElasticRun(model, torch.optim.Adam(model.parameters(), lr=1e-2),
                             SyntheticClassification(int(os.environ["DATASET"]), seed=1), global_batch_size=16,
                             steps=int(os.environ.get("STEPS", "100000")), snapshot_dir=os.environ["SNAPSHOTS"],
                             snapshots=elastic.SnapshotConfig(every_steps=10, ledger=os.environ["LEDGER"]),
                             data=elastic.DataConfig(collate_fn=as_batch), seed=3)

    # Set-up collectives right after building the run, as the scripts users brought us do.
    dist.barrier()
    pids = [None] * dist.get_world_size()
    dist.all_gather_object(pids, os.getpid())
    config = [{"lr": 0.01, "from": os.getpid()}] if dist.get_rank() == 0 else [None]
    dist.broadcast_object_list(config, src=0)
    say(events, kind="setup", world=dist.get_world_size(), run_world=run.world_size, pids=pids, config=config[0],
        step=run.step_count)

    @run.on_new_world
    def per_world(run):
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, run.rank)
        say(events, kind="world", world=run.world_size, rank=run.rank, ranks=ranks, step=run.step_count,
            round=run.round)

    every = int(os.environ.get("METRIC_EVERY", "0"))
    rows = open(os.environ["PROGRESS"], "a")
    for x, y in run:
        loss = F.cross_entropy(run.model(x), y)
        if run.step(loss):
            say(rows, step=run.step_count, rank=run.rank, world_size=run.world_size, round=run.round)
        if every and run.step_count % every == 0:  # keyed on the run's step count: aligned on every rank
            if run.rank == 0:
                time.sleep(0.3)  # the others wait inside the all-reduce: a kill of rank 0 lands in it
            value = torch.ones(1)
            dist.all_reduce(value)
            say(events, kind="metric", step=run.step_count, value=float(value), world=run.world_size)
        time.sleep(0.03)
    value = torch.ones(1)  # after the last step: the group is still up, every rank finished it
    dist.all_reduce(value)
    say(events, kind="after", value=float(value), world=dist.get_world_size(), step=run.step_count)
''')


def events(node: Node, tmp: Path, kind: str) -> list[dict[str, Any]]:
    return [e for e in read_rows(tmp / f"{node.name}.events.jsonl") if e["kind"] == kind]


def start(nodes: Callable[..., Node], name: str, etcd: EmbeddedEtcd, run_id: str, tmp: Path, nnodes: str,
          **env: str) -> Node:
    """The job's first world must hold both nodes, which these tests check: at ``1:2`` the
    first round waits up to 60 s for the second (it closes the moment it comes) rather
    than a second, which a loaded machine's agent start outlasted."""
    script = write_script(tmp, "user_collectives.py", USER_SCRIPT)
    return start_script(nodes, name, etcd, run_id, tmp, script, nnodes=nnodes,
                        env={"DATASET": str(DATASET), "EVENTS": str(tmp / f"{name}.events.jsonl"), **env},
                        rdzv_conf={"last_call_timeout": "60"})


def kill_rank_0(group: list[Node], tmp: Path) -> tuple[Node, Node, int, float]:
    """(victim, survivor, the survivor's pid, when) for a SIGKILL of rank 0's whole node."""
    victim = next(n for n in group if rows(n, tmp)[-1]["rank"] == 0)
    survivor = next(n for n in group if n is not victim)
    pid = rows(survivor, tmp)[-1]["pid"]
    killed_at = time.time()
    victim.kill()
    return victim, survivor, pid, killed_at


def assert_healed_joiner(victim: Node, survivor: Node, pid: int, tmp: Path, back_at: float) -> None:
    assert {r["pid"] for r in rows(survivor, tmp)} == {pid}, "the survivor's worker was restarted"
    assert metric(survivor, "elastic_agent_restarts_total") == 0
    assert metric(survivor, "elastic_restores_total", source="disk") == 0
    assert metric(victim, "elastic_restores_total", source="replica") >= 1, "the joiner was not healed"
    joined = at_world(victim, tmp, 2, back_at)
    kept = {r["step"] for r in at_world(survivor, tmp, 2, back_at)}
    assert joined[0]["step"] > 1 and joined[0]["step"] in kept | {min(kept) - 1}, (joined[0], sorted(kept))
    # The joiner's set-up ran in its own world of one (its set-up collectives met no survivor's step);
    # the per-world hook then ran on every rank in the world they formed together.
    setup = [e for e in events(victim, tmp, "setup") if e["time"] > back_at]
    assert len(setup) == 1 and setup[0]["world"] == 1 and setup[0]["config"]["from"] == setup[0]["pid"], setup
    for node in (victim, survivor):
        worlds = [e for e in events(node, tmp, "world") if e["time"] > back_at and e["world"] == 2]
        assert worlds and sorted(worlds[0]["ranks"]) == [0, 1], (node.name, worlds)
    no_tracebacks(victim, survivor)
    assert_trained_once(tmp)


@pytest.mark.slow
@pytest.mark.parametrize("nnodes", ["1:2", "2:2"])
def test_set_up_collectives_after_building_the_run_do_not_meet_the_survivors_steps(
    etcd_server: EmbeddedEtcd, run_id: str, nodes: Callable[..., Node], tmp_path: Path, nnodes: str
) -> None:
    group = [start(nodes, name, etcd_server, run_id, tmp_path, nnodes) for name in ("a", "b")]
    train_together(group, tmp_path, 2, steps=6)
    for node in group:  # the job's first world: set-up collectives span it
        first = events(node, tmp_path, "setup")[0]
        assert first["world"] == 2 and len(set(first["pids"])) == 2 and first["config"]["lr"] == 0.01, first
    victim, survivor, pid, killed_at = kill_rank_0(group, tmp_path)
    if nnodes == "1:2":
        train_together([survivor], tmp_path, 1, steps=3, after=killed_at, timeout=60)
    else:
        time.sleep(3)  # the survivor's world breaks; it waits for a second node (2:2)
    before = [r["step"] for r in rows(survivor, tmp_path) if r["time"] < killed_at]
    back_at = time.time()
    victim.start()
    train_together(group, tmp_path, 2, steps=5, after=back_at, timeout=90)
    after = [r["step"] for r in rows(survivor, tmp_path) if r["time"] > killed_at]
    assert after[0] in (before[-1] + 1, before[-1] + 2), (before[-1], after[0])  # zero steps rolled back
    assert_healed_joiner(victim, survivor, pid, tmp_path, back_at)


@pytest.mark.slow
def test_a_lost_peer_inside_a_metric_all_reduce_abandons_the_step_in_place(
    etcd_server: EmbeddedEtcd, run_id: str, nodes: Callable[..., Node], tmp_path: Path
) -> None:
    group = [start(nodes, name, etcd_server, run_id, tmp_path, "1:2", METRIC_EVERY="2") for name in ("a", "b")]
    train_together(group, tmp_path, 2, steps=4)
    other = next(n for n in group if rows(n, tmp_path)[-1]["rank"] == 1)
    # Kill rank 0 while rank 1 waits for it in the all-reduce after an even step.
    wait_until(lambda: rows(other, tmp_path)[-1]["step"] % 2 == 0 and time.time() - rows(other, tmp_path)[-1]["time"]
               < 0.1, 30, "rank 1 to reach the metric all-reduce", interval=0.005)
    victim, survivor, pid, killed_at = kill_rank_0(group, tmp_path)
    assert survivor is other
    train_together([survivor], tmp_path, 1, steps=4, after=killed_at, timeout=60)
    assert {r["pid"] for r in rows(survivor, tmp_path)} == {pid}, "the survivor's worker was restarted"
    assert metric(survivor, "elastic_agent_restarts_total") == 0
    assert metric(survivor, "elastic_restores_total", source="disk") == 0
    failed = [e for e in events(survivor, tmp_path, "metric") if e["world"] == 2 and e["value"] != 2.0]
    assert failed, "the kill did not land in the all-reduce (it returned with its input, as documented)"
    before = [r["step"] for r in rows(survivor, tmp_path) if r["time"] < killed_at]
    assert at_world(survivor, tmp_path, 1, killed_at)[0]["step"] in (before[-1] + 1, before[-1] + 2)
    assert "re-formed in place" in survivor.log_path.read_text()
    no_tracebacks(survivor)
    assert_trained_once(tmp_path)


@pytest.mark.slow
def test_a_joiner_running_its_own_init_process_group_does_not_hang_and_is_healed(
    etcd_server: EmbeddedEtcd, run_id: str, nodes: Callable[..., Node], tmp_path: Path
) -> None:
    group = [start(nodes, name, etcd_server, run_id, tmp_path, "1:2", OWN_GROUP="1") for name in ("a", "b")]
    train_together(group, tmp_path, 2, steps=6)
    for n in group:  # the script's own init_process_group saw the world the node first trained in
        first, trained = events(n, tmp_path, "own_group")[0], rows(n, tmp_path)[0]["world_size"]
        # Both in the first round: a world of 2. Under load one node may form it alone (the
        # other came after its one-second last call) and the other then joins as a joiner,
        # whose set-up world is one of its own until its first batch (seen on 3 xdist workers).
        assert (first["world"], first["setup"]) in ((trained, ""), (1, "1")), (n.name, first, trained)
    victim, survivor, pid, killed_at = kill_rank_0(group, tmp_path)
    train_together([survivor], tmp_path, 1, steps=3, after=killed_at, timeout=60)
    back_at = time.time()
    victim.start()
    train_together(group, tmp_path, 2, steps=5, after=back_at, timeout=90)
    own = [e for e in events(victim, tmp_path, "own_group") if e["time"] > back_at]
    assert len(own) == 1 and own[0]["world"] == 1 and own[0]["setup"] == "1", own  # returned at once
    assert_healed_joiner(victim, survivor, pid, tmp_path, back_at)


@pytest.mark.slow
def test_a_joining_node_with_two_workers_sets_up_among_them_and_both_are_healed(
    etcd_server: EmbeddedEtcd, run_id: str, nodes: Callable[..., Node], tmp_path: Path
) -> None:
    script = write_script(tmp_path, "user_collectives.py", USER_SCRIPT)

    def node(name: str, nproc: int) -> Node:
        env = {"PROGRESS": str(tmp_path / f"{name}.rows.jsonl"), "SNAPSHOTS": str(tmp_path / "snapshots"),
               "LEDGER": str(tmp_path / "ledger.jsonl"), "OMP_NUM_THREADS": "1", "DATASET": str(DATASET),
               "EVENTS": str(tmp_path / f"{name}.events.jsonl"), "OWN_GROUP": "1"}
        return nodes(name=name, endpoint=etcd_server.endpoint, run_id=run_id, script=str(script), nnodes="1:2",
                     nproc_per_node=nproc, metrics_port=AUTO_METRICS_PORT, env=env, agent_args=["--lease-ttl", "5"],
                     rdzv_conf={"last_call_timeout": "60"})  # the first world holds both nodes (see start())

    a, b = node("a", 1), node("b", 2)
    train_together([a, b], tmp_path, 3, steps=6)
    pid = rows(a, tmp_path)[-1]["pid"]
    killed_at = time.time()
    b.kill()
    train_together([a], tmp_path, 1, steps=3, after=killed_at, timeout=60)
    back_at = time.time()
    b.start()
    train_together([a, b], tmp_path, 3, steps=6, after=back_at, timeout=90)
    own = [e for e in events(b, tmp_path, "own_group") if e["time"] > back_at]
    setup = [e for e in events(b, tmp_path, "setup") if e["time"] > back_at]
    assert sorted((e["world"], e["rank"]) for e in own) == [(2, 0), (2, 1)], own  # its own two workers
    assert [e["world"] for e in setup] == [2, 2] and len({e["config"]["from"] for e in setup}) == 1, setup
    assert {e["config"]["from"] for e in setup} <= {e["pid"] for e in setup}  # b's local rank 0's config
    assert {r["pid"] for r in rows(a, tmp_path)} == {pid}, "the survivor's worker was restarted"
    assert metric(a, "elastic_agent_restarts_total") == 0
    assert metric(b, "elastic_restores_total", source="replica") >= 2, "b's workers were not both healed"
    no_tracebacks(a, b)
    assert_trained_once(tmp_path)


@pytest.mark.slow
def test_a_collective_after_the_last_step_spans_the_world_that_finished_it(
    etcd_server: EmbeddedEtcd, run_id: str, nodes: Callable[..., Node], tmp_path: Path
) -> None:
    group = [start(nodes, name, etcd_server, run_id, tmp_path, "2:2", STEPS="12") for name in ("a", "b")]
    wait_until(lambda: all(events(n, tmp_path, "after") for n in group), 120, "both nodes to pass the loop's end")
    for node in group:
        after = events(node, tmp_path, "after")
        assert after == [after[0]] and (after[0]["value"], after[0]["world"], after[0]["step"]) == (2.0, 2, 12)
    wait_until(lambda: not any(n.alive() for n in group), 60, "both agents to exit")
    no_tracebacks(*group)
    assert_trained_once(tmp_path)


# ---------------------------------------------------------------- the pure rules, without processes


def test_workers_join_a_live_world_only_when_another_member_trains_in_place() -> None:
    assert not joins_live_world({}, "a")
    assert not joins_live_world({"a": True, "b": False}, "a")  # our own old record says nothing
    assert joins_live_world({"a": False, "b": True}, "a")


def test_a_joiners_set_up_world_is_the_ranks_started_with_it_and_the_real_world_replaces_it() -> None:
    started = RankEnv(Place(rank=7, world_size=8, group_rank=3, group_world_size=4, local_world_size=4, round=9),
                      local_rank=3, master_addr="live-store", master_port=1)
    env = started.in_setup_world([3, 1], 4711).to_env()
    assert (env["RANK"], env["WORLD_SIZE"], env["MASTER_PORT"], env["MASTER_ADDR"]) == ("1", "2", "4711", "127.0.0.1")
    assert env["GROUP_RANK"] == "0" and env["LOCAL_WORLD_SIZE"] == "2" and in_setup_world(env)
    place = Place(rank=5, world_size=6, group_rank=2, group_world_size=3, local_world_size=2, round=9)
    update_env(place, env)
    assert SETUP_WORLD_ENV not in env and not in_setup_world(env) and env["RANK"] == "5"


def test_a_users_collective_failing_with_every_node_still_there_is_named_once_with_its_fix(
        caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    from elastic.inplace.channel import WorkerChannel
    from elastic.inplace.in_place_world import InPlaceWorld

    world = InPlaceWorld(WorkerChannel(tmp_path, 0), "gloo", 30.0, owns_group=True)
    with caplog.at_level("WARNING", logger="elastic.trainer"):
        world._say_misaligned("all_reduce", 41, "[a rank 1]")
        world._say_misaligned("all_reduce", 61, "[a rank 1]")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith("[a rank 1] step 41 failed in your dist.all_reduce with every "
                                                   "node still in the world"), lines
    assert "run.step_count" in lines[0] and "run.on_new_world" in lines[0]
