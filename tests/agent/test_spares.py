"""Warm spares: a node beyond ``--nnodes MAX`` waits, and takes a lost node's place in place.

Real etcd, real ``elastic agent`` process trees, a plain ``ElasticRun`` script written here.
``--nnodes 2:2`` and three agents (rather than 3:3 and four: this machine has 2 cores). A
member is SIGKILLed, then rank 0's node: each time the spare, whose workers started while it
waited (the script's start-up done), is admitted at the next step boundary with those very
processes, healed from the survivor, and the world stays 2; the survivors keep their worker
processes, no step is rolled back or trained twice, and the replicas stay equal. The node
killed first comes back and becomes the next spare.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

import pytest

from agent.etcd import EmbeddedEtcd
from tests.elastic.inplace.support import at_world, metric, rows, start_script, train_together
from tests.elastic.inplace.test_user_code import assert_trained_once, assert_went_on_from_where_it_stood
from tests.support.nodes import TorchrunNode as Node
from tests.support import agent_job
from tests.support.waiting import wait_until

DATASET = 64  # four steps an epoch, so the heals fall among epoch ends (tests.elastic.inplace.test_user_code)



def is_spare(node: Node) -> bool:
    """What a dashboard sees: the node's ``elastic_agent_spare`` gauge."""
    try:
        return metric(node, "elastic_agent_spare") == 1
    except (AssertionError, OSError):
        return False  # its endpoint is not up yet


def set_up(node: Node, tmp: Path) -> set[int]:
    """The worker processes of ``node`` whose script got through its start-up (model, data, run)."""
    path = tmp / f"{node.name}.rows.jsonl.setup"
    return {json.loads(line)["pid"] for line in path.read_text().splitlines()} if path.exists() else set()


def pid_after(node: Node, tmp: Path, after: float) -> set[int]:
    return {r["pid"] for r in rows(node, tmp) if r["time"] > after}


def assert_replicas_equal(first: Node, second: Node, tmp: Path, after: float) -> None:
    """The healed spare and the survivor hold the same parameters, bit for bit, at every step both trained."""
    mine = {r["step"]: r["params"] for r in at_world(first, tmp, 2, after)}
    theirs = {r["step"]: r["params"] for r in at_world(second, tmp, 2, after)}
    common = sorted(set(mine) & set(theirs))
    assert len(common) >= 3 and all(mine[s] == theirs[s] for s in common), [(s, mine[s], theirs[s]) for s in common]


def replace_with_spare(victim: Node, survivor: Node, spare: Node, tmp: Path) -> float:
    """SIGKILL ``victim``'s tree; the spare trains beside ``survivor`` in a world of 2. Returns the kill's time."""
    survivor_pids = pid_after(survivor, tmp, 0.0)
    killed_at = time.time()
    victim.kill()
    train_together([survivor, spare], tmp, 2, steps=4, after=killed_at, timeout=60)
    assert all(r["world_size"] == 2 for r in rows(survivor, tmp) if r["time"] > killed_at), "the world shrank"
    assert pid_after(survivor, tmp, 0.0) == survivor_pids, "the survivor's worker was restarted"
    assert_went_on_from_where_it_stood(survivor, tmp, killed_at, 2)
    assert metric(survivor, "elastic_agent_restarts_total") == 0
    assert_replicas_equal(survivor, spare, tmp, killed_at)
    assert not is_spare(spare)
    return killed_at


@pytest.mark.slow
def test_a_spare_takes_a_lost_nodes_place_twice_and_a_node_back_becomes_the_next_spare(
    etcd_server: EmbeddedEtcd, run_id: str, nodes: Callable[..., Node], tmp_path: Path
) -> None:
    script = agent_job.write_to(tmp_path / "spares.py")
    group = [start_script(nodes, name, etcd_server, run_id, tmp_path, script, nnodes="2:2",
                          env={"DATASET": str(DATASET)}, agent_args=["--warm-start"]) for name in ("a", "b", "c")]
    # the spare taken from the probe that saw it: a second scrape under load may time out
    spare = wait_until(lambda: next((n for n in group if is_spare(n)), None)
                       if sum(bool(rows(n, tmp_path)) for n in group) == 2 else None, 150,
               "two nodes to train and the third to wait as a spare", on_timeout=lambda: group[2].log_tail(60))
    members = [n for n in group if n is not spare]
    train_together(members, tmp_path, 2, steps=6)
    assert not rows(spare, tmp_path), "the spare trained before it was admitted"
    ready = wait_until(lambda: set_up(spare, tmp_path), 60, "the spare's workers to start ahead",
                       on_timeout=lambda: spare.log_tail(40))
    wait_until(lambda: metric(spare, "elastic_agent_spare_workers_ready") == 1, 30,
               "the spare's gauge to count its worker waiting at the first batch")
    rank0 = next(n for n in members if rows(n, tmp_path)[-1]["rank"] == 0)
    member = next(n for n in members if n is not rank0)

    # A member is lost: the spare takes its place; rank 0 keeps its process and its rank.
    replace_with_spare(member, rank0, spare, tmp_path)
    assert pid_after(spare, tmp_path, 0.0) == ready, "the spare's workers started ahead were not the ones admitted"
    assert metric(spare, "elastic_restores_total", source="replica") >= 1
    said = spare.log_path.read_text()
    assert "waiting as a spare" in said and "admitted to round" in said and f"in the place of {member.name}" in said

    # The lost node comes back: the world is full, so it is the spare now.
    back_at = time.time()
    member.start()
    wait_until(lambda: is_spare(member), 90, f"{member.name} to come back as the spare",
               on_timeout=lambda: member.log_tail(60))
    assert not pid_after(member, tmp_path, back_at), "a node back beside a full world trained"
    ready = wait_until(lambda: set_up(member, tmp_path) - set(pid_after(member, tmp_path, 0.0)), 60,
                       f"{member.name}'s workers to start ahead as the spare", on_timeout=lambda: member.log_tail(40))

    # Rank 0's node is lost: the new spare takes its place beside the first spare, now rank 0.
    first_spare_pids = pid_after(spare, tmp_path, 0.0)
    killed_at = replace_with_spare(rank0, spare, member, tmp_path)
    assert pid_after(spare, tmp_path, 0.0) == first_spare_pids
    assert pid_after(member, tmp_path, killed_at) == ready, "the new spare's workers started ahead were not admitted"
    assert at_world(spare, tmp_path, 2, killed_at)[-1]["rank"] == 0
    assert_trained_once(tmp_path)
