"""What killed a worker that died by a signal: the OOM killer, or a signal from outside.

A worker the kernel's OOM killer ended exits by SIGKILL, exactly as one an operator or a
chaos tool killed: only the kernel's count of OOM kills tells them apart. The agent reads
the count when it starts and again when a worker died by SIGKILL; a count that rose
names the OOM killer. The count is its cgroup's under cgroup v2 (``memory.events``,
which counts the cgroups below it too), else the machine's (``/proc/vmstat``): v1's
``memory.oom_control`` counts its own cgroup only, and a worker in a cgroup of its own
would go unseen. With the machine's count another process's OOM kill at the same moment
could be taken for this worker's: the line says which count it read.
"""

from __future__ import annotations

import signal
from pathlib import Path

_CGROUP_ROOT = Path("/sys/fs/cgroup")


def parse_count(text: str, key: str = "oom_kill") -> int | None:
    """``key``'s value in a ``name value`` file (memory.events, memory.oom_control, vmstat)."""
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == key and parts[1].isdigit():
            return int(parts[1])
    return None


def _sources(proc_cgroup: str) -> list[tuple[str, Path]]:
    """Where this process's OOM kill count can be read, the narrowest first."""
    out = []
    for line in proc_cgroup.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and not controllers:  # v2: absent under v1 (its unified root has no memory.events)
            out.append(("cgroup", _CGROUP_ROOT / path.lstrip("/") / "memory.events"))
    out.append(("machine", Path("/proc/vmstat")))
    return out


def oom_kills() -> tuple[str, int] | None:
    """(whose count: ``cgroup`` or ``machine``, the count), or None where none can be read."""
    try:
        proc_cgroup = Path("/proc/self/cgroup").read_text()
    except OSError:
        proc_cgroup = ""
    for scope, path in _sources(proc_cgroup):
        try:
            count = parse_count(path.read_text())
        except OSError:
            continue
        if count is not None:
            return scope, count
    return None


def oom_killed(signum: int, before: tuple[str, int] | None, after: tuple[str, int] | None) -> bool:
    """A SIGKILL while the same scope's OOM kill count rose: the OOM killer's doing."""
    return signum == signal.SIGKILL and before is not None and after is not None and before[0] == after[0] \
        and after[1] > before[1]


def killed_by(signum: int, before: tuple[str, int] | None, after: tuple[str, int] | None) -> str:
    """One line for a worker killed by ``signum``: the OOM killer when the count rose meanwhile."""
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    if oom_killed(signum, before, after):
        assert before is not None and after is not None
        return (f"killed by the OOM killer (SIGKILL; the {after[0]}'s OOM kill count went from {before[1]} to "
                f"{after[1]}): give the job more memory or use less")
    return f"killed by {name}"
