"""``elastic local --chaos sdc``: the harness flips a bit in one node's worker, and says it was caught.

Three real agents train the ``mlp`` job; the one scheduled fault flips bit 22 of the first
parameter of a random node's local rank 0 (as ``elastic inject-sdc`` does). The replica
check (every 10 steps: what ``elastic local`` sets for ``--chaos sdc``) names that node,
every replica goes back to the last agreed state, the job ends, and the summary reports
the fault caught and the steps rolled back; the job's fault timeline has the sdc event.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from agent.local.local_cluster import parse_args
from agent.node.proctree import kill_tree
from elastic.goodput import newest_account

ROOT = Path(__file__).resolve().parents[2]


def test_sdc_is_a_chaos_kind_only_when_asked_for() -> None:
    from agent.local.local_faults import KINDS, SDC

    args, _ = parse_args(["--chaos", "sdc,kill"])
    assert args.kinds == [SDC, "kill"] and SDC not in KINDS  # the default soak's set is unchanged


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_elastic_local_injects_an_sdc_and_the_summary_says_it_was_caught(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "ELASTIC_CHECK_EVERY_STEPS"}
    # half the steps at half the pace (the job's --step-sleep after "--"): as long a run, half the CPU,
    # and the fault, timed in seconds, lands as far from the end
    proc = subprocess.Popen([sys.executable, "-m", "agent.cli", "local", "--nodes", "3", "--steps", "200",
                             "--chaos", "sdc", "--faults", "1", "--first-fault-after", "2", "--run-dir", str(run_dir),
                             "--timeout", "300", "--", "--step-sleep", "0.06"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
                            cwd=tmp_path, env={**env, "COLUMNS": "200"})
    try:
        output, _ = proc.communicate(timeout=360)
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
            proc.wait(timeout=30)
    assert proc.returncode == 0, output[-6000:]
    row = re.search(r"│ +1 │ sdc +│ (\S+) +│ +3 │ +[\d.]+ │ +(\d+) │", output)
    assert row, output[-6000:]
    node, rolled_back = row.group(1), int(row.group(2))
    assert 1 <= rolled_back <= 10, output[-6000:]  # bounded by the check interval
    caught = re.search(rf"#1 sdc {node}: caught, named {node} at step \d+ \([^)]*weight[^)]*\); every replica back to step",
                       output)
    assert caught, output[-6000:]
    account = newest_account(run_dir.glob("*.agent/goodput/job.json"))
    assert account is not None and any(f.reason == "sdc" and f.nodes == (node,) for f in account.faults), account
