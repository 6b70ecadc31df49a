"""A frozen round host does not stall the survivors (issue 39).

In place, a round's members exchange their process-group handles through the round's store,
a TCPStore hosted by the agent of the round's first node. A SIGSTOPped host keeps its
sockets open and answers nothing, and torch's TCPStore client then blocks in every call:
the survivors used to wait until it thawed. Real etcd, real ``elastic agent`` process trees,
the plain ``ElasticRun`` script of ``test_freeze_fast``; the frozen node is thawed only once
the survivors trained without it:

* elastic (``--nnodes 1:3``): a member is killed and started again, and the first node of the
  round that takes it back (that round's store host) is frozen the moment that round
  closes, while the joiner is healed from it and the survivors still train in their world;
  then, in the same cluster, a member is killed and the host of the round that follows is
  frozen as it closes, while the last survivor joins it (no step runs: only the join's own
  stall tells, ``elastic.inplace.stall.join_level``);
* fixed size with a spare (``--nnodes 2:2``, three agents): the current round's host
  (rank 0, the snapshot writer) is frozen mid-training, and the spare takes its place.

Each: the first step without the frozen node well within its lease TTL (the bound leaves
room for a loaded 2-core machine; the 1 s goal is ``bench/recovery.py --configs
freeze,freeze-host``), no step rolled back, every sample once, and the node back after its
thaw.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Callable

import pytest

from agent.etcd import EmbeddedEtcd
from agent.local.local_node import AUTO_METRICS_PORT
from elastic.inplace.reconfigure import GLOO_CONNECT_WAITS, GLOO_RECONFIGURE_TIMEOUT_S
from tests.agent.test_spares import is_spare
from tests.elastic.inplace.support import at_world, logs, rows, train_together
from tests.elastic.inplace.test_user_code import DATASET, assert_trained_once
from tests.support import agent_job
from tests.support.nodes import TorchrunNode as Node
from tests.support.waiting import wait_until

LEASE_TTL = 10  # the lease path would take about this long: the bound below is far from it
BOUND_S = 3.0  # the goal is 1.0 s (a median in the benchmark); this leaves margin for a loaded machine
# A host frozen as its round closes may have posted its process-group address and not yet
# connected its pairs: the survivors then sit in gloo's connect phase for GLOO_CONNECT_WAITS
# reconfigure timeouts (5 x 1 s), which nothing cuts short (elastic/inplace/reconfigure.py;
# seen twice in whole-suite runs, 5.07 s each). Where gloo's log says so, that is the bound.
CONNECT_BOUND_S = GLOO_CONNECT_WAITS * GLOO_RECONFIGURE_TIMEOUT_S + 1.5  # still short of the lease
GLOO_CONNECT_FAILED = "Gloo connectFullMesh failed"
_CLOSED = re.compile(r"round (\d+) closed in [0-9.]+ s: rank \d+ of (\d+) \(([^)]*)\)")


def bound(took: float, survivors: list[Node], since: dict[str, int]) -> float:
    """:data:`BOUND_S`, or :data:`CONNECT_BOUND_S` if a survivor's gloo connect to the frozen
    host timed out after ``since`` (each node's log length just after it froze). gloo writes that
    line from its own thread, up to a second after the worker went on: a step later than
    :data:`BOUND_S` waits up to 5 s for it."""
    def caught() -> bool:
        return any(GLOO_CONNECT_FAILED in n.log_path.read_text()[since[n.name]:] for n in survivors)

    deadline = time.monotonic() + (5.0 if took > BOUND_S else 0.0)
    while not caught():
        if time.monotonic() >= deadline:
            return BOUND_S
        time.sleep(0.1)
    return CONNECT_BOUND_S


def start(nodes: Callable[..., Node], name: str, etcd: EmbeddedEtcd, run_id: str, tmp: Path, script: Path,
          nnodes: str) -> Node:
    env = {"PROGRESS": str(tmp / f"{name}.rows.jsonl"), "SNAPSHOTS": str(tmp / "snapshots"),
           "LEDGER": str(tmp / "ledger.jsonl"), "OMP_NUM_THREADS": "1", "DATASET": str(DATASET),
           "JOB_FIRST_STEPS_SLEEP": "0.4"}
    return nodes(name=name, endpoint=etcd.endpoint, run_id=run_id, script=str(script), nnodes=nnodes,
                 metrics_port=AUTO_METRICS_PORT, env=env, agent_args=["--lease-ttl", str(LEASE_TTL)])


def without(node: Node, tmp: Path, world: int, after_round: int) -> list[dict]:
    """``node``'s rows in a world of ``world`` formed after round ``after_round`` (the round the
    frozen node was in): a survivor may still write a row or two of the old world after the
    SIGSTOP, and a world of the same size before it."""
    return [r for r in rows(node, tmp) if r["world_size"] == world and r["round"] > after_round]


def first_step_without(frozen: Node, survivors: list[Node], tmp: Path, frozen_at: float, world: int,
                       after_round: int) -> float:
    """Seconds from the freeze to the survivors' first step in a world without the frozen node."""
    wait_until(lambda: all(without(n, tmp, world, after_round) for n in survivors), 60,
               f"the survivors' first step without {frozen.name}", on_timeout=logs(*survivors))
    return min(without(n, tmp, world, after_round)[0]["time"] for n in survivors) - frozen_at


def assert_went_on_from_where_it_stood(node: Node, tmp: Path, world: int, after_round: int) -> None:
    """Zero steps rolled back or skipped: the first step of the new world follows the node's last."""
    history = rows(node, tmp)
    first = without(node, tmp, world, after_round)[0]
    before = history[history.index(first) - 1]
    assert first["step"] == before["step"] + 1, (before, first)


def assert_stale_worker_trained_nothing(frozen: Node, survivors: list[Node], tmp: Path, stale_pids: set[int],
                                        world: int, after_round: int) -> None:
    """A row of the stale worker may come for a step every member finished before the freeze
    (SIGSTOP between its all-reduce and its row); none for a step the survivors trained without it."""
    went_on_at = min(without(n, tmp, world, after_round)[0]["step"] for n in survivors)
    assert not [r for r in rows(frozen, tmp) if r["pid"] in stale_pids and r["step"] >= went_on_at], \
        "the frozen node's stale worker trained after the freeze"


def assert_replicas_equal(group: list[Node], tmp: Path, world: int, after: float) -> None:
    by_node = {n.name: {r["step"]: r["params"] for r in at_world(n, tmp, world, after)} for n in group}
    common = sorted(set.intersection(*(set(d) for d in by_node.values())))
    assert common and len({d[common[0]] for d in by_node.values()}) == 1, "replicas differ after the heal"


@pytest.mark.slow
def test_the_host_of_a_round_that_takes_a_node_back_frozen_as_it_closes(
    etcd_server: EmbeddedEtcd, run_id: str, nodes: Callable[..., Node], tmp_path: Path
) -> None:
    script = agent_job.write_to(tmp_path / "freeze_host.py")
    group = [start(nodes, name, etcd_server, run_id, tmp_path, script, "1:3") for name in ("a", "b", "c")]
    train_together(group, tmp_path, 3, steps=8)
    joiner = group[2]
    joiner.kill()
    killed_at = time.time()
    wait_until(lambda: all(len(at_world(n, tmp_path, 2, killed_at)) >= 12 for n in group[:2]), 90,
               "a world of 2 with its pace known", on_timeout=logs(*group[:2]))
    seen = {n.name: len(n.log_path.read_text()) for n in group[:2]}
    joiner.start()
    found: list[re.Match[str]] = []

    def closed_with_joiner() -> bool:
        for n in group[:2]:
            found.extend(m for m in _CLOSED.finditer(n.log_path.read_text()[seen[n.name]:])
                         if m.group(2) == "3")
        return bool(found)

    wait_until(closed_with_joiner, 120, f"the round that takes {joiner.name} back", interval=0.002,
               on_timeout=logs(*group))
    host = next(n for n in group if n.name == found[0].group(3).split(", ")[0])
    host.freeze()
    frozen_at = time.time()
    survivors = [n for n in group if n is not host]
    since = {n.name: len(n.log_path.read_text()) for n in survivors}  # gloo's timeout, if any, comes seconds later
    join_round = int(found[0].group(1))
    stale = {r["pid"] for r in rows(host, tmp_path)}
    took = first_step_without(host, survivors, tmp_path, frozen_at, 2, join_round)
    assert took <= bound(took, survivors, since), \
        f"first step without the frozen host {took:.2f} s after it froze (lease TTL {LEASE_TTL} s)\n{logs(*survivors)()}"
    train_together(survivors, tmp_path, 2, steps=5, after=frozen_at, timeout=60)
    keeper = next(n for n in survivors if n is not joiner)
    assert not [r for r in rows(keeper, tmp_path) if r["time"] > frozen_at and r["round"] == join_round], \
        "the survivors trained in the round the frozen host formed"
    assert_went_on_from_where_it_stood(keeper, tmp_path, 2, join_round)
    assert_replicas_equal(survivors, tmp_path, 2, frozen_at)

    thawed_at = time.time()
    host.thaw()
    train_together(group, tmp_path, 3, steps=5, after=thawed_at, timeout=120)
    assert_stale_worker_trained_nothing(host, survivors, tmp_path, stale, 2, join_round)
    assert "wrote it off" in host.log_path.read_text(), host.log_tail(40)
    assert_replicas_equal(group, tmp_path, 3, thawed_at)

    # A member is killed, and the host of the round that follows (a failure: no step runs, the
    # survivors only join) is frozen as it closes: only the join's own stall can tell.
    order = _CLOSED.findall(keeper.log_path.read_text())[-1][2].split(", ")
    victim = next(n for n in group if n.name == order[1])
    pair = [n for n in group if n is not victim]
    seen = {n.name: len(n.log_path.read_text()) for n in pair}
    found.clear()

    def closed_without_victim() -> bool:
        for n in pair:
            found.extend(m for m in _CLOSED.finditer(n.log_path.read_text()[seen[n.name]:]) if m.group(2) == "2")
        return bool(found)

    victim.kill()
    wait_until(closed_without_victim, 60, f"the round without {victim.name}", interval=0.002, on_timeout=logs(*pair))
    host = next(n for n in pair if n.name == found[0].group(3).split(", ")[0])
    host.freeze()
    frozen_at = time.time()
    last = next(n for n in pair if n is not host)
    since = {last.name: len(last.log_path.read_text())}
    failure_round = int(found[0].group(1))
    took = first_step_without(host, [last], tmp_path, frozen_at, 1, failure_round)
    assert took <= bound(took, [last], since), f"first step without the host frozen in a join {took:.2f} s after it froze\n{logs(last)()}"
    assert_went_on_from_where_it_stood(last, tmp_path, 1, failure_round)
    host.thaw()
    thawed_at = time.time()
    train_together(pair, tmp_path, 2, steps=3, after=thawed_at, timeout=120)
    assert_trained_once(tmp_path)


@pytest.mark.slow
def test_the_current_rounds_host_frozen_mid_training_at_a_fixed_size_gives_its_place_to_the_spare(
    etcd_server: EmbeddedEtcd, run_id: str, nodes: Callable[..., Node], tmp_path: Path
) -> None:
    script = agent_job.write_to(tmp_path / "freeze_host.py")
    group = [start(nodes, name, etcd_server, run_id, tmp_path, script, "2:2") for name in ("a", "b", "c")]
    # the spare taken from the probe that saw it: a second scrape under load may time out
    spare = wait_until(lambda: next((n for n in group if is_spare(n)), None)
                       if sum(len(rows(n, tmp_path)) >= 40 for n in group) == 2 else None,
                       150, "two nodes to train 40 steps (the stall rule has their pace) beside a spare",
                       on_timeout=logs(*group))
    members = [n for n in group if n is not spare]
    wait_until(lambda: spare.log_path.read_text().count("a spare: its workers start now") >= 1, 60,
               "the spare's workers to start ahead", on_timeout=lambda: spare.log_tail(40))
    host = next(n for n in members if rows(n, tmp_path)[-1]["rank"] == 0)  # the round's first node
    survivor = next(n for n in members if n is not host)
    pids = {r["pid"] for r in rows(survivor, tmp_path)}
    stale = {r["pid"] for r in rows(host, tmp_path)}
    before = rows(survivor, tmp_path)[-1]["round"]
    frozen_at = time.time()
    host.freeze()
    wait_until(lambda: any(r["round"] > before for r in rows(survivor, tmp_path) if r["time"] > frozen_at), 60,
               f"the survivor's first step without {host.name}", on_timeout=logs(survivor, spare))
    took = next(r["time"] for r in rows(survivor, tmp_path) if r["time"] > frozen_at and r["round"] > before) \
        - frozen_at
    assert took <= BOUND_S, \
        f"first step without the frozen host {took:.2f} s after it froze (lease TTL {LEASE_TTL} s)\n{logs(survivor, spare)()}"
    train_together([survivor, spare], tmp_path, 2, steps=5, after=frozen_at, timeout=60)
    assert all(r["world_size"] == 2 for r in rows(survivor, tmp_path) if r["time"] > frozen_at), "the world shrank"
    assert {r["pid"] for r in rows(survivor, tmp_path)} == pids, "the survivor's worker was restarted"
    assert_went_on_from_where_it_stood(survivor, tmp_path, 2, before)
    assert_replicas_equal([survivor, spare], tmp_path, 2, frozen_at)

    host.thaw()  # its world went on without it: it stops its stale workers and waits as the next spare
    wait_until(lambda: is_spare(host), 90, f"{host.name} back as the spare", on_timeout=lambda: host.log_tail(60))
    assert "wrote it off" in host.log_path.read_text(), host.log_tail(40)
    assert_stale_worker_trained_nothing(host, [survivor, spare], tmp_path, stale, 2, before)
    assert_trained_once(tmp_path)
