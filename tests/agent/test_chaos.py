"""The chaos soak, CI-sized: five faults, every kind at least once, and nothing lost.

``bench/chaos_soak.py`` runs as a user runs it: three real agent process trees, a real
etcd, the ``mlp`` job with its ledger. The test reads what a user reads (the exit code,
the per-fault lines) and then checks the ledger and the snapshots again itself, so a
soak whose own checks went blind would still fail here. Deadlines are generous: worker
restarts cost seconds each on two loaded cores; the figures belong in BENCHMARKS.md.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from agent.local.local_cluster import KINDS
from agent.node.proctree import kill_tree
from elastic.ledger import check_ledger

ROOT = Path(__file__).resolve().parents[2]
SNAPSHOT_EVERY = 10
FAULT_LINE = re.compile(
    r"^fault +\d+ +(?P<kind>\S+) +(?P<node>\S+) +world (?P<world>\d) +step +\d+ +"
    r"recovery +(?P<seconds>[\d.]+) s +rolled back +(?P<lost>\d+) steps", re.M)


def run_soak(run_dir: Path, *args: str, timeout: float) -> tuple[int, str]:
    """The soak as a subprocess; on any failure its whole tree (etcd, agents, workers) is SIGKILLed."""
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "bench" / "chaos_soak.py"), "--run-dir", str(run_dir), *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True, cwd=ROOT,
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
        return proc.returncode, output
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
            proc.wait(timeout=30)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_five_random_faults_of_every_kind_lose_no_sample_and_corrupt_no_snapshot(tmp_path: Path) -> None:
    run_dir = tmp_path / "soak"
    code, output = run_soak(
        run_dir, "--faults", "5", "--duration", "600", "--seed", "3", "--gap", "1", "3", "--back-after", "1", "4",
        "--snapshot-every-steps", str(SNAPSHOT_EVERY), "--recovery-deadline", "150",
        timeout=840,
    )
    assert code == 0, output
    assert "violations: 0" in output, output

    faults = [m.groupdict() for m in FAULT_LINE.finditer(output)]
    assert len(faults) == 5, output
    assert {f["kind"] for f in faults} == set(KINDS), output
    assert all(f["world"] == "3" for f in faults), output  # each fault hit a whole world
    # Rolled-back work is bounded by the snapshot interval (one more if a write was skipped or cut short).
    assert all(int(f["lost"]) <= 2 * SNAPSHOT_EVERY for f in faults), output
    assert re.search(r"kill-rank0-snapshot .*\((caught \.tmp-step-|no write seen)", output), output
    goodput = re.search(r"^goodput ([\d.]+) % of .* since the first step \(productive .*; lost: (.*)\)$", output, re.M)
    assert goodput and 0 < float(goodput.group(1)) < 100 and "detection" in goodput.group(2), output

    report = check_ledger(run_dir / "ledger.jsonl", dataset_size=1024)
    assert report.ok, report.violations
    assert report.completed_epochs, output
    verified = subprocess.run([sys.executable, "-m", "checkpoints", "verify", str(run_dir / "snapshots")],
                              capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert verified.returncode == 0, verified.stdout + verified.stderr
