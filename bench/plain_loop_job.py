"""A user's plain DDP loop, made elastic by the prepare API's lines: ``chaos_soak.py --job plain``.

What a DDP tutorial writes: its own ``init_process_group`` and a set-up barrier, ``DDP(model)``,
a ``DataLoader`` with a ``DistributedSampler`` and ``set_epoch``, a per-epoch loop, a metric
``all_reduce`` of its own every few steps, a rank-0 print and ``torch.save`` at each epoch's
end. The lines marked ``# added`` and ``# was:`` are all it changes. The lines marked
``# soak`` are the bench's eyes: rank 0's progress line per committed step, read as the mlp
job's is (step, world, round, loss). The model is the mlp job's, so the soak's final check
loads the newest snapshot into the same ``make_model()``.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

import elastic  # added
from elastic.jobs.mlp import SyntheticClassification, make_model


class Samples(SyntheticClassification):
    """One (x, y) per index, as a map-style dataset of a tutorial gives them."""

    def __getitems__(self, ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:  # type: ignore[override]
        return [self[i] for i in ids]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--progress", required=True, help="rank 0's progress lines (the soak reads them)")
    p.add_argument("--snapshot-dir", required=True)
    p.add_argument("--ledger", required=True)
    p.add_argument("--save", required=True, help="where rank 0 saves the model at each epoch's end")
    p.add_argument("--epochs", type=int, default=100_000)
    p.add_argument("--dataset-size", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=8, help="per rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--snapshot-every-steps", type=int, default=10)
    p.add_argument("--step-sleep", type=float, default=0.05, help="pretend work per step")
    args = p.parse_args()

    dist.init_process_group("gloo")
    dist.barrier()  # the user's own set-up collective
    torch.manual_seed(args.seed)
    model = DDP(make_model())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    data = Samples(args.dataset_size, args.seed)
    sampler = DistributedSampler(data)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)
    ft = elastic.Elastic(snapshot_dir=args.snapshot_dir, seed=args.seed, snapshots=elastic.SnapshotConfig(  # added
        every_steps=args.snapshot_every_steps, ledger=args.ledger))
    model, optimizer, loader = ft.prepare(model, optimizer, loader)  # added
    progress = open(args.progress, "a")  # soak

    for epoch in ft.epochs(args.epochs):  # was: range(args.epochs)
        sampler.set_epoch(epoch)
        seen = torch.zeros(1)
        for x, y in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            seen += len(x)
            if ft.last_step and ft.is_main:  # soak: one line per committed step
                progress.write(json.dumps({
                    "node": os.environ.get("ELASTIC_NODE_NAME", "?"), "rank": ft.rank, "pid": os.getpid(),
                    "world_size": ft.world_size, "step": ft.step_count, "round": ft.run.round,
                    "time": time.time(), "loss": loss.item()}) + "\n")
                progress.flush()
            if ft.step_count % 16 == 0:  # the user's own metric, on the default group
                total = seen.clone()
                dist.all_reduce(total)
            time.sleep(args.step_sleep)
        if dist.get_rank() == 0:
            print(f"epoch {epoch}: loss {loss.item():.4f}", flush=True)
            torch.save(model.state_dict(), args.save)


if __name__ == "__main__":
    main()
