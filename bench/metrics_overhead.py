"""What do the worker metrics cost? samples/s of ElasticRun with metrics on against off.

Same job, same two processes (world 2, gloo on CPU, spawned, FileStore rendezvous, no etcd).
"Off" is ``ElasticRun(metrics=False)``: no recording and no comm hook. "On" is what a worker
under the agent does: multiprocess mode (``PROMETHEUS_MULTIPROC_DIR`` set, every update an
mmap write), the timing all-reduce comm hook, loss/step/data-wait/snapshot metrics. Both
snapshot every 50 steps through the background writer.

Pairing: ElasticRun is an iterator, so each repeat keeps one "on" and one "off" run alive
side by side in the same processes and alternates blocks of ``--block`` steps between them
(which one goes first alternates too). Outside load that comes and goes on a shared machine
then hits both alike, block by block; whole-run pairs were not enough here (wall-clock
throughput swung by tens of percent between runs).

    python bench/metrics_overhead.py            # full run (~2-3 min on 2 idle cores)
    python bench/metrics_overhead.py --quick    # smoke run

Prints samples/s per variant and the ratio on/off per repeat (sum of "on" block times over
sum of "off" block times), the median of those beside the goal (<= 1 % slower), and the
same for the main thread's CPU time per step (insensitive to waiting for the CPU).

The verdict comes from the adjacent block pairs: each pair's throughput ratio on/off,
their median over every pair of every repeat, and a distribution-free 95 % confidence
interval of that median (order statistics). The goal is *shown* only when the whole
interval lies above 0.99; on a noisy machine the interval says how far the data reach.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from elastic.jobs.mlp import IN_FEATURES, SyntheticClassification, as_batch  # noqa: E402
from elastic.run_config import DataConfig, SnapshotConfig  # noqa: E402
from elastic.trainer import ElasticRun  # noqa: E402
from two_ranks import HIDDEN, WORLD, make_model, pair_verdict, run_two_ranks  # noqa: E402

GOAL = 0.01


def make_run(dataset: SyntheticClassification, args: argparse.Namespace, snap_dir: str, metrics: bool) -> ElasticRun:
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return ElasticRun(model, optimizer, dataset, global_batch_size=args.global_batch_size, steps=args.steps,
                      snapshot_dir=snap_dir, snapshots=SnapshotConfig(every_steps=args.snapshot_every or None),
                      data=DataConfig(collate_fn=as_batch), handle_sigterm=False, metrics=metrics)


def block(run: ElasticRun, batches: Iterator[Any], n: int) -> tuple[float, float]:
    """n training steps of ``run``; (wall seconds, main-thread CPU seconds)."""
    t0, c0 = time.perf_counter(), time.thread_time()
    for _ in range(n):
        x, y = next(batches)
        run.step(F.cross_entropy(run.model(x), y))
    return time.perf_counter() - t0, time.thread_time() - c0


def worker(rank: int, args: argparse.Namespace, tmp: str) -> list[dict[str, list[tuple[float, float]]]]:
    dataset = SyntheticClassification(args.dataset_size, seed=0)
    results: list[dict[str, list[tuple[float, float]]]] = []
    for repeat in range(args.repeats):
        runs = {which: make_run(dataset, args, os.path.join(tmp, f"snap-{which}-{repeat}"), which == "on")
                for which in ("off", "on")}
        batches = {which: iter(run) for which, run in runs.items()}
        times: dict[str, list[tuple[float, float]]] = {"off": [], "on": []}
        for b in range(args.steps // args.block):
            order = ("off", "on") if (b + repeat) % 2 == 0 else ("on", "off")
            for which in order:
                dist.barrier()
                timed = block(runs[which], batches[which], args.block)
                if b * args.block >= args.warmup:
                    times[which].append(timed)
        for it in batches.values():
            for _ in it:  # drain: the final snapshot and close
                pass
        results.append(times)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smoke run: few steps, 2 repeats")
    p.add_argument("--steps", type=int, default=300, help="steps per run (one 'on' and one 'off' run per repeat)")
    p.add_argument("--block", type=int, default=10, help="steps per block; blocks alternate between on and off")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--global-batch-size", type=int, default=256)
    p.add_argument("--dataset-size", type=int, default=8192)
    p.add_argument("--no-collective-metrics", action="store_true",
                   help="'on' without the all-reduce timing hook (ELASTIC_COLLECTIVE_METRICS=0)")
    p.add_argument("--snapshot-every", type=int, default=50, help="snapshot interval in steps; 0: only the final one")
    args = p.parse_args()
    if args.quick:
        args.steps, args.warmup, args.repeats = 60, 10, 2
    if args.steps % args.block:
        p.error("--steps must be a multiple of --block")
    with tempfile.TemporaryDirectory(prefix="bench-metrics-") as tmp:
        prom = Path(tmp, "prom")
        prom.mkdir()
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(prom)  # inherited by the spawned workers, as under the agent
        if args.no_collective_metrics:
            os.environ["ELASTIC_COLLECTIVE_METRICS"] = "0"
        results = run_two_ranks(worker, args, tmp)

    def total(times: list[tuple[float, float]], i: int) -> float:
        return sum(t[i] for t in times)

    timed_steps = len(results[0]["off"]) * args.block
    rate = {w: [timed_steps * args.global_batch_size / total(r[w], 0) for r in results] for w in ("off", "on")}
    wall = [total(r["off"], 0) / total(r["on"], 0) for r in results]  # throughput on/off = time off/on
    cpu = [total(r["off"], 1) / total(r["on"], 1) for r in results]
    print(f"metrics overhead: world {WORLD}, gloo on CPU, MLP {IN_FEATURES}-{HIDDEN}x3-4 + AdamW, "
          f"global batch {args.global_batch_size}, snapshot every {args.snapshot_every or 'never'} steps; "
          f"{args.repeats} repeats x {timed_steps} timed steps per variant, in alternating blocks of {args.block}"
          + ("; 'on' without the all-reduce timing hook" if args.no_collective_metrics else ""))
    print(f"  metrics off : {statistics.median(rate['off']):9.1f} samples/s  "
          f"(repeats: {', '.join(f'{r:.0f}' for r in rate['off'])})")
    print(f"  metrics on  : {statistics.median(rate['on']):9.1f} samples/s  "
          f"(repeats: {', '.join(f'{r:.0f}' for r in rate['on'])}; multiprocess mode"
          f"{'' if args.no_collective_metrics else ' + comm hook'})")
    ratio, cpu_ratio = statistics.median(wall), statistics.median(cpu)
    pairs = sorted(off[0] / on[0] for r in results for off, on in zip(r["off"], r["on"]))
    cpu_pairs = sorted(off[1] / on[1] for r in results for off, on in zip(r["off"], r["on"]))
    print(f"  throughput on/off per repeat: {', '.join(f'{r:.4f}' for r in wall)}")
    print(f"  throughput ratio on/off (median): {ratio:.4f}  ({(1 - ratio) * 100:+.2f}% slower; "
          f"goal <= {GOAL * 100:.0f}%)")
    print(f"  main-thread CPU per step, off/on per repeat: {', '.join(f'{r:.4f}' for r in cpu)}; "
          f"median {cpu_ratio:.4f} ({(1 - cpu_ratio) * 100:+.2f}% more CPU per step with metrics)")
    for name, values in (("throughput on/off", pairs), ("main-thread CPU off/on", cpu_pairs)):
        print(f"  {name}, {pair_verdict(values, GOAL)}")


if __name__ == "__main__":
    main()
