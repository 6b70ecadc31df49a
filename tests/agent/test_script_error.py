"""A script that fails the same way on every node is the script's bug: the job ends at once.

A plain DDP script (it never imports ``elastic``) with a ``NameError`` at its fifth step (and
one that raises its own ``RuntimeError("timeout")`` there, which must not read as a broken world),
under ``elastic local --nodes 2 --faults 0``. Before, each node was kept out in turn with
the crash-loop back-off until ``--timeout`` (14 crashes in 180 s, and no end without it).
What is checked is what its user sees: exit 1, the error and a log named in the last line,
no node kept out, at most two starts per node, and every agent non-zero (the closed
rendezvous carries the failure to the node that did not judge it).
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent('''\
    import os
    import torch
    import torch.distributed as dist
    from torch import nn

    dist.init_process_group("gloo")
    model = nn.parallel.DistributedDataParallel(nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(100000):
        if step == 5:
            FAIL
        loss = model(torch.randn(16, 8)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
''')
NAME_ERROR = "NameError: name 'undefined_thing' is not defined"
# A script's own RuntimeError that says "timeout": the words of a broken world, but the script
# raised it. Before, the agent read the words and took it for a peer's doing (restarted until its
# restarts ran out, never the script's verdict); the worker now says its kind (elastic.failure_record).
OWN_TIMEOUT = "RuntimeError: timeout"
FAILURES = {NAME_ERROR: "print(undefined_thing)", OWN_TIMEOUT: 'raise RuntimeError("timeout")'}


@pytest.mark.slow
@pytest.mark.parametrize("error", [NAME_ERROR, OWN_TIMEOUT])
def test_the_same_error_on_every_node_ends_the_job_with_exit_1_and_no_keep_out(error: str, tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.replace("FAIL", FAILURES[error]))
    run = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "agent.cli", "local", "--nodes", "2", "--faults", "0", "--lease-ttl", "2",
         "--timeout", "150", "--run-dir", str(run), str(script)],
        capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 1, output
    assert "stopped before" not in output, output  # it ended by itself, not at --timeout
    for name in ("node-0", "node-1"):  # both agents, the one that judged and its peer
        assert re.search(rf"│ {name} │ failed\b", output), output
    last = [line for line in done.stdout.splitlines() if line.strip()][-1]
    assert error in last and "log:" in last and "the job failed" in last, output
    for name in ("node-0", "node-1"):
        log = (run / f"{name}.log").read_text(errors="replace")
        assert "kept out of the job" not in log, log[-3000:]
        starts = log.count(f"\n{error}")
        # Ended by the verdict (checked next), not by running through --max-restarts (20 restarts,
        # 21 starts): a node judges once a peer's report of the same error is in, and under load
        # (the two busy processes) a slower peer's report came after this node's third
        # start (0.6 s apart), so a few starts are what a loaded machine makes, not a loop.
        assert 1 <= starts <= 4, f"{name}: {starts} failed starts\n{log[-3000:]}"
        said = [line for line in log.splitlines() if "the job fail" in line and "error" in line.lower()]
        assert said and all(error in line for line in said), log[-3000:]
