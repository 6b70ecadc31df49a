"""Two real processes running one script side by side (rank 0 hosts their TCPStore)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from elastic.etcd.server import free_port

REPO = Path(__file__).resolve().parents[2]


def run_pair(script: str, tmp_path: Path, timeout: float = 90.0) -> list[str]:
    """Run ``script`` as ranks 0 and 1 (``sys.argv[1:] == [rank, port]``); their stdouts.

    Both are killed by pid if either outlives ``timeout``; a non-zero exit fails with both logs.
    """
    path = tmp_path / "pair_script.py"
    path.write_text(script)
    port = str(free_port())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, str(path), str(rank), port], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=env, stdin=subprocess.DEVNULL)
             for rank in (0, 1)]
    outs: list[str] = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    codes = [p.returncode for p in procs]
    assert codes == [0, 0], f"exit codes {codes}\n" + "\n---\n".join(outs)
    return outs
