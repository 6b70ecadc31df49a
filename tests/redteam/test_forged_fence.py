"""An edited ``.fence`` (round 10**12) in a real ``elastic agent`` job's snapshot directory.

With a job key: edited before the start and again mid-run, it is ignored with a line naming
the file, replaced by the job's own signed fence, and the job snapshots to its last step and
exits 0. Without a key: etcd holds the job's rounds, and a fence above them was raised by no
group of the job: the agent refuses at start, one line naming ``.fence``, exit 2, no worker
started (it once crash-looped on StaleGroupError and exited 1).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from checkpoints import Fence, FenceToken, SnapshotStore
from checkpoints.fence import FENCE_NAME
from agent.etcd import EmbeddedEtcd, EtcdClient
from agent.local.local_node import AUTO_METRICS_PORT
from agent.rendezvous.rounds import RoundRecord
from agent.rendezvous.signing import StateSigner
from tests.elastic.inplace.support import JOB, rows
from tests.support.nodes import TorchrunNode as Node
from tests.support.waiting import wait_until

FORM_TIMEOUT = 150
STEPS = 30
JOB_KEY = b"k" * 32


def _start(nodes: Callable[..., Node], etcd: EmbeddedEtcd, run_id: str, tmp: Path, env: dict[str, str]) -> Node:
    env = {"PROGRESS": str(tmp / "a.rows.jsonl"), "SNAPSHOTS": str(tmp / "snapshots"), "OMP_NUM_THREADS": "1",
           "SNAPSHOT_EVERY": "5", "STEPS": str(STEPS), **env}
    return nodes(name="a", endpoint=etcd.endpoint, run_id=run_id, script=str(JOB), nnodes="1:1",
                 metrics_port=AUTO_METRICS_PORT, env=env, agent_args=["--lease-ttl", "2", "--snapshot-dir",
                                                                str(tmp / "snapshots")])


def _edit(tmp: Path, run_id: str) -> None:
    (tmp / "snapshots" / FENCE_NAME).write_text(json.dumps({"run": run_id, "round": 10**12}))


def _ran_before(etcd_client: EtcdClient, run_id: str, signer: StateSigner) -> None:
    """etcd holds the job's rounds, as after an earlier start (round 3, closed)."""
    key = f"/elastic/{run_id}/rdzv/round"
    etcd_client.call(lambda c: c.put(key, signer.seal(key.encode(), RoundRecord(3, "closed", ("a",)).to_json())))


def test_an_edited_fence_is_ignored_in_a_signed_job_and_refused_at_start_in_an_unsigned_one(
    etcd_server: EmbeddedEtcd, etcd_client: EtcdClient, nodes: Callable[..., Node], run_id: str, tmp_path: Path
) -> None:
    (tmp_path / "snapshots").mkdir()
    key = tmp_path / "job.key"
    key.write_bytes(JOB_KEY)
    key.chmod(0o600)
    signed = tmp_path / "signed"
    signed.mkdir()
    (signed / "snapshots").mkdir()
    _ran_before(etcd_client, run_id, StateSigner(JOB_KEY))
    _edit(signed, run_id)  # at start
    node = _start(nodes, etcd_server, run_id, signed, {"ELASTIC_RDZV_HMAC_KEY_FILE": str(key),
                                                        "STEP_SLEEP": "0.1"})
    wait_until(lambda: len(rows(node, signed)) >= 8, FORM_TIMEOUT, "the signed job to train",
               on_timeout=node.log_tail)
    _edit(signed, run_id)  # and during the run
    wait_until(lambda: not node.alive(), FORM_TIMEOUT, "the signed job to finish", on_timeout=node.log_tail)
    assert node.process is not None and node.process.returncode == 0, node.log_tail(60)
    steps = [i.step for i in SnapshotStore(signed / "snapshots", key=JOB_KEY, create=False).list()]
    assert steps and max(steps) >= STEPS - 1, steps  # snapshots to the last step, past both edits
    assert Fence(signed / "snapshots", key=JOB_KEY).current() is None, "the edit made mid-run stays ignored"
    text = node.log_path.read_text()
    assert f"ignoring the snapshot fence {signed / 'snapshots' / FENCE_NAME}" in text
    assert "is stale" not in text and "Traceback" not in text

    unsigned_run = run_id + "u"
    _ran_before(etcd_client, unsigned_run, StateSigner(None))
    _edit(tmp_path, unsigned_run)
    node = _start(nodes, etcd_server, unsigned_run, tmp_path, {})
    wait_until(lambda: not node.alive(), FORM_TIMEOUT, "the unsigned job to refuse", on_timeout=node.log_tail)
    assert node.process is not None and node.process.returncode == 2, node.log_tail(60)
    text = node.log_path.read_text()
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and FENCE_NAME in errors[0] and "delete" in errors[0], text[-3000:]
    assert rows(node, tmp_path) == [] and "Traceback" not in text
    assert Fence(tmp_path / "snapshots", key=None).current() == FenceToken(unsigned_run, 10**12), "nothing touched"
