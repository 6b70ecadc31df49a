"""A frozen node is left out of the world in well under its lease TTL (agent/node/freeze.py).

Real etcd, three ``elastic agent`` process trees, a plain ``ElasticRun`` script written here,
lease TTL 3 s. Rank 0's node is SIGSTOPped, whole tree: the survivors' next step without it
comes from the job's own pace (a step stuck far beyond it, the frozen agent silent on its
witness), not from the lease. The survivors keep their processes, roll no step back, and
train every sample once; thawed, the frozen node's agent stops its stale workers and the node
comes back healed. A 0.3 s pause of one worker (a GC pause) and the slow first steps write
nobody off. Then node b holds one step 6 s, alive (its agent answers: nobody is written off),
and is frozen 2 s into it, while the others' step is stuck on it: it is written off by the
probe asked again (two questions in a row unanswered), not by its lease. Judged once per
stall, such a freeze waited for the lease (issue 51, item 11). Timings belong to
``bench/recovery.py --configs freeze,freeze-lease``; the bounds here leave room for a loaded
2-core machine.

A member killed while a join is pending (the round that adds a node has closed, the
survivors still train without it): the survivors' world fails, and their join of that
round would wait for the dead member's handle until its lease expired. With a 10 s lease,
the round without it closes in well under that. (The survivors' first step then waits for
the joiner's start-up, which this test makes slow on purpose to hold the join pending; the
figure with a warm joiner is ``bench/recovery.py --configs ours-kill-joining``.)
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Callable

import pytest

from agent.etcd import EmbeddedEtcd
from agent.local.local_node import AUTO_METRICS_PORT
from agent.node.freeze import RECHECK_MISSES
from tests.elastic.inplace.support import at_world, logs, metric, rows, train_together
from tests.elastic.inplace.test_user_code import DATASET, assert_trained_once, assert_went_on_from_where_it_stood
from tests.support.nodes import TorchrunNode as Node
from tests.support import agent_job
from tests.support.waiting import wait_until

LEASE_TTL = 3
BOUND_S = 2.5  # what this test checks: the probe writes the node off before its lease (3 s) could; the speed
# goal (1.0 s median) is bench/recovery.py's freeze config (docs/BENCHMARKS.md). At 1.5 s a loaded run missed by 20 ms
WRITTEN_OFF = "frozen: its agent did not answer"
HOLD_FREEZE_AFTER_S = 2.0  # into b's hold: the others' step is stuck (0.5 s floor) and was judged alive
RECHECK_BOUND_S = 2.6  # two unanswered re-asks (0.5 s each) and the round; the lease alone is 3 s and more



def start(nodes: Callable[..., Node], name: str, etcd: EmbeddedEtcd, run_id: str, tmp: Path, script: Path,
          lease_ttl: int = LEASE_TTL) -> Node:
    env = {"PROGRESS": str(tmp / f"{name}.rows.jsonl"), "SNAPSHOTS": str(tmp / "snapshots"),
           "LEDGER": str(tmp / "ledger.jsonl"), "OMP_NUM_THREADS": "1", "DATASET": str(DATASET),
           "PAUSE_MARKER": str(tmp / "paused"), "SLOW_SETUP": str(tmp / "slow-setup"), "JOB_FIRST_STEPS_SLEEP": "0.4",
           "HOLD_MARKER": str(tmp / "held")}
    return nodes(name=name, endpoint=etcd.endpoint, run_id=run_id, script=str(script), nnodes="1:3",
                 metrics_port=AUTO_METRICS_PORT, env=env, agent_args=["--lease-ttl", str(lease_ttl)])


@pytest.mark.slow
def test_a_frozen_node_is_left_out_within_a_second_and_comes_back_healed_once_thawed(
    etcd_server: EmbeddedEtcd, run_id: str, nodes: Callable[..., Node], tmp_path: Path
) -> None:
    script = agent_job.write_to(tmp_path / "freeze.py")
    group = [start(nodes, name, etcd_server, run_id, tmp_path, script) for name in ("a", "b", "c")]
    train_together(group, tmp_path, 3, steps=8)
    wait_until(lambda: (tmp_path / "paused").exists() and all(len(at_world(n, tmp_path, 3)) >= 60 for n in group),
               120, "b's pause and 60 steps in a world of 3", on_timeout=logs(*group))
    said = {n.name: n.log_path.read_text() for n in group}
    assert not any(WRITTEN_OFF in text for text in said.values()), "a pause or the slow start wrote a node off"

    victim = next(n for n in group if rows(n, tmp_path)[-1]["rank"] == 0)  # rank 0, the snapshot writer
    survivors = [n for n in group if n is not victim]
    pids = {n.name: {r["pid"] for r in rows(n, tmp_path)} for n in survivors}
    stale_pid = rows(victim, tmp_path)[-1]["pid"]
    frozen_at = time.time()
    victim.freeze()
    wait_until(lambda: all(at_world(n, tmp_path, 2, frozen_at) for n in survivors), 30,
               "the survivors' first step without the frozen node", on_timeout=logs(*survivors))
    thawed_at = time.time()
    victim.thaw()  # within the lease TTL: only its peers' word tells it its workers are stale
    first = min(at_world(n, tmp_path, 2, frozen_at)[0]["time"] for n in survivors)
    assert first - frozen_at <= BOUND_S, f"first step without the frozen node {first - frozen_at:.2f} s after it froze"
    train_together(survivors, tmp_path, 2, steps=5, after=frozen_at, timeout=60)
    for n in survivors:
        assert {r["pid"] for r in rows(n, tmp_path)} == pids[n.name], f"{n.name}'s worker was restarted"
        assert_went_on_from_where_it_stood(n, tmp_path, frozen_at, 2)
    said_by = [n for n in survivors if f"{victim.name} {WRITTEN_OFF}" in n.log_path.read_text()]
    assert said_by, "no survivor named the frozen node"
    assert sum(metric(n, "elastic_agent_inplace_reforms_total", reason="frozen") for n in survivors) >= 1

    train_together(group, tmp_path, 3, steps=5, after=thawed_at, timeout=120)
    # A row of the stale worker may be written after the thaw for a step all three finished
    # before the freeze (SIGSTOP between its all-reduce and its row): no step the survivors
    # trained without it may appear, which would be one trained twice.
    went_on_at = min(at_world(n, tmp_path, 2, frozen_at)[0]["step"] for n in survivors)
    assert not [r for r in rows(victim, tmp_path) if r["pid"] == stale_pid and r["step"] >= went_on_at], \
        "the frozen node's stale worker trained after the freeze"
    assert "wrote it off" in victim.log_path.read_text(), victim.log_tail(40)
    for n in survivors:
        assert {r["pid"] for r in rows(n, tmp_path)} == pids[n.name], f"{n.name}'s worker was restarted"
    by_node = {n.name: {r["step"]: r["params"] for r in at_world(n, tmp_path, 3, thawed_at)} for n in group}
    common = sorted(set.intersection(*(set(d) for d in by_node.values())))
    assert common and len({d[common[0]] for d in by_node.values()}) == 1, "replicas differ after the heal"
    assert metric(victim, "elastic_restores_total", source="replica") >= 1
    assert_trained_once(tmp_path)

    # b slow and alive, then frozen while the others' step is stuck on it (judged alive once)
    holder = next(n for n in group if n.name == "b")
    others = [n for n in group if n is not holder]
    pids = {n.name: {r["pid"] for r in rows(n, tmp_path)} for n in others}
    (tmp_path / "held.arm").touch()
    wait_until(lambda: (tmp_path / "held").exists(), 60, "b's hold", interval=0.01, on_timeout=logs(*group))
    time.sleep(HOLD_FREEZE_AFTER_S)  # not a wait for an outcome: the freeze must come after the stall was judged
    frozen_at = time.time()
    holder.freeze()
    wait_until(lambda: all(at_world(n, tmp_path, 2, frozen_at) for n in others), 30,
               "the others' first step without b", on_timeout=logs(*others))
    holder.thaw()
    first = min(at_world(n, tmp_path, 2, frozen_at)[0]["time"] for n in others)
    assert any(f"b {WRITTEN_OFF} {RECHECK_MISSES} questions in a row" in n.log_path.read_text() for n in others), \
        logs(*others)()
    assert first - frozen_at <= RECHECK_BOUND_S, (f"first step without b {first - frozen_at:.2f} s after it froze "
                                                  f"in a stall judged alive (lease TTL {LEASE_TTL} s)")
    for n in others:
        assert {r["pid"] for r in rows(n, tmp_path)} == pids[n.name], f"{n.name}'s worker was restarted"


JOIN_LEASE_TTL = 10  # the lease path would take about this long: the bound below is far from it
JOIN_BOUND_S = 3.0


@pytest.mark.slow
def test_a_member_killed_while_a_join_is_pending_is_left_out_without_waiting_for_its_lease(
    etcd_server: EmbeddedEtcd, run_id: str, nodes: Callable[..., Node], tmp_path: Path
) -> None:
    script = agent_job.write_to(tmp_path / "join_kill.py")
    group = [start(nodes, name, etcd_server, run_id, tmp_path, script, JOIN_LEASE_TTL) for name in ("a", "b", "c")]
    train_together(group, tmp_path, 3, steps=8)
    by_rank = {rows(n, tmp_path)[-1]["rank"]: n for n in group}
    keeper = by_rank[0]
    joiner, victim = [n for n in group if n is not keeper]
    joiner.kill()
    killed_at = time.time()
    train_together([keeper, victim], tmp_path, 2, steps=5, after=killed_at, timeout=60)
    (tmp_path / "slow-setup").touch()
    seen = len(keeper.log_path.read_text())
    joiner.start()
    closed = re.compile(rf"round (\d+) -> (\d+) in place with {joiner.name}: world of 3 nodes")
    found: list[re.Match[str]] = []
    wait_until(lambda: found.extend(closed.finditer(keeper.log_path.read_text()[seen:])) or found, 120,
               f"the round that adds {joiner.name} back", interval=0.005, on_timeout=logs(keeper, joiner))
    join_round = int(found[0].group(2))
    pids = {r["pid"] for r in rows(keeper, tmp_path)}
    fault_at = time.time()
    victim.kill()
    assert not [r for r in rows(keeper, tmp_path) if r["round"] >= join_round], \
        "the survivors switched to the join round before the kill: the join was not pending"
    without = re.compile(rf"round {join_round} -> \d+ in place without {victim.name}: world of 2 nodes")
    wait_until(lambda: without.search(keeper.log_path.read_text()[seen:]), 60,
               f"a round without {victim.name}", interval=0.005, on_timeout=logs(keeper, joiner))
    took = time.time() - fault_at
    assert took <= JOIN_BOUND_S, f"the round without {victim.name} closed {took:.2f} s after the kill " \
                                 f"(lease TTL {JOIN_LEASE_TTL} s)"
    assert f"{victim.name} lost or frozen: its agent did not answer" in keeper.log_path.read_text()
    train_together([keeper, joiner], tmp_path, 2, steps=5, after=fault_at, timeout=120)
    assert {r["pid"] for r in rows(keeper, tmp_path)} == pids, f"{keeper.name}'s worker was restarted"
    history = rows(keeper, tmp_path)
    last_old = [r["step"] for r in history if r["round"] < join_round][-1]
    assert next(r["step"] for r in history if r["round"] > join_round) == last_old + 1, "a step rolled back or skipped"
    by_node = {n.name: {r["step"]: r["params"] for r in at_world(n, tmp_path, 2, fault_at)} for n in (keeper, joiner)}
    common = sorted(set.intersection(*(set(d) for d in by_node.values())))
    assert common and len({d[common[0]] for d in by_node.values()}) == 1, "replicas differ after the heal"
    assert_trained_once(tmp_path)
