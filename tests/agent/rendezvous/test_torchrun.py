"""Plain torchrun agents rendezvous through the etcd-v3 entry point and survive node loss.

Each node is a separate process tree (torchrun agent + worker); node loss is a SIGKILL
of the whole tree. The job is elastic.examples.tiny_ddp, a gloo DDP loop that logs each
completed step with its world size.
"""

from __future__ import annotations

import time
from typing import Callable

import pytest

from agent.etcd import EmbeddedEtcd
from tests.support.nodes import TorchrunNode
from tests.support.waiting import wait_until

JOB_ARGS = ["--step-time", "0.05", "--progress", "{progress}"]
FORM_TIMEOUT = 90  # two cold torch imports on a loaded 2-core machine
RECOVER_TIMEOUT = 60


def start_node(nodes: Callable[..., TorchrunNode], name: str, etcd: EmbeddedEtcd, run_id: str, **kw: object) -> TorchrunNode:
    return nodes(name=name, endpoint=etcd.endpoint, run_id=run_id, module_args=JOB_ARGS, launcher="torchrun", **kw)


def logs(*nodes: TorchrunNode) -> Callable[[], str]:
    return lambda: "\n".join(n.log_tail() for n in nodes)


# Losing the first node up instead was a second case here (40 s of CPU: torchrun's restarts are
# cold): what it added is covered by test_losing_rank_zeros_node_in_a_world_of_three below (the
# node holding rank 0 and torch's bootstrap store lost) and by this case (a world down to one).
@pytest.mark.parametrize("victim", ["second-up"])
def test_survivor_reforms_a_world_of_one_and_trains_on(
    victim: str, etcd_server: EmbeddedEtcd, run_id: str, nodes: Callable[..., TorchrunNode]
) -> None:
    first = start_node(nodes, "first", etcd_server, run_id)
    wait_until(lambda: first.progress(), FORM_TIMEOUT, "the first node to train alone", on_timeout=logs(first))
    second = start_node(nodes, "second", etcd_server, run_id)
    wait_until(
        lambda: len(first.steps_at(2)) >= 5 and len(second.steps_at(2)) >= 5,
        FORM_TIMEOUT, "both nodes to train in a world of 2", on_timeout=logs(first, second),
    )
    dead, survivor = (first, second) if victim == "first-up" else (second, first)
    dead_rank = dead.steps_at(2)[-1]["rank"]

    killed_at = time.time()
    dead.kill()
    assert not dead.alive()

    wait_until(
        lambda: len(survivor.steps_at(1, after=killed_at)) >= 10,
        RECOVER_TIMEOUT, f"the survivor to train 10 steps alone after rank {dead_rank} died",
        on_timeout=logs(survivor),
    )
    alone = survivor.steps_at(1, after=killed_at)
    assert {r["rank"] for r in alone} == {0}
    assert survivor.alive()


def test_losing_rank_zeros_node_in_a_world_of_three(
    etcd_server: EmbeddedEtcd, run_id: str, nodes: Callable[..., TorchrunNode]
) -> None:
    """torch caches the bootstrap store address; the survivors must not chase the dead one."""
    names = ["n0", "n1", "n2"]
    started = [start_node(nodes, n, etcd_server, run_id, nnodes="2:3") for n in names]
    wait_until(
        lambda: all(len(n.steps_at(3)) >= 5 for n in started),
        FORM_TIMEOUT * 2, "three nodes to train together", on_timeout=logs(*started),
    )
    rank0 = next(n for n in started if n.steps_at(3)[-1]["rank"] == 0)
    survivors = [n for n in started if n is not rank0]
    killed_at = time.time()
    rank0.kill()
    wait_until(
        lambda: all(len(n.steps_at(2, after=killed_at)) >= 5 for n in survivors),
        RECOVER_TIMEOUT, "the two survivors to train in a world of 2", on_timeout=logs(*survivors),
    )
    assert sorted(n.steps_at(2, after=killed_at)[-1]["rank"] for n in survivors) == [0, 1]
