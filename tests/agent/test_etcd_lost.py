"""etcd lost its state under a job whose agents were not given ``--snapshot-dir``.

A real etcd and real ``elastic agent`` nodes running an ``ElasticRun`` job. The job's fence
stands at the rounds of the lost etcd (round 5, set here); the empty etcd starts its rounds at 0,
and agents without ``--snapshot-dir`` cannot start them above the fence. Before, the
workers hit ``StaleGroupError`` 13 times, were restarted 4 times, and one agent exited 0
and one 1. What is checked now: rank 0 tells its agent the fence that refused it, and
every agent ends at once, exit 1, with one line naming the fix; no worker is restarted.
(With ``--snapshot-dir`` the job resumes: ``tests/redteam/test_etcd_state_loss.py``.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from checkpoints import Fence, FenceToken
from agent.etcd import EmbeddedEtcd
from tests.elastic.inplace.support import JOB
from tests.support.nodes import TorchrunNode as Node
from tests.support.waiting import wait_until

FORM_TIMEOUT = 150


def start(nodes: Callable[..., Node], name: str, etcd: EmbeddedEtcd, run_id: str, tmp: Path, nnodes: str) -> Node:
    env = {"PROGRESS": str(tmp / f"{name}.rows.jsonl"), "SNAPSHOTS": str(tmp / "snapshots"),
           "OMP_NUM_THREADS": "1", "SNAPSHOT_EVERY": "5"}
    return nodes(name=name, endpoint=etcd.endpoint, run_id=run_id, script=str(JOB), nnodes=nnodes, env=env,
                 agent_args=["--lease-ttl", "2"])  # no --snapshot-dir: only the workers know the directory


def test_every_agent_ends_at_once_naming_the_fix_when_etcd_lost_the_jobs_rounds(
    nodes: Callable[..., Node], run_id: str, tmp_path: Path
) -> None:
    snapshots = tmp_path / "snapshots"
    snapshots.mkdir()
    Fence(snapshots).raise_to(FenceToken(run_id, 5))  # where the lost etcd's rounds had come to
    fence = Fence(snapshots).current()
    assert fence is not None and fence.round == 5

    second = EmbeddedEtcd(data_dir=tmp_path / "etcd-2")  # a new, empty etcd: every key is gone
    second.start()
    try:
        a, b = (start(nodes, name, second, run_id, tmp_path, "2:2") for name in ("a2", "b2"))
        wait_until(lambda: not a.alive() and not b.alive(), FORM_TIMEOUT, "both agents to end",
                   on_timeout=lambda: a.log_tail(60) + b.log_tail(60))
        for node in (a, b):
            log = node.log_path.read_text(errors="replace")
            assert node.process is not None and node.process.returncode == 1, log[-4000:]
            fix = [line for line in log.splitlines() if line.startswith("error:")]
            assert len(fix) == 1 and "etcd lost this job's state" in fix[0], log[-4000:]
            assert f"--snapshot-dir {snapshots}" in fix[0] and f"round {fence.round}" in fix[0], fix
            assert "started again" not in log and "restart (" not in log, log[-4000:]  # nothing restarted
            assert "Traceback" not in log, log[-4000:]  # the stale worker's one line, not a traceback
            assert "this group is stale (StaleGroupError)" in log, log[-4000:]
    finally:
        second.close()
