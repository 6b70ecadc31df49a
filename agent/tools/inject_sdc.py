"""``elastic inject-sdc NODE``: flip one bit of one tensor of a node's live worker.

Silent data corruption to rehearse with, as ``elastic kill`` rehearses node loss: the
node's agent gets a signed command through etcd and its local rank 0 flips bit 22 of the
first element of the tensor named (``--tensor``: a parameter such as ``0.weight``, or its
optimizer state such as ``0.weight.exp_avg_sq``; default the first parameter) at its next
step boundary. The replica check (``ElasticRun``'s ``check_every_steps``) then names the
node and every replica goes back to the last agreed state (docs/reliability.md). ``--nan``
or ``--inf`` writes a non-finite value instead: the check names that node as the outlier
if it runs before the next gradient all-reduce spreads it (else every replica holds it,
which the check reports as a diverged training).

The command waits for the worker's answer (its agent puts it in etcd, as for ``elastic
check``) and prints it: the tensor changed, by its own name, and the step. Exit 0: done;
2: bad input, a tensor the model does not have (the line names those it has) or a node
with no workers; 3: no answer within ``--timeout`` (the job ended, is between worlds, or
its workers do not run ``ElasticRun`` or the prepare API).
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from agent.node.commands import MAX_WHAT, SDC, sdc_result_key, send
from agent.tools.etcd_args import NoLiveNode, add_etcd_arguments, await_answer, connect, live_node, seconds

FIRST = "first"  # the worker's name for its first parameter (elastic.consistency.inject.FIRST; no torch here)


def _tensor(text: str) -> str:
    if not 0 < len(text) <= MAX_WHAT:
        raise argparse.ArgumentTypeError(f"give a tensor name of 1 to {MAX_WHAT} characters")
    return text


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="elastic inject-sdc", description=__doc__.splitlines()[0])
    parser.add_argument("node", help="node name, as `elastic top` or the agent logs show it")
    parser.add_argument("--tensor", type=_tensor, default=FIRST,
                        help="a parameter (0.weight) or its optimizer state (0.weight.exp_avg_sq); "
                             "default: the first parameter (the answer names it)")
    kind = parser.add_mutually_exclusive_group()
    kind.add_argument("--nan", dest="kind", action="store_const", const="nan", default="bit",
                      help="write a NaN into the tensor's first element instead of flipping a bit")
    kind.add_argument("--inf", dest="kind", action="store_const", const="inf",
                      help="write an Inf into the tensor's first element instead of flipping a bit")
    parser.add_argument("--timeout", type=seconds, default=60.0,
                        help="seconds to wait for the worker's answer (default 60: its next step boundary)")
    add_etcd_arguments(parser)
    args = parser.parse_args(argv)
    try:
        etcd = connect(args)
    except argparse.ArgumentTypeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        live_node(etcd, args.node)
    except NoLiveNode as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    result_key = sdc_result_key(etcd.key_prefix, etcd.run_id, args.node)
    issued_at = send(etcd.client, etcd.signer, etcd.key_prefix, etcd.run_id, args.node, SDC, what=args.tensor,
                     kind=args.kind)
    done = "flip a bit of" if args.kind == "bit" else f"write a {'NaN' if args.kind == 'nan' else 'Inf'} into"
    what = "its first parameter" if args.tensor == FIRST else args.tensor
    print(f"asked node {args.node} through etcd to {done} {what} in its local rank 0", flush=True)
    result = await_answer(etcd, result_key, issued_at, args.timeout)
    if result is None:
        print(f"error: no answer from node {args.node} within {args.timeout:g} s (the job may have ended, be forming "
              "a new world, or its workers do not run ElasticRun or the prepare API); its log says whether the "
              "worker took the request", file=sys.stderr)
        return 3
    if result.get("done") is not True:
        print(f"error: {result.get('line', 'the worker did not carry it out')}", file=sys.stderr)
        return 2  # the same request would fail again
    print(str(result.get("line", "")))
    return 0
