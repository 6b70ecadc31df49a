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
import json
import sys
import time
from typing import Sequence

from agent.rendezvous.signing import SignatureError, StateSigner

from agent.node.commands import CHECK, check_result_key, send
from agent.tools.etcd_args import NoLiveNode, add_etcd_arguments, connect, live_node

POLL_S = 0.2


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 3600:
        raise argparse.ArgumentTypeError(f"give seconds above 0 and at most 3600, not {text!r}")
    return value


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="elastic check", description=__doc__.splitlines()[0])
    parser.add_argument("node", nargs="?", help="the node whose agent carries the request (default: the first "
                                                "live node; every replica is checked either way)")
    parser.add_argument("--timeout", type=_seconds, default=120.0,
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
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        value, _meta = etcd.client.call(lambda c: c.get(result_key))
        result = _open(etcd.signer, result_key, value)
        if result is not None and result.get("id") == issued_at:
            print(str(result.get("line", "")))
            return 0 if result.get("agreed") is True else 1
        time.sleep(POLL_S)
    print(f"error: no outcome from node {node} within {args.timeout:g} s (the job may have ended, or is forming "
          "a new world; its periodic check goes on)", file=sys.stderr)
    return 3


def _open(signer: StateSigner, key: str, value: bytes | None) -> dict[str, object] | None:
    if value is None:
        return None
    try:
        data = json.loads(signer.open(key.encode(), value))
    except (SignatureError, ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None
