"""``make demo`` as a new user runs it: no input, faults, recoveries, a summary, exit 0."""

from __future__ import annotations

import pytest

import re
import subprocess
import sys
from pathlib import Path


@pytest.mark.slow  # starts processes
def test_local_cluster_runs_end_to_end_with_a_kill_and_a_freeze(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "agent.cli", "local", "--nodes", "3", "--steps", "900", "--faults", "2",
         "--first-fault-after", "3", "--fault-every", "6", "--back-after", "4", "--lease-ttl", "2",
         "--run-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    faults = re.findall(r"│ (\d) │ (kill|freeze) +│ (node-\d) │ +3 │ +([\d.]+) │ +(\d+) │", output)
    assert [f[1] for f in faults] == ["kill", "freeze"], output
    assert all(float(f[3]) < 60 for f in faults), output
    assert all(f[4] == "0" for f in faults), output  # in place: no step rolled back
    assert "final step 900" in output, output
    assert re.search(r"^goodput [\d.]+ % of .* since the first step \(productive ", output, re.M), output
    first, final = map(float, re.search(r"final loss ([\d.e-]+) \(first ([\d.e-]+)\)", output).groups()[::-1])
    assert final < first, output
    snapshots = sorted((tmp_path / "run" / "snapshots").glob("step-*"))
    assert snapshots and snapshots[-1].name == "step-000000000900"
