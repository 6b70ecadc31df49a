"""``elastic local --snapshot-dir s3://...``: a job whose snapshots live in a real S3 server
(SeaweedFS) survives a kill, and a second run of it resumes from the object store."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from checkpoints.stores import open_store
from checkpoints.signing import load_key
from tests.support.s3server import SeaweedS3


def _local(run_dir: Path, url: str, env: dict[str, str], *extra: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "agent.cli", "local", "--nodes", "2", "--lease-ttl", "2", "--run-dir", str(run_dir),
         "--snapshot-dir", url, *extra], capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
        env=env)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    return output


def test_a_job_snapshots_to_s3_through_a_kill_and_resumes_from_it(s3_server: SeaweedS3, tmp_path: Path) -> None:
    env = {**os.environ, **s3_server.env()}
    url = f"s3://{s3_server.bucket('local-job')}/run"
    run = tmp_path / "run"
    # the killed node stays down (its return, a heal from a live replica, is not what this
    # test checks: tests/agent/test_demo.py and test_plain_scripts.py run it); the survivor
    # trains on in place and writes the last snapshot
    out = _local(run, url, env, "--steps", "120", "--faults", "1", "--chaos", "kill", "--first-fault-after", "2",
                 "--back-after", "600")
    assert re.search(r"│ 1 │ kill +│ node-\d │", out) and "final step 120" in out, out
    os.environ.update(s3_server.env())
    store = open_store(url, create=False, key=load_key(str(run / "rdzv.key"))[0])  # the job's own key
    assert store.newest_valid().step == 120
    # a new run (its etcd is new; the ended run's rendezvous is closed) under the same job key
    again = tmp_path / "again"
    again.mkdir()
    shutil.copy(run / "rdzv.key", again / "rdzv.key")
    out = _local(again, url, env, "--steps", "160", "--faults", "0")
    logs = "".join(p.read_text(errors="replace") for p in again.glob("*.log"))
    assert "resumed from snapshot step 120" in logs, out
    assert "final step 160" in out and store.newest_valid().step == 160


def test_a_bucket_that_does_not_exist_is_one_line_before_any_node_starts(s3_server: SeaweedS3,
                                                                         tmp_path: Path) -> None:
    for cmd in (["local", "--run-dir", str(tmp_path / "run")], ["agent", "--rdzv-endpoint", "127.0.0.1:1"]):
        done = subprocess.run([sys.executable, "-m", "agent.cli", *cmd, "--snapshot-dir", "s3://no-such-bucket/x",
                               *(["train.py"] if cmd[0] == "agent" else [])],
                              capture_output=True, text=True, timeout=60, env={**os.environ, **s3_server.env()},
                              stdin=subprocess.DEVNULL)
        assert done.returncode == 2, done.stdout + done.stderr
        assert done.stderr.strip().count("\n") == 0 and "bucket 'no-such-bucket' does not exist" in done.stderr, \
            done.stderr
        assert not (tmp_path / "run" / "etcd").exists()  # nothing started
