"""Silent data corruption under real agents: `elastic inject-sdc` twice, the node kept out.

Three nodes train in place (``--nnodes 2:3``, real etcd, real agents, the replica check
every 5 steps). ``elastic inject-sdc`` asks one node's agent, through etcd, to flip a bit
of its worker's first parameter: the next check names that node, and every replica goes
back to the last agreed state. Asked again, the node is the outlier a second time within
the window: its agent keeps it out as suspect hardware, the other two go on in place,
and the ledger still shows every sample once per epoch (retrained steps' lines supersede).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest

from agent.etcd import EmbeddedEtcd
from elastic.ledger import check_ledger
from tests.agent.test_spares import DATASET
from tests.elastic.inplace.support import rows, start_script, train_together
from tests.elastic.metrics.scrape import fetch
from tests.support.nodes import TorchrunNode as Node
from tests.support import agent_job
from tests.support.waiting import wait_until
from tests.support.metrics_url import metrics_url



def _inject(etcd: EmbeddedEtcd, run_id: str, node: str) -> None:
    done = subprocess.run([sys.executable, "-m", "agent.cli", "inject-sdc", node, "--tensor", "0.weight",
                           "--rdzv-endpoint", etcd.endpoint, "--rdzv-id", run_id],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and f"asked node {node}" in done.stdout, done.stdout + done.stderr


@pytest.mark.slow
def test_a_node_corrupted_twice_is_named_rolled_back_and_kept_out(
    etcd_server: EmbeddedEtcd, run_id: str, nodes: Callable[..., Node], tmp_path: Path
) -> None:
    script = agent_job.write_to(tmp_path / "sdc.py")
    group = [start_script(nodes, name, etcd_server, run_id, tmp_path, script, nnodes="2:3",
                          env={"DATASET": str(DATASET), "JOB_GLOBAL_BATCH": "18", "JOB_CHECK_EVERY": "5",
                               "JOB_STEP_SLEEP": "0.02"},
                          # out for 60 s, not the default 5: the other two's eight steps in a world of 2 are
                          # checked while it is out, and a loaded machine can take 5 s to re-form the world
                          agent_args=("--keep-out-s", "60")) for name in ("a", "b", "c")]
    train_together(group, tmp_path, 3, steps=8)
    victim = next(n for n in group if rows(n, tmp_path)[-1]["rank"] != 0)
    others = [n for n in group if n is not victim]
    logs = lambda: "\n".join(n.log_path.read_text() for n in group)  # noqa: E731
    named = f"node {victim.name} (rank "

    _inject(etcd_server, run_id, victim.name)
    wait_until(lambda: logs().count(named) >= 1, 60, "the replica check to name the corrupted node",
               on_timeout=lambda: "".join(n.log_tail(40) for n in group))
    line = next(line for line in logs().splitlines() if "silent data corruption at step" in line)
    assert "differs in 0.weight" in line and "every replica returns to step" in line, line

    _inject(etcd_server, run_id, victim.name)
    wait_until(lambda: "suspect hardware" in victim.log_path.read_text()
               and "kept out of the job for 60 s" in victim.log_path.read_text(), 60,
               f"{victim.name}'s agent to keep it out", on_timeout=lambda: victim.log_tail(60))
    after = time.time()
    train_together(others, tmp_path, 2, steps=8, after=after, timeout=90)
    main = next(n for n in others if rows(n, tmp_path)[-1]["rank"] == 0)
    series = fetch(metrics_url(main), timeout=5)
    assert series is not None
    named_twice = sum(v for (n, labels), v in series.items()
                      if n == "elastic_sdc_mismatches_total" and dict(labels).get("node") == victim.name)
    assert named_twice >= 2, named_twice
    report = check_ledger(tmp_path / "ledger.jsonl", DATASET)
    assert report.ok, report.violations
