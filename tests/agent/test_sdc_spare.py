"""A node kept out for silent data corruption is replaced by the warm spare that waits.

Three real agents, ``--nnodes 2:2``: two train, the third waits as a warm spare. The
replica check runs every step, so a NaN that ``elastic inject-sdc --nan`` writes into one
member's parameter is caught at the very boundary it was written at, before the next
gradient all-reduce could spread it: the finite replica is right, so even with two
replicas that member is named the outlier (a flipped bit would make both suspects). Named
twice within the window, its agent keeps it out as suspect hardware, and the spare takes
its place: the world is 2 again, trained by the survivor and the former spare.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest

from agent.etcd import EmbeddedEtcd
from tests.agent.test_spares import DATASET, is_spare
from tests.elastic.inplace.support import rows, start_script, train_together
from tests.support import agent_job
from tests.support.nodes import TorchrunNode as Node
from tests.support.waiting import wait_until


def _nan(etcd: EmbeddedEtcd, run_id: str, node: str) -> None:
    done = subprocess.run([sys.executable, "-m", "agent.cli", "inject-sdc", node, "--nan", "--tensor", "0.weight",
                           "--rdzv-endpoint", etcd.endpoint, "--rdzv-id", run_id],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and f"asked node {node} through etcd to write a NaN into 0.weight" in done.stdout, \
        done.stdout + done.stderr


@pytest.mark.slow
def test_a_node_kept_out_for_sdc_is_replaced_by_the_warm_spare(
    etcd_server: EmbeddedEtcd, run_id: str, nodes: Callable[..., Node], tmp_path: Path
) -> None:
    script = agent_job.write_to(tmp_path / "sdc_spare.py")  # the replica check at every step
    group = [start_script(nodes, name, etcd_server, run_id, tmp_path, script, nnodes="2:2",
                          env={"DATASET": str(DATASET), "JOB_CHECK_EVERY": "1"}) for name in ("a", "b", "c")]
    # the spare taken from the probe that saw it: a second scrape under load may time out
    spare = wait_until(lambda: next((n for n in group if is_spare(n)), None)
                       if sum(bool(rows(n, tmp_path)) for n in group) == 2 else None, 150,
                       "two nodes to train and the third to wait as a spare", on_timeout=lambda: group[2].log_tail(60))
    members = [n for n in group if n is not spare]
    train_together(members, tmp_path, 2, steps=4)
    victim = next(n for n in members if rows(n, tmp_path)[-1]["rank"] != 0)
    survivor = next(n for n in members if n is not victim)

    for strike in (1, 2):
        _nan(etcd_server, run_id, victim.name)
        wait_until(lambda: victim.log_path.read_text().count("named this node the outlier") >= strike, 60,
                   f"the replica check to name {victim.name} the outlier ({strike})",
                   on_timeout=lambda: victim.log_tail(60) + survivor.log_tail(30))
    said = survivor.log_path.read_text() + victim.log_path.read_text()
    assert "non-finite values in one replica at step" in said and f"node {victim.name} (rank" in said, said[-4000:]
    assert "training diverged" not in said, said[-4000:]
    wait_until(lambda: "suspect hardware" in victim.log_path.read_text()
               and "kept out of the job" in victim.log_path.read_text(), 60, f"{victim.name}'s agent to keep it out",
               on_timeout=lambda: victim.log_tail(60))
    assert "not kept out" not in victim.log_path.read_text()  # the job is at its minimum: the spare counts
    kept_out_at = time.time()
    train_together([survivor, spare], tmp_path, 2, steps=4, after=kept_out_at, timeout=60)
    assert not is_spare(spare)
    assert f"in the place of {victim.name}" in spare.log_path.read_text(), spare.log_tail(40)
