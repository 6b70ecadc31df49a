"""``elastic kill``: lose a node on purpose, to watch the job recover.

Nodes are found through the etcd registry. A node on this machine is killed directly,
its whole process tree at once (torchrun's workers live in their own sessions, so the
agent's process group alone would leave them running). A node elsewhere is asked,
through etcd, to do it to itself.
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import sys
from typing import Sequence

from elastic.rendezvous.registry import NodeRecord, list_nodes

from .commands import FREEZE, KILL, freeze_for, send
from .etcd_args import add_etcd_arguments, connect
from .proctree import kill_tree, process_tree


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="elastic kill", description=__doc__.splitlines()[0])
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("node", nargs="?", help="node name, as `elastic top` or the agent logs show it")
    target.add_argument("--random", action="store_true", help="pick a live node at random")
    parser.add_argument("--freeze", action="store_true",
                        help="SIGSTOP instead of SIGKILL: a node that hangs without closing its sockets")
    parser.add_argument("--seconds", type=float, default=10.0,
                        help="with --freeze: thaw (SIGCONT) after this many seconds (default 10)")
    parser.add_argument("--via-etcd", action="store_true",
                        help="always ask the node's agent through etcd, even for a node on this machine "
                             "(containers that share a host name)")
    add_etcd_arguments(parser)
    args = parser.parse_args(argv)
    etcd = connect(args)
    nodes = list_nodes(etcd.client, etcd.run_id, etcd.signer, etcd.key_prefix)
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
    if is_local(victim) and not args.via_etcd:
        if action == KILL:
            pids = kill_tree(victim.pid)
            print(f"killed node {victim.node}: SIGKILL to {len(pids)} processes (agent pid {victim.pid})")
        else:
            freeze_for(victim.pid, args.seconds)
            print(f"froze node {victim.node} (agent pid {victim.pid}) for {args.seconds:g} s")
    else:
        send(etcd.client, etcd.signer, etcd.key_prefix, etcd.run_id, victim.node, action, args.seconds)
        print(f"asked node {victim.node} on {victim.host} through etcd to {action} itself")
    return 0


def is_local(node: NodeRecord) -> bool:
    """Same host and a live process with that pid that is an agent (not a recycled pid)."""
    if node.host != socket.gethostname() or not process_tree(node.pid):
        return False
    try:
        with open(f"/proc/{node.pid}/cmdline", "rb") as f:
            cmdline = f.read().replace(b"\0", b" ")
    except OSError:
        return False
    return b"elastic" in cmdline or b"torchrun" in cmdline or node.pid == os.getpid()
