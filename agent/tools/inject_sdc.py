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
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence


from agent.node.commands import MAX_WHAT, SDC, send
from agent.tools.etcd_args import NoLiveNode, add_etcd_arguments, connect, live_node


def _tensor(text: str) -> str:
    if not 0 < len(text) <= MAX_WHAT:
        raise argparse.ArgumentTypeError(f"give a tensor name of 1 to {MAX_WHAT} characters")
    return text


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="elastic inject-sdc", description=__doc__.splitlines()[0])
    parser.add_argument("node", help="node name, as `elastic top` or the agent logs show it")
    parser.add_argument("--tensor", type=_tensor, default="first",
                        help="a parameter (0.weight) or its optimizer state (0.weight.exp_avg_sq); "
                             "default: the first parameter")
    kind = parser.add_mutually_exclusive_group()
    kind.add_argument("--nan", dest="kind", action="store_const", const="nan", default="bit",
                      help="write a NaN into the tensor's first element instead of flipping a bit")
    kind.add_argument("--inf", dest="kind", action="store_const", const="inf",
                      help="write an Inf into the tensor's first element instead of flipping a bit")
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
    send(etcd.client, etcd.signer, etcd.key_prefix, etcd.run_id, args.node, SDC, what=args.tensor, kind=args.kind)
    done = "flip a bit of" if args.kind == "bit" else f"write a {'NaN' if args.kind == 'nan' else 'Inf'} into"
    print(f"asked node {args.node} through etcd to {done} {args.tensor} in its local rank 0")
    return 0
