"""What the in-process trainer benchmarks share: their model, their world of two ranks, their verdict.

Both overhead benchmarks (``trainer_overhead.py``, ``metrics_overhead.py``) compare two
loops in the same two spawned processes (gloo on a FileStore, no etcd) on the same MLP,
alternating blocks of steps, so the spawning, the process group, the model and the
verdict from the block pairs live here once.
"""

from __future__ import annotations

import argparse
import os
import statistics
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


def steady_allocator() -> str:
    """Fix glibc's mmap threshold for the ranks about to be spawned; returns a line saying so.

    glibc raises its mmap threshold as mmapped chunks are freed, so whether a loop's 4 MB
    gradients and optimizer temporaries come from the heap or from fresh mmaps (about 900
    page faults a step) depends on the order of earlier frees: on one run it hit one loop,
    on another the other, and on a Firecracker VM, where a fault is dear, it made the plain
    loop 4x slower than the same loop wrapped. A fixed threshold (the variables glibc reads
    at start) takes the allocator out of a comparison of two loops' code.
    """
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(32 << 20))
    os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", str(1 << 30))
    return (f"glibc malloc: mmap threshold {os.environ['MALLOC_MMAP_THRESHOLD_']}, "
            f"trim threshold {os.environ['MALLOC_TRIM_THRESHOLD_']} bytes (fixed for both loops)")


def run_two_ranks(worker: Worker, args: argparse.Namespace, tmp: str) -> Any:
    """Run ``worker(rank, args, tmp)`` on both ranks; returns what rank 0's returned."""
    mp.spawn(_rank_main, args=(worker, args, tmp), nprocs=WORLD, join=True)
    return torch.load(os.path.join(tmp, "results.pt"))


def median_interval(ordered: list[float]) -> tuple[float, float, float]:
    """Median and a distribution-free 95 % confidence interval for it, from sorted values:
    the order statistics n/2 -+ 0.98 sqrt(n) (normal approximation to the binomial)."""
    n = len(ordered)
    half_width = 0.98 * n ** 0.5
    low = max(0, int(n / 2 - half_width))
    high = min(n - 1, int(-(-(n / 2 + half_width) // 1)))
    return statistics.median(ordered), ordered[low], ordered[high]


def pair_verdict(ordered: list[float], goal: float) -> str:
    """One line on sorted block-pair ratios (1.0: no cost): their median, its 95 % interval, and
    whether the whole interval clears ``1 - goal`` ("goal shown"), misses it, or straddles it."""
    mid, low, high = median_interval(ordered)
    verdict = "goal shown" if low >= 1 - goal else ("goal missed" if high < 1 - goal else "not decided")
    return (f"{len(ordered)} adjacent block pairs: median {mid:.4f}, 95% CI [{low:.4f}, {high:.4f}] -> {verdict} "
            f"(goal: ratio >= {1 - goal:.2f})")


def _rank_main(rank: int, worker: Worker, args: argparse.Namespace, tmp: str) -> None:
    torch.set_num_threads(1)  # two processes on a two-core machine
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), WORLD), rank=rank,
                            world_size=WORLD)
    results = worker(rank, args, tmp)
    if rank == 0:
        torch.save(results, os.path.join(tmp, "results.pt"))
    dist.destroy_process_group()
