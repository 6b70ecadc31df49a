"""What the in-process trainer benchmarks share: their model and their world of two ranks.

Both overhead benchmarks (``trainer_overhead.py``, ``metrics_overhead.py``) compare two
loops in the same two spawned processes (gloo on a FileStore, no etcd) on the same MLP,
so the spawning, the process group and the model live here once.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from elastic.jobs.mlp import IN_FEATURES  # noqa: E402

WORLD = 2
HIDDEN = 1024

Worker = Callable[[int, argparse.Namespace, str], Any]


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(IN_FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
        nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 4),
    )


def run_two_ranks(worker: Worker, args: argparse.Namespace, tmp: str) -> Any:
    """Run ``worker(rank, args, tmp)`` on both ranks; returns what rank 0's returned."""
    mp.spawn(_rank_main, args=(worker, args, tmp), nprocs=WORLD, join=True)
    return torch.load(os.path.join(tmp, "results.pt"))


def _rank_main(rank: int, worker: Worker, args: argparse.Namespace, tmp: str) -> None:
    torch.set_num_threads(1)  # two processes on a two-core machine
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), WORLD), rank=rank,
                            world_size=WORLD)
    results = worker(rank, args, tmp)
    if rank == 0:
        torch.save(results, os.path.join(tmp, "results.pt"))
    dist.destroy_process_group()
