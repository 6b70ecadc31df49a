"""Case 5: etcd restarted without its data (a pod without a volume) under a running job.

Real etcd servers, a real ``elastic agent`` node running an ``ElasticRun`` job with a
snapshot directory. The job's fence stands at the rounds of the lost etcd; the new etcd
would start its rounds at 0 again, below the fence, and every group would be refused as
stale. What the user checks: with the same run id and snapshot directory the job resumes
from its newest snapshot, retrains nothing committed, and its rounds go on above the fence
(so a writer left over from before the loss, holding an older round, stays refused).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from checkpoints import Fence, SnapshotStore
from agent.etcd import EmbeddedEtcd
from agent.local.local_node import AUTO_METRICS_PORT
from elastic.ledger import check_ledger
from tests.elastic.inplace.support import JOB, rows
from tests.support.nodes import TorchrunNode as Node
from tests.support.waiting import wait_until

FORM_TIMEOUT = 150


def start(nodes: Callable[..., Node], etcd: EmbeddedEtcd, run_id: str, tmp: Path) -> Node:
    env = {"PROGRESS": str(tmp / "a.rows.jsonl"), "SNAPSHOTS": str(tmp / "snapshots"), "LEDGER": str(tmp / "ledger.jsonl"),
           "OMP_NUM_THREADS": "1", "SNAPSHOT_EVERY": "5"}
    return nodes(name="a", endpoint=etcd.endpoint, run_id=run_id, script=str(JOB), nnodes="1:1",
                 metrics_port=AUTO_METRICS_PORT, env=env,
                 agent_args=["--lease-ttl", "2", "--snapshot-dir", str(tmp / "snapshots")])


def test_a_job_whose_etcd_lost_its_data_resumes_from_its_newest_snapshot_above_the_fence(
    nodes: Callable[..., Node], run_id: str, tmp_path: Path
) -> None:
    first = EmbeddedEtcd(data_dir=tmp_path / "etcd-1")
    first.start()
    try:
        for restart in range(2):  # a restart is a new round: the fence stands above round 0
            node = start(nodes, first, run_id, tmp_path)
            wait_until(lambda: len(SnapshotStore(tmp_path / "snapshots", create=False).list()) >= 2 * (restart + 1)
                       if (tmp_path / "snapshots").exists() else False, FORM_TIMEOUT, "snapshots",
                       on_timeout=node.log_tail)
            node.kill()
    finally:
        first.close()
    old_fence = Fence(tmp_path / "snapshots").current()
    assert old_fence is not None and old_fence.run == run_id and old_fence.round >= 1
    newest = max(info.step for info in SnapshotStore(tmp_path / "snapshots", create=False).list())
    before = len(rows(node, tmp_path))

    second = EmbeddedEtcd(data_dir=tmp_path / "etcd-2")  # a new, empty etcd: every key is gone
    second.start()
    try:
        node = start(nodes, second, run_id, tmp_path)
        wait_until(lambda: len(rows(node, tmp_path)) >= before + 5, FORM_TIMEOUT, "the job to train again",
                   on_timeout=node.log_tail)
        resumed = rows(node, tmp_path)[before]
        assert resumed["step"] == newest + 1, f"resumed at step {resumed['step']}, newest snapshot {newest}"
        assert resumed["round"] > old_fence.round
        fence = Fence(tmp_path / "snapshots").current()
        assert fence is not None and fence.round == resumed["round"]
        assert "stale" not in node.log_path.read_text()
        report = check_ledger(tmp_path / "ledger.jsonl", 512)  # re-run steps supersede; no sample lost
        assert report.ok, report.violations
    finally:
        node.kill()
        second.close()
