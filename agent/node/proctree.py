"""Signal a whole node: an agent and every worker it started.

torchrun starts each worker in a new session, so signalling the agent's process group
misses the workers, and once the agent dies they are re-parented and lost from its tree.
We therefore collect the tree first, freeze it (SIGSTOP) so nothing forks or reaps while
we act, then deliver the signal to every member.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from checkpoints.pids import pid_alive


def _children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # exited while we looked
        # The command name may contain spaces and parentheses; ppid follows the last ')'.
        fields = stat[stat.rindex(")") + 2:].split()
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    return children


def process_tree(root: int) -> list[int]:
    """``root`` and all its live descendants, parents before children."""
    children = _children_map()
    order, frontier = [], [root]
    while frontier:
        pid = frontier.pop(0)
        if not pid_alive(pid):
            continue
        order.append(pid)
        frontier.extend(children.get(pid, []))
    return order


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _self_last(pids: list[int]) -> list[int]:
    """An agent signalling its own tree must stop or kill itself after everything else."""
    me = os.getpid()
    return [p for p in pids if p != me] + ([me] if me in pids else [])


def kill_tree(root: int, sig: int = signal.SIGKILL) -> list[int]:
    """Deliver ``sig`` to the whole tree under ``root``; returns the pids signalled."""
    me = os.getpid()
    pids = process_tree(root)
    _signal_all([p for p in pids if p != me], signal.SIGSTOP)
    pids = _self_last(sorted(set(pids) | set(process_tree(root))))  # anything forked before the stop landed
    _signal_all(pids, sig)
    if sig not in (signal.SIGKILL, signal.SIGSTOP):
        _signal_all(pids, signal.SIGCONT)  # a stopped process cannot act on SIGTERM
    return pids


def freeze_tree(root: int) -> list[int]:
    """SIGSTOP the whole tree: a node that hangs without closing its sockets."""
    pids = _self_last(process_tree(root))
    _signal_all(pids, signal.SIGSTOP)
    return pids


def thaw_tree(pids: list[int]) -> None:
    """SIGCONT the pids a :func:`freeze_tree` returned."""
    _signal_all(pids, signal.SIGCONT)
