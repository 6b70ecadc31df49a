"""``elastic check [NODE]``: have a running job check its replicas now, and say what it found.

The periodic replica check runs every ``check_every_steps``; this asks for one at the
job's next step, through one node's agent (a signed command in etcd, as ``elastic kill``
sends): every replica fingerprints its state and they vote (docs/reliability.md). The
command waits for the outcome and prints its one line: the replicas agree at step N, or
the mismatch (the node named, the tensors, the step, the rollback), which the job has
already acted on. Exit 0: they agree; 1: they did not (or the check is off); 3: no answer
within ``--timeout`` (the job ended, or is between worlds); 2: bad input.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from agent.node.commands import CHECK, check_result_key, send
from agent.tools.etcd_args import NoLiveNode, add_etcd_arguments, await_answer, connect, live_node, seconds


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="elastic check", description=__doc__.splitlines()[0])
    parser.add_argument("node", nargs="?", help="the node whose agent carries the request (default: the first "
                                                "live node; every replica is checked either way)")
    parser.add_argument("--timeout", type=seconds, default=120.0,
                        help="seconds to wait for the outcome (default 120: a step, and a rollback if one is due)")
    add_etcd_arguments(parser)
    args = parser.parse_args(argv)
    try:
        etcd = connect(args)
    except argparse.ArgumentTypeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        node = live_node(etcd, args.node or None)[0].node
    except NoLiveNode as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    result_key = check_result_key(etcd.key_prefix, etcd.run_id, node)
    issued_at = send(etcd.client, etcd.signer, etcd.key_prefix, etcd.run_id, node, CHECK)
    print(f"asked the job through node {node} to check its replicas at its next step", flush=True)
    result = await_answer(etcd, result_key, issued_at, args.timeout)
    if result is not None:
        print(str(result.get("line", "")))
        return 0 if result.get("agreed") is True else 1
    print(f"error: no outcome from node {node} within {args.timeout:g} s (the job may have ended, or is forming "
          "a new world; its periodic check goes on)", file=sys.stderr)
    return 3
