"""What do the worker metrics cost? samples/s of ElasticRun with metrics on against off.

Same job, same two processes (world 2, gloo on CPU, spawned, FileStore rendezvous, no etcd),
the two variants interleaved repeat by repeat so that background load hits both alike.
"Off" is ``ElasticRun(metrics=False)``: no recording and no comm hook. "On" is what a worker
under the agent does: multiprocess mode (``PROMETHEUS_MULTIPROC_DIR`` set, every update an
mmap write), the timing all-reduce comm hook, loss/step/data-wait/snapshot metrics. Both
snapshot every 50 steps through the background writer.

    python bench/metrics_overhead.py            # full run (~3 min on 2 idle cores)
    python bench/metrics_overhead.py --quick    # smoke run

Prints samples/s (median of the repeats) and the ratio on/off as the median of the per-repeat
ratios, beside the goal (<= 1 % slower).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from elastic.jobs.mlp import IN_FEATURES, SyntheticClassification, as_batch  # noqa: E402
from elastic.trainer import ElasticRun, StepInfo  # noqa: E402

WORLD = 2
HIDDEN = 1024
GOAL = 0.01


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(IN_FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
        nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 4),
    )


def run_once(dataset: SyntheticClassification, args: argparse.Namespace, snap_dir: str, metrics: bool) -> list[float]:
    stamps: list[float] = []

    def stamp(_info: StepInfo) -> None:
        stamps.append(time.perf_counter())

    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    run = ElasticRun(model, optimizer, dataset, global_batch_size=args.global_batch_size, steps=args.steps,
                     snapshot_dir=snap_dir, snapshot_every_steps=args.snapshot_every or None, on_step_end=stamp,
                     collate_fn=as_batch, handle_sigterm=False, metrics=metrics)
    for x, y in run:
        run.step(F.cross_entropy(run.model(x), y))
    return stamps


def _rate(stamps: list[float], warmup: int, global_batch: int) -> float:
    timed = stamps[warmup:]
    return (len(timed) - 1) * global_batch / (timed[-1] - timed[0])


def worker(rank: int, store_path: str, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)  # two processes on a two-core machine
    dist.init_process_group("gloo", store=dist.FileStore(store_path, WORLD), rank=rank, world_size=WORLD)
    dataset = SyntheticClassification(args.dataset_size, seed=0)
    results: dict[str, list[float]] = {"off": [], "on": []}
    for repeat in range(args.repeats):
        order = ("off", "on") if repeat % 2 == 0 else ("on", "off")
        for which in order:
            dist.barrier()
            snap = os.path.join(os.path.dirname(out), f"snap-{which}-{repeat}")  # shared by both ranks, fresh
            stamps = run_once(dataset, args, snap, metrics=which == "on")
            results[which].append(_rate(stamps, args.warmup, args.global_batch_size))
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smoke run: few steps, 2 repeats")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--global-batch-size", type=int, default=256)
    p.add_argument("--dataset-size", type=int, default=8192)
    p.add_argument("--snapshot-every", type=int, default=50, help="snapshot interval in steps; 0: only the final one")
    args = p.parse_args()
    if args.quick:
        args.steps, args.warmup, args.repeats = 60, 10, 2
    with tempfile.TemporaryDirectory(prefix="bench-metrics-") as tmp:
        prom = Path(tmp, "prom")
        prom.mkdir()
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(prom)  # inherited by the spawned workers, as under the agent
        out = os.path.join(tmp, "results.pt")
        mp.spawn(worker, args=(os.path.join(tmp, "store"), args, out), nprocs=WORLD, join=True)
        results = torch.load(out)
    off, on = statistics.median(results["off"]), statistics.median(results["on"])
    # Paired: each repeat ran both variants back to back, so a burst of outside load hits a
    # pair, not one side; the median of the per-pair ratios is the headline figure.
    ratios = [a / b for a, b in zip(results["on"], results["off"])]
    ratio = statistics.median(ratios)
    print(f"metrics overhead: world {WORLD}, gloo on CPU, MLP {IN_FEATURES}-{HIDDEN}x3-4 + AdamW, "
          f"global batch {args.global_batch_size}, {args.steps - args.warmup} timed steps x {args.repeats} repeats, "
          f"snapshot every {args.snapshot_every or 'never'} steps")
    print(f"  metrics off : {off:9.1f} samples/s  (runs: {', '.join(f'{r:.0f}' for r in results['off'])})")
    print(f"  metrics on  : {on:9.1f} samples/s  (runs: {', '.join(f'{r:.0f}' for r in results['on'])}; "
          "multiprocess mode + comm hook)")
    print(f"  paired ratios on/off: {', '.join(f'{r:.3f}' for r in ratios)}")
    print(f"  ratio on/off (median of paired repeats): {ratio:.3f}  "
          f"({(1 - ratio) * 100:+.1f}% slower; goal <= {GOAL * 100:.0f}%)")


if __name__ == "__main__":
    main()
