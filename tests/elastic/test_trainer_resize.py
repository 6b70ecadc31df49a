"""Exactly once across resizes: 3 nodes -> kill one -> 2 nodes -> start one -> 3 nodes.

The job is long; once the third world has trained a few steps the test stops every agent
with SIGTERM (as an operator would), which also exercises the workers' clean shutdown.
The ledger must then show every sample of every completed epoch exactly once, every
committed step once (the survivors re-form in place, nothing is trained twice), and the
three world sizes in that order.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Callable

import pytest

from agent.etcd import EmbeddedEtcd
from elastic.ledger import check_ledger, effective_steps, read_ledger
from tests.elastic.trainer_support import logs, start_runner, wait_for_step
from tests.support.nodes import TorchrunNode
from tests.support.waiting import wait_until

DATASET = 48  # 6 steps of 8 per epoch: epochs end often, at every world size


@pytest.mark.slow
def test_three_two_three_nodes_train_every_sample_once_per_epoch(
    nodes: Callable[..., TorchrunNode], etcd_server: EmbeddedEtcd, run_id: str, tmp_path: Path
) -> None:
    ledger = tmp_path / "ledger.jsonl"
    args = [
        "--job", "mlp", "--dataset-size", str(DATASET), "--global-batch-size", "8", "--steps", "100000",
        "--snapshot-every-steps", "4", "--step-sleep", "0.1", "--snapshot-dir", str(tmp_path / "snap"),
        "--ledger", str(ledger),
    ]

    def start(name: str) -> TorchrunNode:
        return start_runner(nodes, name, endpoint=etcd_server.endpoint, run_id=run_id, workdir=tmp_path,
                            args=args, nnodes="2:3")

    a, b, c = start("a"), start("b"), start("c")
    group = [a, b, c]
    wait_for_step(a, 8, b, c, world_size=3)
    t_three = time.time()
    c.kill()
    t_kill = time.time()
    at_two = wait_for_step(a, 1, b, c, world_size=2, after=t_kill)
    wait_for_step(a, at_two["step"] + 3, b, world_size=2, after=t_kill)
    c2 = start("c2")
    group = [a, b, c2]
    t_back = time.time()
    at_three = wait_for_step(a, 1, b, c2, world_size=3, after=t_back)
    wait_for_step(a, at_three["step"] + 6, b, c2, world_size=3, after=t_back)

    for node in group:
        assert node.process is not None
        node.process.send_signal(signal.SIGTERM)
    wait_until(lambda: not any(n.alive() for n in group), 60, "every agent to stop after SIGTERM",
               on_timeout=logs(*group))

    report = check_ledger(ledger, DATASET, expect_epochs=3)
    assert report.ok, report.violations
    worlds = [row["world_size"] for _, row in sorted(effective_steps(read_ledger(ledger)).items())]
    phases = [w for i, w in enumerate(worlds) if i == 0 or w != worlds[i - 1]]
    assert phases[-3:] == [3, 2, 3], f"world sizes over the committed steps: {phases}"
    # in place: the kill and the rejoin re-formed the world in the survivors' own processes
    for node in (a, b):
        pids = {r["pid"] for r in node.progress() if r["time"] > t_three}
        assert len(pids) == 1, f"{node.name}'s worker was restarted: pids {pids}"
    steps = [int(r["step"]) for r in read_ledger(ledger)]
    assert len(steps) == len(set(steps)), "a committed step was trained again"
    rank0_logs = "\n".join(n.log_path.read_text(errors="replace") for n in group)
    assert "got signal 15: stopping at step" in rank0_logs, "rank 0 did not stop cleanly on SIGTERM"
