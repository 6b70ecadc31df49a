"""Is the process a registry record names really that node's agent? Checked before any signal.

A registry record's ``pid`` is only a claim: a record forged (in an unsigned job) or left
behind can name any process on the host, and a pid is recycled once its process exits. So
a tool signals a pid only when three things agree: the record (verified, held by a live
lease: the caller's part) names this host; the process's command line is an agent's of this
run (an ``elastic``/``torchrun`` agent whose arguments name the run id); and the process
started before the record was made (the agent writes it after it starts; a recycled pid
starts later), not long before.

:func:`judge` is pure (millisecond tests); :func:`identify` reads ``/proc``.
"""

from __future__ import annotations

import os
import shlex
import socket
from pathlib import Path
from typing import Sequence

from agent.rendezvous.registry import NodeRecord

CLOCK_SLACK_S = 2.0  # /proc's start time is in clock ticks from a boot time in whole seconds
MAX_START_TO_RECORD_S = 900.0  # an agent writes its record within this of starting (a loaded host)
_AGENT_WORDS = ("elastic", "torchrun", "agent")


def judge(cmdline: Sequence[str], started: float | None, record: NodeRecord, run_id: str, host: str) -> str | None:
    """Why the process is not ``record``'s agent, or None if every check agrees.

    ``cmdline``: its arguments; ``started``: its start, in seconds since the epoch (None if
    unknown); ``host``: this host's name."""
    if record.host != host:
        return f"the record names host {record.host!r}, not this one"
    if not cmdline:
        return f"no process {record.pid} (or one without a command line)"
    if not any(word in arg for arg in cmdline for word in _AGENT_WORDS):
        return f"process {record.pid} ({_short(cmdline)}) is not an elastic or torchrun agent"
    if not any(arg == run_id or arg.endswith(f"={run_id}") for arg in cmdline):
        return f"process {record.pid} ({_short(cmdline)}) is not an agent of run {run_id!r}"
    if started is None:
        return f"the start time of process {record.pid} cannot be read"
    if started > record.started_at + CLOCK_SLACK_S:
        return (f"process {record.pid} started after the record was written (a pid reused since): "
                f"not that agent")
    if started < record.started_at - MAX_START_TO_RECORD_S:
        return f"process {record.pid} started {record.started_at - started:.0f} s before the record: not that agent"
    return None


def _short(cmdline: Sequence[str]) -> str:
    text = " ".join(cmdline)
    return text if len(text) <= 80 else text[:77] + "..."


def identify(record: NodeRecord, run_id: str) -> str | None:
    """:func:`judge` on the live process ``record.pid`` of this host."""
    return judge(_cmdline(record.pid), _started(record.pid), record, run_id, socket.gethostname())


def _cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    parts = [part.decode(errors="replace") for part in raw.split(b"\0") if part]
    if len(parts) == 1 and " " in parts[0]:  # a title set by setproctitle (a forked agent): one string
        try:
            return shlex.split(parts[0])
        except ValueError:
            return parts[0].split()
    return parts


def _started(pid: int) -> float | None:
    """The process's start, since the epoch (``/proc/PID/stat`` field 22 after boot)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        ticks = int(stat[stat.rindex(")") + 2:].split()[19])
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return boot + ticks / os.sysconf("SC_CLK_TCK")
