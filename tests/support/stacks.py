"""Every thread's stack of a stuck node, in its log, for a test that is about to fail.

The agent and the workers it starts register ``faulthandler`` on SIGUSR1 (the agent in
``agent/node/launch.py``, a worker through its bootstrap); a timeout's message then says
where each process waited, not only that it did. Only processes that catch SIGUSR1 are
signalled (their ``SigCgt`` mask says so): SIGUSR1's default action would kill any other
process in the tree (a snapshot writer, a data loader worker).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any, Iterable

from agent.node.proctree import process_tree

_DUMPED = "(most recent call first)"


def catches(pid: int, sig: int = signal.SIGUSR1) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` (``/proc/PID/status``'s SigCgt)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except (OSError, ValueError):
        pass
    return False


def dump_stacks(nodes: Iterable[Any], wait_s: float = 3.0) -> None:
    """SIGUSR1 to every process of each live node's tree that catches it, then wait (at most
    ``wait_s``) for the dumps to reach the logs. A diagnostic on a failure path: never raises."""
    nodes = [n for n in nodes if n.process is not None and n.alive()]
    before = {n.name: _dumps(n) for n in nodes}
    for node in nodes:
        for pid in process_tree(node.pid):
            if catches(pid):
                try:
                    os.kill(pid, signal.SIGUSR1)
                except ProcessLookupError:
                    pass
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and any(_dumps(n) <= before[n.name] for n in nodes):
        time.sleep(0.1)  # a diagnostic for a failure already certain: no wait_until, which would raise


def stacks_and_tails(nodes: Iterable[Any], lines: int = 200) -> str:
    """Each node's log tail after :func:`dump_stacks`."""
    nodes = list(nodes)
    dump_stacks(nodes)
    return "\n".join(n.log_tail(lines) for n in nodes)


def _dumps(node: Any) -> int:
    try:
        return node.log_path.read_text(errors="replace").count(_DUMPED)
    except OSError:
        return 0
