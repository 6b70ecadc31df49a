"""``make demo`` as a new user runs it: no input, a kill, a recovery, a summary, exit 0."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_demo_runs_end_to_end(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "agent.demo", "--timeout", "150", "--run-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "killed node-b" in output
    assert "node-a trains alone" in output
    assert "world of 2 again" in output
    assert "final loss" in output
