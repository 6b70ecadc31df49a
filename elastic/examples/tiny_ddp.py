"""The smallest honest elastic job: a gloo DDP loop that reports its progress.

Each completed step appends one JSON line to ``--progress`` (when given), so a test or the
demo can see, from outside, which world size trained which steps after a node was lost.
It keeps no snapshot; exact resume is the training loop's job, not this smoke test's. It
never imports ``elastic``: under ``elastic agent`` its progress reaches the hang watchdog
through the optimizer step hook every worker gets.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import signal
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=1_000_000)
    parser.add_argument("--step-time", type=float, default=0.05, help="seconds of pretend work per step")
    parser.add_argument("--progress", help="append one JSON line per completed step here")
    parser.add_argument("--collective-timeout", type=float, default=30.0)
    parser.add_argument("--hang-at-step", type=int, default=None,
                        help="tests: rank 0 hangs forever inside this step, once per --hang-marker file")
    parser.add_argument("--hang-marker", help="with --hang-at-step: hang only if this file does not exist yet")
    args = parser.parse_args()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the agent's hang watchdog dumps stacks

    dist.init_process_group("gloo", timeout=timedelta(seconds=args.collective_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    node = os.environ.get("ELASTIC_NODE_NAME", os.uname().nodename)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    round_number = int(os.environ.get("ELASTIC_ROUND", "-1"))

    for step in range(args.steps):
        x = torch.randn(16, 8)
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        if step == args.hang_at_step and rank == 0 and args.hang_marker and not os.path.exists(args.hang_marker):
            open(args.hang_marker, "w").close()
            while True:  # a real hang inside a step: the other ranks wait in the all-reduce below
                time.sleep(3600)
        loss.backward()
        optimizer.step()
        time.sleep(args.step_time)
        if args.progress and int(os.environ.get("LOCAL_RANK", "0")) == 0:
            record = {
                "node": node, "rank": rank, "world_size": world, "step": step,
                "restart": restart, "round": round_number, "time": time.time(), "loss": float(loss.detach()),
            }
            with open(args.progress, "a") as out:
                out.write(json.dumps(record) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
