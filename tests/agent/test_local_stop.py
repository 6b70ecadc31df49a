"""``elastic local`` owns its process tree: a SIGTERM stops all of it and still gives the summary.

SIGTERM is what ``timeout``, systemd and a CI cancel send. It killed the tool at once (rc
-15) and left its 8 processes (the embedded etcd, both agents, their workers) training,
reparented to init, for minutes. What is checked is what an operator sees: exit 143, the
summary and a "stopped" line without a traceback, and no process of the tree left, by pid
(each pid's start time too, so a reused pid is not mistaken for a survivor).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from agent.node.proctree import process_tree
from tests.support.waiting import wait_until

SCRIPT = textwrap.dedent('''\
    import os, sys, time
    import torch
    import torch.distributed as dist
    from torch import nn

    dist.init_process_group("gloo")
    model = nn.parallel.DistributedDataParallel(nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(1000000):
        loss = model(torch.randn(16, 8)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step == 3:
            open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}"), "w").close()
        time.sleep(0.05)
''')


def started_at(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return None if fields[0] == "Z" else fields[19]


@pytest.mark.slow
def test_sigterm_stops_etcd_the_agents_and_their_workers_and_prints_the_summary(tmp_path: Path) -> None:
    script, marks, run = tmp_path / "train.py", tmp_path / "marks", tmp_path / "run"
    script.write_text(SCRIPT)
    marks.mkdir()
    tool = subprocess.Popen(
        [sys.executable, "-m", "agent.cli", "local", "--nodes", "2", "--faults", "0", "--lease-ttl", "2",
         "--run-dir", str(run), str(script), str(marks)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
    )
    try:
        wait_until(lambda: len(os.listdir(marks)) >= 2, 150, "both workers training",
                   on_timeout=lambda: "\n".join(p.read_text(errors="replace")[-2000:] for p in run.glob("*.log")))
        tree = {pid: started_at(pid) for pid in process_tree(tool.pid)}
        assert len(tree) >= 6, tree  # the tool, etcd, two agents, two workers (and standbys)
        tool.send_signal(signal.SIGTERM)
        out, err = tool.communicate(timeout=90)
    finally:
        if tool.poll() is None:
            for pid in reversed(process_tree(tool.pid)):
                os.kill(pid, signal.SIGKILL)
            tool.wait()
    assert tool.returncode == 143, out + err
    assert "stopped before the script ended (SIGTERM)" in out, out + err
    assert "Traceback" not in out + err, out + err
    left = [pid for pid, start in tree.items() if start is not None and started_at(pid) == start]
    assert not left, f"still running after the tool exited: {left}"
