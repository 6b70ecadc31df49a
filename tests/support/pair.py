"""Real processes running one script side by side (rank 0 hosts their TCPStore)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from agent.etcd.server import free_port
from tests.support.spawn import python

REPO = Path(__file__).resolve().parents[2]


def run_pair(script: str, tmp_path: Path, timeout: float = 90.0) -> list[str]:
    """Run ``script`` as ranks 0 and 1 (``sys.argv[1:] == [rank, port]``); their stdouts.

    Both are killed by pid if either outlives ``timeout``; a non-zero exit fails with both logs.
    """
    return run_ranks(script, tmp_path, [0, 0], timeout)


def run_ranks(script: str, tmp_path: Path, codes: list[int | tuple[int, ...]], timeout: float = 90.0) -> list[str]:
    """Run ``script`` as ranks ``0..len(codes)-1``; their stdouts. Each must exit with its
    code in ``codes``, or one of a tuple (``-9``: it SIGKILLs itself); all are killed by pid
    past ``timeout``."""
    path = tmp_path / "pair_script.py"
    path.write_text(script)
    # picked ahead, not port 0: every rank needs rank 0's TCPStore port on its command line before any starts
    port = str(free_port())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    logs = [tmp_path / f"pair_rank{rank}.log" for rank in range(len(codes))]
    procs = [python([str(path), str(rank), port], logs[rank], env=env) for rank in range(len(codes))]
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break  # the rest are killed below, and the exit codes say which ran over
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    outs = [log.read_text(errors="replace") for log in logs]
    got = [p.returncode for p in procs]
    allowed = [c if isinstance(c, tuple) else (c,) for c in codes]
    assert all(g in a for g, a in zip(got, allowed)), f"exit codes {got}, expected {codes}\n" + "\n---\n".join(outs)
    return outs
