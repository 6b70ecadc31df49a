"""Replay end to end: real ``elastic agent`` nodes with a job key, a plain DDP script, and a
writer without the key who puts back signed bytes the agents wrote earlier.

A signature proves who wrote a value, not when. What the operator checks: the healthy node
is not kept out (the job keeps its world of 2 and its workers), an older round record put
back is not a round, a node's own older registry record put back is rewritten by it, the
agents say so naming the key, and the job trains its last step.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from agent.etcd import EmbeddedEtcd, EtcdClient
from agent.rendezvous.keepout import KeepOut
from agent.rendezvous.rounds import OPEN, RoundRecord
from agent.rendezvous.signing import StateSigner
from tests.agent.test_plain_scripts import FORM_TIMEOUT, PLAIN, read_rows, start
from tests.support.nodes import TorchrunNode as Node
from tests.support.waiting import wait_until

STEPS = 60
JOB_KEY = b"k" * 32


def test_signed_values_put_back_later_are_stale_not_decisions(
    etcd_server: EmbeddedEtcd, etcd_client: EtcdClient, run_id: str, nodes: Callable[..., Node], tmp_path: Path
) -> None:
    script, rows, key = tmp_path / "train.py", tmp_path / "rows.jsonl", tmp_path / "job.key"
    script.write_text(PLAIN)
    key.write_bytes(JOB_KEY)
    key.chmod(0o600)
    env = {"ROWS": str(rows), "ELASTIC_RDZV_HMAC_KEY_FILE": str(key), "STEP_TIME": "0.1"}
    group = [start(nodes, name, etcd_server, run_id, script, STEPS, nnodes="1:2", agent_args=["--lease-ttl", "2"],
                   env=env) for name in ("a", "b")]
    node_key = f"/elastic/{run_id}/nodes/b"
    wait_until(lambda: etcd_client.call(lambda c: c.get(node_key))[0] is not None, FORM_TIMEOUT, "b to register",
               on_timeout=lambda: group[1].log_tail(60))
    b_before, _ = etcd_client.call(lambda c: c.get(node_key))  # b's signed record as it stood then
    wait_until(lambda: len([r for r in read_rows(rows) if r["world"] == 2]) >= 3, FORM_TIMEOUT,
               "the job to train in a world of 2", on_timeout=lambda: group[0].log_tail(60))
    replayed_at = time.time()
    run = f"/elastic/{run_id}"
    signer = StateSigner(JOB_KEY)
    # What b's agent writes when it is kept out, under its live lease: the attacker captured these
    # bytes then, and puts them back now without a lease (no key needed for either).
    _, meta = etcd_client.call(lambda c: c.get(f"{run}/nodes/b"))
    lease_b = meta.lease_id
    keepout_key = f"{run}/keepout/b"
    keepout = signer.seal(keepout_key.encode(), KeepOut("b", 1, 5.0, ("a",), lease=lease_b).to_json())
    etcd_client.call(lambda c: c.put(keepout_key, keepout))
    # The round record as it stood before this round closed: the same round, open.
    round_key = f"{run}/rdzv/round"
    raw, _ = etcd_client.call(lambda c: c.get(round_key))
    current = RoundRecord.from_json(signer.open(round_key.encode(), raw))
    older = signer.seal(round_key.encode(), RoundRecord(current.round, OPEN, previous=current.previous).to_json())
    etcd_client.call(lambda c: c.put(round_key, older))
    logs = lambda: "".join(n.log_path.read_text() for n in group)  # noqa: E731
    wait_until(lambda: f"ignoring {keepout_key}" in logs() and f"ignoring {round_key}" in logs(), FORM_TIMEOUT,
               "the agents to ignore the replayed values", on_timeout=lambda: group[0].log_tail(60))
    wait_until(lambda: etcd_client.call(lambda c: c.get(round_key))[0] != older, FORM_TIMEOUT,
               "a member to put the round record back")
    # The same keep-out put back under b's own live lease: b knows it is not out and deletes it.
    etcd_client.call(lambda c: c.put(keepout_key, keepout, lease=lease_b))
    wait_until(lambda: etcd_client.call(lambda c: c.get(keepout_key))[0] is None, FORM_TIMEOUT,
               "b to delete the keep-out it did not write", on_timeout=lambda: group[1].log_tail(60))

    # b's own older record, put back under its live lease: b rewrites its record (when it next
    # reads the registry it sees a write that is not its own; its pace updates rewrite it anyway).
    etcd_client.call(lambda c: c.put(node_key, b_before, lease=lease_b))
    wait_until(lambda: etcd_client.call(lambda c: c.get(node_key))[0] != b_before, FORM_TIMEOUT,
               "b to rewrite its own record", on_timeout=lambda: group[1].log_tail(60))

    for node in group:
        wait_until(lambda: not node.alive(), FORM_TIMEOUT * 2, f"{node.name} to finish",
                   on_timeout=lambda: node.log_tail(60))
    for node in group:
        assert node.process is not None and node.process.returncode == 0, node.log_tail(60)
    seen = read_rows(rows)
    assert seen[-1]["step"] == STEPS - 1
    after = [r for r in seen if r["time"] > replayed_at]
    assert after and all(r["world"] == 2 for r in after), "the healthy node was kept out: the job lost its world"
    assert len({r["pid"] for r in after}) == 1, "a replay restarted the workers:\n" + group[0].log_tail(80)
    assert "kept out of round" not in logs()
    assert "stale" in logs()
