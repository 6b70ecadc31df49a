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
import random
import socket
import sys
from typing import Sequence


# freeze_for, ThawError and THAW_MARK live with the command they carry out; imported from here too
from agent.node.commands import FREEZE, KILL, MAX_FREEZE_S, THAW_MARK, ThawError, freeze_for, send, valid_freeze  # noqa: F401
from agent.tools.etcd_args import NoLiveNode, add_etcd_arguments, connect, live_node
from agent.node.proc_identity import identify
from agent.node.proctree import kill_tree


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
    try:
        victim, nodes = live_node(etcd, None if args.random else args.node)
    except NoLiveNode as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.random:
        victim = random.choice(nodes)
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


