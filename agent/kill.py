"""``elastic kill``: lose a node on purpose, to watch the job recover.

Nodes are found through the etcd registry. A node on this machine is killed directly,
its whole process tree at once (torchrun's workers live in their own sessions, so the
agent's process group alone would leave them running), but only once the process is
verified to be that node's agent (:mod:`.proc_identity`). A node elsewhere, or one whose
pid is not verified here, is asked through etcd to do it to itself. A tool without the job
key that finds signed values refuses to act at all: it cannot tell a forged record from a
real one.

A freeze (SIGSTOP) is undone by a thaw helper (SIGCONT after ``--seconds``) that must not
be frozen with the tree: when an agent freezes its own tree on a command from etcd, a
helper that was its child would be stopped with it, and the node would stay frozen for
good. So the helper is double-forked (its parent exits at once, so it belongs to no tree
we freeze, and to a session of its own), its pid is left out of the frozen set all the
same, and nothing is frozen unless it started.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import socket
import subprocess
import sys
from typing import Sequence

from elastic.rendezvous.registry import list_nodes

from .commands import FREEZE, KILL, MAX_FREEZE_S, send, valid_freeze
from .etcd_args import add_etcd_arguments, connect
from .proc_identity import identify
from .proctree import kill_tree, process_tree

THAW_MARK = "elastic-thaw"  # in the helper's command line, for ps (and tests)

# The launcher forks the helper, prints its pid and exits; the helper, reparented away
# from the frozen tree, sleeps and then SIGCONTs every pid it was given.
_THAW_HELPER = """\
import os, signal, sys, time
seconds, pids = float(sys.argv[2]), [int(p) for p in sys.argv[3:]]
pid = os.fork()
if pid:
    print(pid, flush=True)
    os._exit(0)
os.setsid()
null = os.open(os.devnull, os.O_RDWR)
for fd in (0, 1, 2):
    os.dup2(null, fd)  # the launcher's reader waits for the pipe to close
time.sleep(seconds)
for p in pids:
    try:
        os.kill(p, signal.SIGCONT)
    except OSError:
        pass
os._exit(0)
"""


class ThawError(RuntimeError):
    """The thaw helper could not be started, so nothing was frozen."""


def freeze_for(root: int, seconds: float) -> list[int]:
    """SIGSTOP ``root``'s process tree for ``seconds``; returns the pids frozen.

    A detached helper SIGCONTs exactly those pids, also when ``root`` is this process
    (an agent acting on a command from etcd stops itself last). Raises :class:`ThawError`,
    having frozen nothing, if the helper did not start.
    """
    if not valid_freeze(seconds):
        raise ValueError(f"cannot freeze for {seconds!r} s: give seconds above 0 and at most {MAX_FREEZE_S:g}")
    pids = process_tree(root)
    if not pids:
        return []
    helper = _start_thaw_helper(pids, seconds)
    me = os.getpid()
    frozen = [p for p in pids if p not in (helper, me)] + ([me] if me in pids else [])
    for pid in frozen:
        try:
            os.kill(pid, signal.SIGSTOP)
        except ProcessLookupError:
            pass
    return frozen


def _start_thaw_helper(pids: list[int], seconds: float) -> int:
    """The pid of a running helper that will thaw ``pids`` in ``seconds``; its launcher is
    reaped here before this returns, so the helper is nobody's child in the frozen tree."""
    try:
        done = subprocess.run([sys.executable, "-c", _THAW_HELPER, THAW_MARK, repr(seconds), *map(str, pids)],
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              start_new_session=True, timeout=30, text=True)
        return int(done.stdout.strip())
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        raise ThawError(f"could not start the thaw helper ({exc}); nothing was frozen") from exc


def freeze_seconds(text: str) -> float:
    """``--seconds``, checked as it is parsed."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not valid_freeze(value):
        raise argparse.ArgumentTypeError(f"{text!r}: give seconds above 0 and at most {MAX_FREEZE_S:g}")
    return value


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="elastic kill", description=__doc__.splitlines()[0])
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("node", nargs="?", help="node name, as `elastic top` or the agent logs show it")
    target.add_argument("--random", action="store_true", help="pick a live node at random")
    parser.add_argument("--freeze", action="store_true",
                        help="SIGSTOP instead of SIGKILL: a node that hangs without closing its sockets")
    parser.add_argument("--seconds", type=freeze_seconds, default=10.0,
                        help="with --freeze: thaw (SIGCONT) after this many seconds (default 10)")
    parser.add_argument("--via-etcd", action="store_true",
                        help="always ask the node's agent through etcd, even for a node on this machine "
                             "(containers that share a host name)")
    add_etcd_arguments(parser)
    args = parser.parse_args(argv)
    try:
        etcd = connect(args)
    except argparse.ArgumentTypeError as exc:  # --rdzv-conf that is not key=value,...
        print(f"error: {exc}", file=sys.stderr)
        return 2
    nodes = list_nodes(etcd.client, etcd.run_id, etcd.signer, etcd.key_prefix, strict=True)
    if not nodes:
        print(f"error: no live nodes in run {etcd.run_id!r} at {args.rdzv_endpoint}; "
              "check --rdzv-id and --rdzv-endpoint", file=sys.stderr)
        return 2
    if args.random:
        victim = random.choice(nodes)
    else:
        found = [n for n in nodes if n.node == args.node]
        if not found:
            print(f"error: no live node {args.node!r} in run {etcd.run_id!r}; live: "
                  f"{', '.join(n.node for n in nodes)}", file=sys.stderr)
            return 2
        victim = found[0]
    action = FREEZE if args.freeze else KILL
    why = "--via-etcd" if args.via_etcd else identify(victim, etcd.run_id)
    if why is not None and not args.via_etcd and victim.host == socket.gethostname():
        print(f"not signalling pid {victim.pid} here: {why}; asking node {victim.node}'s agent through etcd instead",
              file=sys.stderr)
    if why is None:
        if action == KILL:
            pids = kill_tree(victim.pid)
            print(f"killed node {victim.node}: SIGKILL to {len(pids)} processes (agent pid {victim.pid})")
        else:
            try:
                freeze_for(victim.pid, args.seconds)
            except ThawError as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 1
            print(f"froze node {victim.node} (agent pid {victim.pid}) for {args.seconds:g} s")
    else:
        send(etcd.client, etcd.signer, etcd.key_prefix, etcd.run_id, victim.node, action, args.seconds)
        print(f"asked node {victim.node} on {victim.host} through etcd to {action} itself")
    return 0


