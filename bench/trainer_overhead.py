"""What does ElasticRun cost per step, against a plain hand-written DDP loop?

Both loops train the same model on the same data at world size 2 (gloo, CPU), in the same
two processes (spawned, FileStore rendezvous, no etcd), interleaved repeat by repeat so
that background load hits both alike. ElasticRun runs as the runner would: a snapshot
every 50 steps through the background writer, the per-step RNG reseed, and an
``on_step_end`` hook. The metrics library is not built yet, so the hook is a stand-in of
the same shape (a lock and a few counter/histogram-like updates per step).

    python bench/trainer_overhead.py            # full run (~3-4 min on 2 cores)
    python bench/trainer_overhead.py --quick    # smoke run

Prints samples/s (median of the repeats) and the ratio ElasticRun / plain as the median of
the per-repeat ratios (each repeat runs both loops back to back, alternating which goes first).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from elastic.jobs.mlp import IN_FEATURES, SyntheticClassification, as_batch  # noqa: E402
from elastic.trainer import ElasticRun, StepInfo  # noqa: E402
from two_ranks import HIDDEN, WORLD, make_model, run_two_ranks  # noqa: E402


class MetricsStandIn:
    """Shaped like a prometheus-client hook: counters and a histogram bucket under a lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.steps = self.samples = 0
        self.step_seconds_sum = self.data_wait_sum = 0.0
        self.buckets = [0] * 12
        self.stamps: list[float] = []

    def __call__(self, info: StepInfo) -> None:
        with self.lock:
            self.steps += 1
            self.samples += info.samples
            self.step_seconds_sum += info.step_seconds
            self.data_wait_sum += info.data_wait_seconds
            self.buckets[min(11, max(0, int(info.step_seconds * 100)))] += 1
        self.stamps.append(time.perf_counter())


def plain_loop(dataset: SyntheticClassification, global_batch: int, steps: int) -> list[float]:
    """The loop a user would write by hand: DistributedSampler, DataLoader, DDP, AdamW."""
    model = DistributedDataParallel(make_model())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sampler = DistributedSampler(dataset, seed=0)
    loader = DataLoader(dataset, batch_size=global_batch // WORLD, sampler=sampler, collate_fn=as_batch)
    stamps: list[float] = []
    epoch = 0
    while len(stamps) < steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            stamps.append(time.perf_counter())
            if len(stamps) == steps:
                break
        epoch += 1
    return stamps


def elastic_loop(dataset: SyntheticClassification, global_batch: int, steps: int, snap_dir: str,
                 snapshot_every: int) -> list[float]:
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    hook = MetricsStandIn()
    run = ElasticRun(model, optimizer, dataset, global_batch_size=global_batch, steps=steps, snapshot_dir=snap_dir,
                     snapshot_every_steps=snapshot_every or None, on_step_end=hook, collate_fn=as_batch, handle_sigterm=False)
    for x, y in run:
        run.step(F.cross_entropy(run.model(x), y))
    return hook.stamps


def _rate(stamps: list[float], warmup: int, global_batch: int) -> float:
    timed = stamps[warmup:]
    return (len(timed) - 1) * global_batch / (timed[-1] - timed[0])


def worker(rank: int, args: argparse.Namespace, tmp: str) -> dict[str, list[float]]:
    dataset = SyntheticClassification(args.dataset_size, seed=0)
    results: dict[str, list[float]] = {"plain": [], "elastic": []}
    for repeat in range(args.repeats):
        order = ("plain", "elastic") if repeat % 2 == 0 else ("elastic", "plain")
        for which in order:
            dist.barrier()
            if which == "plain":
                stamps = plain_loop(dataset, args.global_batch_size, args.steps)
            else:
                snap = os.path.join(tmp, f"snap-{repeat}")  # shared by both ranks, fresh per repeat
                stamps = elastic_loop(dataset, args.global_batch_size, args.steps, snap, args.snapshot_every)
            results[which].append(_rate(stamps, args.warmup, args.global_batch_size))
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smoke run: few steps, 2 repeats")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--global-batch-size", type=int, default=256)
    p.add_argument("--dataset-size", type=int, default=8192)
    p.add_argument("--snapshot-every", type=int, default=50, help="ElasticRun snapshot interval in steps; 0: only the final one")
    args = p.parse_args()
    if args.quick:
        args.steps, args.warmup, args.repeats = 60, 10, 2
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        results = run_two_ranks(worker, args, tmp)
    plain, ours = statistics.median(results["plain"]), statistics.median(results["elastic"])
    # Paired: each repeat ran both loops back to back, so a burst of outside load hits a pair,
    # not one side; the median of the per-pair ratios is the headline figure.
    ratio = statistics.median(e / p for e, p in zip(results["elastic"], results["plain"]))
    print(f"trainer overhead: world {WORLD}, gloo on CPU, MLP {IN_FEATURES}-{HIDDEN}x3-4 + AdamW, "
          f"global batch {args.global_batch_size}, {args.steps - args.warmup} timed steps x {args.repeats} repeats")
    print(f"  plain DDP loop : {plain:9.1f} samples/s  (runs: {', '.join(f'{r:.0f}' for r in results['plain'])})")
    print(f"  ElasticRun     : {ours:9.1f} samples/s  (runs: {', '.join(f'{r:.0f}' for r in results['elastic'])}; "
          f"snapshot every {args.snapshot_every or 'never'} steps, metrics stand-in hook)")
    print(f"  ratio ElasticRun/plain (median of paired repeats): {ratio:.3f}  "
          f"({(1 - ratio) * 100:+.1f}% slower; goal <= 3%)")


if __name__ == "__main__":
    main()
