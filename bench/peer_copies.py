"""Peer copies (issue 52): what they cost a plain FSDP2 loop, and how fast they move bytes.

Four gloo processes on this machine (loopback), as 2 nodes x 2 local ranks: an FSDP2 model
sharded over a 1-D mesh across all four (no replica: the layout the copies are for), AdamW.
Trials interleave, each ``--steps`` steps, ``--repeats`` times:

* **plain**: the FSDP2 loop alone (forward, backward, AdamW step);
* **K=k** for each ``--every``: the same loop, and after every k-th step each rank's state
  (its shards, their AdamW moments, step and RNG) copied to host memory and exchanged with
  its buddy on the other node (:class:`elastic.inplace.peer_copies.PeerCopies`, as the run
  does it);
* **raw**: in the same processes, each rank sends exactly as many bytes as its copy to its
  buddy and receives as many from the rank it keeps, as one flat tensor each way over
  ``dist.isend``/``dist.irecv`` (the fastest gloo moves those bytes here).

It prints the median step time of each, the per-step cost of each ``K`` against plain (the
goal: within 5 % at the default ``K``), the ``K`` the measured copy time needs to meet it,
and the copy's bandwidth against raw (the goal: at least 60 %).

    .venv/bin/python bench/peer_copies.py --width 1024 --layers 4 --steps 20 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

WORLD, LOCAL = 4, 2
GOAL_COST, GOAL_BANDWIDTH = 0.05, 0.60


def _worker(rank: int, store_path: str, args: argparse.Namespace, results: str) -> None:
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from checkpoints import capture_rng_state
    from elastic.inplace.buddies import held_by, ring
    from elastic.inplace.hsdp import capture_local
    from elastic.inplace.peer_copies import PeerCopies

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, WORLD), rank=rank, world_size=WORLD)
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("shard",))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(args.width, args.width), nn.ReLU()) for _ in range(args.layers)])
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(args.batch, args.width)
    node = f"n{rank // LOCAL}"
    step = 0

    def train() -> None:
        nonlocal step
        optimizer.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        optimizer.step()
        step += 1

    def capture() -> dict[str, object]:
        model_state, optimizer_state = capture_local(model, optimizer)
        return {"state": {"model": model_state, "optimizer": optimizer_state, "progress": {"step": step},
                          "rng": capture_rng_state()}, "recent": []}

    for _ in range(3):  # warm up: allocations, AdamW's state, gloo's pairs
        train()
    copies: dict[int, PeerCopies] = {k: PeerCopies(k) for k in args.every}
    buddy = ring([[0, 1], [2, 3]])[rank]
    keeps = held_by(ring([[0, 1], [2, 3]]))[rank]
    times: dict[str, list[float]] = {}
    copy_s: list[float] = []
    copy_bytes = 0
    raw_s: list[float] = []
    for _ in range(args.repeats):
        for config in ["plain", *[f"K={k}" for k in args.every]]:
            k = int(config[2:]) if config != "plain" else 0
            dist.barrier()
            started = time.perf_counter()
            for _ in range(args.steps):
                train()
                if k:
                    copies[k].after_step(step, rank, WORLD, node, LOCAL, capture, torch.device("cpu"))
                    if copies[k].due(step):
                        copy_s.append(copies[k].last_seconds)
                        copy_bytes = copies[k].last_bytes
            dist.barrier()
            times.setdefault(config, []).append((time.perf_counter() - started) / args.steps)
        # the anchor: the same bytes each way, one flat tensor, raw isend/irecv
        mine = copy_bytes // 2  # what this rank sent (it received as many: equal shards)
        out, into = torch.ones(mine, dtype=torch.uint8), torch.empty(mine, dtype=torch.uint8)
        dist.barrier()
        started = time.perf_counter()
        works = [dist.irecv(into, keeps[0]), dist.isend(out, buddy)]
        for work in works:
            work.wait()
        raw_s.append(time.perf_counter() - started)
    row = {"rank": rank, "times": times, "copy_s": copy_s, "copy_bytes": copy_bytes, "raw_s": raw_s,
           "held": copies[args.every[0]].held_bytes()}
    with open(f"{results}/{rank}.json", "w") as f:
        json.dump(row, f)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--every", type=int, nargs="+", default=[1, 2, 4, 8])
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(os.path.join(tmp, "store"), args, tmp), nprocs=WORLD, join=True)
        rows = [json.loads(Path(tmp, f"{r}.json").read_text()) for r in range(WORLD)]
    # a step ends when the slowest rank's does: the max over ranks of each trial, then the median
    configs = list(rows[0]["times"])
    step = {c: statistics.median(max(r["times"][c][i] for r in rows) for i in range(args.repeats)) for c in configs}
    copy_s = statistics.median(max(r["copy_s"][i] for r in rows) for i in range(len(rows[0]["copy_s"])))
    raw_s = statistics.median(max(r["raw_s"][i] for r in rows) for i in range(args.repeats))
    nbytes = rows[0]["copy_bytes"]
    params = args.layers * (args.width * args.width + args.width)
    print(f"model: {args.layers} x Linear({args.width}, {args.width}), {params / 1e6:.1f} M parameters; AdamW; "
          f"FSDP2 over 1-D mesh of {WORLD} ranks (2 nodes x 2)")
    print(f"per rank: copy of {nbytes / 2 / 1e6:.1f} MB sent, as many received; host memory held "
          f"{rows[0]['held'] / 1e6:.1f} MB (own + buddy)")
    print(f"plain FSDP2 step: {step['plain'] * 1e3:.1f} ms")
    for c in configs[1:]:
        cost = step[c] / step["plain"] - 1
        print(f"{c}: {step[c] * 1e3:.1f} ms a step, {cost * 100:+.1f} % vs plain (goal <= {GOAL_COST * 100:.0f} %)")
    from elastic.inplace.buddies import every_k

    print(f"one copy (host copy + exchange): {copy_s * 1e3:.1f} ms -> K within the goal: "
          f"{every_k(copy_s, step['plain'], GOAL_COST)}")
    ours, raw = nbytes / 2 / copy_s, nbytes / 2 / raw_s
    print(f"bandwidth: copy {ours / 1e6:.0f} MB/s (host copy included), raw isend/irecv {raw / 1e6:.0f} MB/s: "
          f"{ours / raw * 100:.0f} % of raw (goal >= {GOAL_BANDWIDTH * 100:.0f} %)")


if __name__ == "__main__":
    main()
