"""Case 1 end to end: real ``elastic agent`` nodes with a job key, a plain DDP script, an
attacker's unsigned write to the round record mid-run. What the operator checks: the job
trains its last step and both agents exit 0 (not earlier, not as a "success" at step 22);
and an agent with another key exits non-zero with one line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from agent.etcd import EmbeddedEtcd, EtcdClient
from tests.agent.test_plain_scripts import FORM_TIMEOUT, PLAIN, read_rows, start
from tests.support.nodes import TorchrunNode as Node
from tests.support.waiting import wait_until

STEPS = 80


def test_an_unsigned_write_to_the_round_record_mid_run_neither_ends_nor_restarts_the_job(
    etcd_server: EmbeddedEtcd, etcd_client: EtcdClient, run_id: str, nodes: Callable[..., Node], tmp_path: Path
) -> None:
    script, rows, key = tmp_path / "train.py", tmp_path / "rows.jsonl", tmp_path / "job.key"
    script.write_text(PLAIN)
    key.write_bytes(b"k" * 32)
    env = {"ROWS": str(rows), "ELASTIC_RDZV_HMAC_KEY_FILE": str(key), "STEP_TIME": "0.1"}
    group = [start(nodes, name, etcd_server, run_id, script, STEPS, nnodes="2:2", agent_args=["--lease-ttl", "2"],
                   env=env) for name in ("a", "b")]
    wait_until(lambda: len(read_rows(rows)) >= 10, FORM_TIMEOUT, "the job to train 10 steps",
               on_timeout=lambda: group[0].log_tail(60))
    etcd_client.call(lambda c: c.put(f"/elastic/{run_id}/rdzv/round", b"x"))

    for node in group:
        wait_until(lambda: not node.alive(), FORM_TIMEOUT, f"{node.name} to finish", on_timeout=lambda: node.log_tail(60))
    for node in group:
        assert node.process is not None and node.process.returncode == 0, node.log_tail(60)
    seen = read_rows(rows)
    assert seen[-1]["step"] == STEPS - 1, "exit 0 before the job trained its last step"
    assert len({r["pid"] for r in seen}) == 1, "the forgery restarted the workers"
    log = group[0].log_path.read_text() + group[1].log_path.read_text()
    assert "ignoring /elastic/" in log and "fails verification" in log  # the operator is told, naming the key


def test_an_agent_with_another_jobs_key_exits_non_zero_with_one_line(
    etcd_server: EmbeddedEtcd, run_id: str, nodes: Callable[..., Node], tmp_path: Path
) -> None:
    script, rows = tmp_path / "train.py", tmp_path / "rows.jsonl"
    script.write_text(PLAIN)
    (tmp_path / "job.key").write_bytes(b"k" * 32)
    (tmp_path / "other.key").write_bytes(b"o" * 32)
    # the member's lease outlasts a loaded machine (a 2 s one starved once in a whole-suite run,
    # and its restarts read as the stranger's doing); the stranger's patience is its own TTL's
    member = start(nodes, "a", etcd_server, run_id, script, 100000, nnodes="1:2", agent_args=["--lease-ttl", "5"],
                   env={"ROWS": str(rows), "ELASTIC_RDZV_HMAC_KEY_FILE": str(tmp_path / "job.key")})
    wait_until(lambda: len(read_rows(rows)) >= 3, FORM_TIMEOUT, "the job to train", on_timeout=member.log_tail)
    stranger = start(nodes, "s", etcd_server, run_id, script, 100000, nnodes="1:2", agent_args=["--lease-ttl", "2"],
                     env={"ELASTIC_RDZV_HMAC_KEY_FILE": str(tmp_path / "other.key")})
    wait_until(lambda: not stranger.alive(), FORM_TIMEOUT, "the stranger to give up", on_timeout=stranger.log_tail)
    assert stranger.process is not None and stranger.process.returncode == 2, stranger.log_tail()
    errors = [line for line in stranger.log_path.read_text().splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "does not verify with this agent's job key" in errors[0], stranger.log_tail()
    assert "Traceback" not in stranger.log_path.read_text()
    assert member.alive() and len({r["pid"] for r in read_rows(rows)}) == 1, "the stranger disturbed the job"
