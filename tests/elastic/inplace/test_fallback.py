"""Where in-place recovery cannot run, the restart path still recovers, and says why once.

A torch without the reconfigure API cannot be installed beside 2.14 here, so this test
stands in for one: a ``sitecustomize`` on the nodes' ``PYTHONPATH`` deletes the three
``torch.distributed`` functions before anything uses them, in the agent, its standbys and
its workers alike. Everything else is real: etcd, agents, the SIGKILL, the restore.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Callable

import pytest

from agent.etcd import EmbeddedEtcd
from tests.elastic.inplace.support import at_world, logs, metric, rows, start_job, train_together
from tests.support.nodes import TorchrunNode as Node
from tests.support.waiting import wait_until

HIDE_API = """\
import torch.distributed as _dist
for _name in ("_reconfigure", "_get_reconfigure_handle", "_supports_reconfigure"):
    if hasattr(_dist, _name):
        delattr(_dist, _name)
"""
SAID = "in-place recovery off: this torch"
_RESTARTED = re.compile(r"elastic\.agent: \[\S+\] restart \(")


@pytest.mark.slow
def test_a_torch_without_the_reconfigure_api_gets_the_restart_path_with_one_log_line(
    etcd_server: EmbeddedEtcd, run_id: str, nodes: Callable[..., Node], tmp_path: Path
) -> None:
    site = tmp_path / "old-torch"
    site.mkdir()
    (site / "sitecustomize.py").write_text(HIDE_API)
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)}
    a, b = (start_job(nodes, n, etcd_server, run_id, tmp_path, env=env) for n in ("a", "b"))
    train_together([a, b], tmp_path, 2, steps=15)  # past the first snapshot (every 10 steps)
    rank0 = a if rows(a, tmp_path)[-1]["rank"] == 0 else b
    victim = b if rank0 is a else a
    # once per worker start at most: under load one node may form the first round alone, and
    # the other's join then restarts the workers (the restart path) before the kill below,
    # maybe before that first worker got as far as saying it (seen: stopped 0.1 s after its start)
    starts_before, said_before = worker_starts(rank0), rank0.log_path.read_text().count(SAID)
    assert 1 <= said_before <= starts_before, rank0.log_tail(40)
    assert "has no process-group reconfigure API" in rank0.log_path.read_text()
    pid = rows(rank0, tmp_path)[-1]["pid"]

    killed_at = time.time()
    victim.kill()
    train_together([rank0], tmp_path, 1, steps=3, after=killed_at, timeout=90)
    alone = at_world(rank0, tmp_path, 1, after=killed_at)  # a step may finish just after the kill, at 2
    assert pid not in {r["pid"] for r in alone}, "the survivor's worker was not restarted"
    wait_until(lambda: metric(rank0, "elastic_agent_restarts_total", reason="peer_lost") >= 1, 10,
               "the restart to be counted", on_timeout=logs(rank0))
    assert metric(rank0, "elastic_restores_total", source="disk") >= 1  # the new worker read the snapshot
    assert worker_starts(rank0) > starts_before, rank0.log_tail(40)  # the restart
    # the restarted worker lived to say it, once
    assert rank0.log_path.read_text().count(SAID) - said_before == worker_starts(rank0) - starts_before, \
        rank0.log_tail(40)


def worker_starts(node: Node) -> int:
    """The node's worker starts so far: the first, and one per restart its agent logged."""
    return 1 + len(_RESTARTED.findall(node.log_path.read_text()))
