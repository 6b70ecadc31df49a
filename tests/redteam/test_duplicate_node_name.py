"""Case 2: two agents under one ``--node-name`` must never both be members of the job.

Real etcd and real handlers in this process (each is what an agent runs), then real agents.
What the operator checks: the second agent is refused with one line naming the holder and
the fix, the first keeps its round; a quick restart of a node (its previous incarnation's
lease still running out) is not mistaken for a duplicate.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from agent.etcd import EmbeddedEtcd, EtcdClient
from agent.rendezvous import create_handler
from agent.rendezvous.handler import EtcdV3RendezvousHandler, RendezvousStateError
from agent.rendezvous.registry import NodeRecord, nodes_prefix
from agent.rendezvous.signing import StateSigner
from tests.agent.test_plain_scripts import FORM_TIMEOUT, PLAIN, read_rows, start
from tests.support.nodes import TorchrunNode as Node
from tests.support.waiting import wait_until

TTL = 2


def handler(etcd: EmbeddedEtcd, run_id: str, name: str) -> EtcdV3RendezvousHandler:
    return create_handler(RendezvousParameters("etcd-v3", etcd.endpoint, run_id, 1, 2, node_name=name,
                                               lease_ttl=str(TTL)))


def test_a_second_handler_under_a_live_name_is_refused_and_the_first_keeps_its_round(
    etcd_server: EmbeddedEtcd, run_id: str
) -> None:
    first = handler(etcd_server, run_id, "a")
    second = handler(etcd_server, run_id, "a")
    try:
        assert first.next_rendezvous().world_size == 1
        began = time.monotonic()
        with pytest.raises(RendezvousStateError, match="node name 'a' is in use by a live agent") as info:
            second.next_rendezvous()
        assert "\n" not in str(info.value) and "--node-name" in str(info.value)
        assert time.monotonic() - began < TTL + 5  # refused once a previous incarnation's lease would be gone
        assert first.restart_reason() is None
        assert first.node_records()["a"].pid == first.lease.record.pid
    finally:
        second.close()
        first.close()


def test_a_quick_restart_waits_out_its_previous_incarnations_lease(
    etcd_server: EmbeddedEtcd, etcd_client: EtcdClient, run_id: str
) -> None:
    """A dead agent's record (signed, another pid, under a lease nobody renews) is no duplicate."""
    key = nodes_prefix("/elastic", run_id) + "a"
    old = NodeRecord(node="a", host="somewhere", pid=1, state="running")
    lease = etcd_client.call(lambda c: c.lease(TTL))
    etcd_client.call(lambda c: c.put(key, StateSigner(None).seal(key.encode(), old.to_json()), lease=lease.id))
    restarted = handler(etcd_server, run_id, "a")
    try:
        assert restarted.next_rendezvous().world_size == 1
        value = etcd_client.call(lambda c: c.get(key))[0]
        assert value is not None and json.loads(restarted.signer.open(key.encode(), value))["pid"] != 1
    finally:
        restarted.close()


def test_a_duplicate_elastic_agent_exits_2_with_one_line_and_the_job_trains_on(
    etcd_server: EmbeddedEtcd, run_id: str, nodes: Callable[..., Node], tmp_path: Path
) -> None:
    script, rows = tmp_path / "train.py", tmp_path / "rows.jsonl"
    script.write_text(PLAIN)
    member = start(nodes, "a", etcd_server, run_id, script, 100000, nnodes="1:2", agent_args=["--lease-ttl", "2"],
                   env={"ROWS": str(rows)})
    wait_until(lambda: len(read_rows(rows)) >= 3, FORM_TIMEOUT, "the job to train", on_timeout=member.log_tail)
    # The copy on another machine (its own --agent-dir; two agents on one directory are refused
    # before they reach the rendezvous: tests/agent/test_agent_dir_lock.py).
    other_host = tmp_path / "other-host"
    other_host.mkdir()
    copy = start(nodes, "a", etcd_server, run_id, script, 100000, nnodes="1:2", agent_args=["--lease-ttl", "2"],
                 workdir=other_host)
    wait_until(lambda: not copy.alive(), FORM_TIMEOUT, "the copy to be refused", on_timeout=copy.log_tail)
    assert copy.process is not None and copy.process.returncode == 2
    text = copy.log_path.read_text()
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "node name 'a' is in use by a live agent" in errors[0], text[-3000:]
    assert "Traceback" not in text
    before = len(read_rows(rows))
    wait_until(lambda: len(read_rows(rows)) >= before + 5, 60, "the job to train on", on_timeout=member.log_tail)
    assert member.alive() and len({r["pid"] for r in read_rows(rows)}) == 1, "the copy disturbed the job"
