"""Two tiers (``DIR,s3://...``) through the agent, with a real S3 server (SeaweedFS), real
etcd and a real agent: each tier is checked (the local directory's space and writability,
the bucket's reachability), and a node whose local tier does not exist yet makes it and
trains; it used to stat ``DIR,s3:`` as one path, and no node ever joined."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Callable

import pytest

from agent.etcd import EmbeddedEtcd
from agent.node.health_watch import HealthWatch
from checkpoints.stores import open_store
from tests.support.nodes import TorchrunNode as Node
from tests.support.s3server import SeaweedS3
from tests.support.waiting import wait_until

SNAPSHOT_CHECKS = ("snapshot_dir_space", "snapshot_dir_writable", "snapshot_bucket_reachable")


def _snapshot_checks(watch: HealthWatch) -> dict[str, str]:
    """The snapshot checks' outcomes: '' for a pass, the failure's line otherwise."""
    return {c.name: "" if c.ok else c.line() for c in watch.checks().checks if c.name.startswith("snapshot")}


def test_each_tier_is_checked(s3_server: SeaweedS3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    local = tmp_path / "nvme"
    local.mkdir()
    url = f"s3://{s3_server.bucket('health-tiers')}/job"
    watch = HealthWatch("n", f"{local},{url}", tmp_path, {})
    assert _snapshot_checks(watch) == dict.fromkeys(SNAPSHOT_CHECKS, ""), watch.checks()
    # a bucket that is not there: named, with the fix
    line = _snapshot_checks(HealthWatch("n", f"{local},s3://no-such-bucket-here/job", tmp_path, {}))
    assert "bucket 'no-such-bucket-here' does not exist" in line["snapshot_bucket_reachable"], line
    assert line["snapshot_dir_writable"] == "" and "\n" not in line["snapshot_bucket_reachable"]
    # an endpoint nothing listens on (a port bound, never listened on: connections are refused)
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{closed.getsockname()[1]}")
        line = _snapshot_checks(HealthWatch("n", f"{local},{url}", tmp_path, {}))
    assert "does not answer" in line["snapshot_bucket_reachable"], line
    # a lone bucket is checked too, with no directory check
    assert set(_snapshot_checks(HealthWatch("n", url, tmp_path, {}))) == {"snapshot_bucket_reachable"}


@pytest.mark.slow
def test_an_agent_with_two_tiers_makes_its_local_tier_and_trains(
        etcd_server: EmbeddedEtcd, s3_server: SeaweedS3, run_id: str, nodes: Callable[..., Node],
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    local = tmp_path / "scratch" / "nvme"  # not there yet, as on a new node
    url = f"s3://{s3_server.bucket('health-tiers-agent')}/job"
    node = nodes(name="a", endpoint=etcd_server.endpoint, run_id=run_id, nnodes="1",
                 env={**s3_server.env(), "OMP_NUM_THREADS": "1"},
                 module="elastic.train",
                 module_args=["--job", "mlp", "--steps", "30", "--snapshot-every-steps", "10",
                              "--progress", "{progress}"],
                 agent_args=["--lease-ttl", "2", "--snapshot-dir", f"{local},{url}"])
    wait_until(lambda: not node.alive(), 240, "the job to train to its end", on_timeout=node.log_tail)
    assert node.process is not None and node.process.returncode == 0, node.log_tail()
    log = node.log_path.read_text(errors="replace")
    assert "not joining the job" not in log and "cannot stat" not in log, node.log_tail()
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    store = open_store(f"{local},{url}", create=False, key=None)
    assert store.local.newest_valid().step == 30 and store.remote.newest_valid().step == 30
    assert store.ours(30)
