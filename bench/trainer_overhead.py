"""What does ElasticRun cost per step, against a plain hand-written DDP loop?

Both loops train the same model on the same data at world size 2 (gloo, CPU), in the same
two processes (spawned, FileStore rendezvous, no etcd), interleaved repeat by repeat so
that background load hits both alike. ElasticRun runs as the runner does under the agent:
a snapshot every 50 steps through the background writer (its writer process, at idle
priority), the per-step RNG reseed, and the worker metrics on (multiprocess mode, the
timing comm hook).

    python bench/trainer_overhead.py            # full run (~4-5 min on 2 cores)
    python bench/trainer_overhead.py --quick    # smoke run

Prints samples/s (median of the repeats) and the ratio ElasticRun / plain as the median of
the per-repeat ratios (each repeat runs both loops back to back, alternating which goes
first). Beside it, rank 0's CPU time per step for both loops and the writer process's CPU
time per step: CPU time hardly moves with outside load, so it shows where a gap comes from
even when the wall-clock figures swing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from elastic.jobs.mlp import IN_FEATURES, SyntheticClassification, as_batch  # noqa: E402
from elastic.trainer import ElasticRun  # noqa: E402
from two_ranks import HIDDEN, WORLD, make_model, run_two_ranks  # noqa: E402


Stamps = list[tuple[float, float]]  # (perf_counter, process_time) at the end of each step


def _stamp() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def plain_loop(dataset: SyntheticClassification, global_batch: int, steps: int) -> Stamps:
    """The loop a user would write by hand: DistributedSampler, DataLoader, DDP, AdamW."""
    model = DistributedDataParallel(make_model())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sampler = DistributedSampler(dataset, seed=0)
    loader = DataLoader(dataset, batch_size=global_batch // WORLD, sampler=sampler, collate_fn=as_batch)
    stamps: Stamps = []
    epoch = 0
    while len(stamps) < steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            stamps.append(_stamp())
            if len(stamps) == steps:
                break
        epoch += 1
    return stamps


def elastic_loop(dataset: SyntheticClassification, global_batch: int, steps: int, snap_dir: str,
                 snapshot_every: int) -> tuple[Stamps, dict[str, float]]:
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    stamps: Stamps = []
    run = ElasticRun(model, optimizer, dataset, global_batch_size=global_batch, steps=steps, snapshot_dir=snap_dir,
                     snapshot_every_steps=snapshot_every or None, on_step_end=lambda _info: stamps.append(_stamp()),
                     collate_fn=as_batch, handle_sigterm=False)
    for x, y in run:
        run.step(F.cross_entropy(run.model(x), y))
    writer: dict[str, float] = {}
    if run.writer is not None:
        st = run.writer.stats  # the final snapshot is included: it is written after the last stamp
        writer = {"written": st.snapshots_written, "skipped": st.snapshots_skipped, "boosted": st.boosted,
                  "cpu": st.total_write_cpu_s, "bytes": st.last_bytes}
    return stamps, writer


def _rate(stamps: Stamps, warmup: int, global_batch: int) -> float:
    timed = stamps[warmup:]
    return (len(timed) - 1) * global_batch / (timed[-1][0] - timed[0][0])


def _cpu_per_step(stamps: Stamps, warmup: int) -> float:
    timed = stamps[warmup:]
    return (timed[-1][1] - timed[0][1]) / (len(timed) - 1)


def worker(rank: int, args: argparse.Namespace, tmp: str) -> dict[str, list[Any]]:
    dataset = SyntheticClassification(args.dataset_size, seed=0)
    results: dict[str, list[Any]] = {"plain": [], "elastic": [], "plain_cpu": [], "elastic_cpu": [], "writer": []}
    for repeat in range(args.repeats):
        order = ("plain", "elastic") if repeat % 2 == 0 else ("elastic", "plain")
        for which in order:
            dist.barrier()
            if which == "plain":
                stamps = plain_loop(dataset, args.global_batch_size, args.steps)
            else:
                snap = os.path.join(tmp, f"snap-{repeat}")  # shared by both ranks, fresh per repeat
                stamps, writer = elastic_loop(dataset, args.global_batch_size, args.steps, snap, args.snapshot_every)
                results["writer"].append(writer)
            results[which].append(_rate(stamps, args.warmup, args.global_batch_size))
            results[f"{which}_cpu"].append(_cpu_per_step(stamps, args.warmup))
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smoke run: few steps, 2 repeats")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--global-batch-size", type=int, default=256)
    p.add_argument("--dataset-size", type=int, default=8192)
    p.add_argument("--snapshot-every", type=int, default=50, help="ElasticRun snapshot interval in steps; 0: only the final one")
    args = p.parse_args()
    if args.quick:
        args.steps, args.warmup, args.repeats = 60, 10, 2
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        prom = Path(tmp, "prom")
        prom.mkdir()
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(prom)  # inherited by the spawned workers, as under the agent
        load = os.getloadavg()[0]
        results = run_two_ranks(worker, args, tmp)
    plain, ours = statistics.median(results["plain"]), statistics.median(results["elastic"])
    # Paired: each repeat ran both loops back to back, so a burst of outside load hits a pair,
    # not one side; the median of the per-pair ratios is the headline figure.
    ratio = statistics.median(e / p for e, p in zip(results["elastic"], results["plain"]))
    w = results["writer"]
    snapshots = statistics.median(x["written"] for x in w)
    writer_cpu = statistics.median(x["cpu"] / args.steps for x in w)
    print(f"trainer overhead: world {WORLD}, gloo on CPU, MLP {IN_FEATURES}-{HIDDEN}x3-4 + AdamW, "
          f"global batch {args.global_batch_size}, {args.steps - args.warmup} timed steps x {args.repeats} repeats; "
          f"load average {load:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} cpus")
    print(f"  plain DDP loop : {plain:9.1f} samples/s  (runs: {', '.join(f'{r:.0f}' for r in results['plain'])})")
    print(f"  ElasticRun     : {ours:9.1f} samples/s  (runs: {', '.join(f'{r:.0f}' for r in results['elastic'])}; "
          f"snapshot every {args.snapshot_every or 'never'} steps, metrics on)")
    print(f"  ratio ElasticRun/plain (median of paired repeats): {ratio:.3f}  "
          f"({(1 - ratio) * 100:+.1f}% slower; goal <= 3%)")
    print(f"  rank 0 CPU per step: plain {statistics.median(results['plain_cpu']) * 1e3:.2f} ms, ElasticRun "
          f"{statistics.median(results['elastic_cpu']) * 1e3:.2f} ms; writer process {writer_cpu * 1e3:.2f} ms per step "
          f"({snapshots:.0f} snapshots of {w[0]['bytes'] / 1e6:.0f} MB per run incl. the final one; "
          f"skipped {sum(x['skipped'] for x in w)}, raised to normal priority {sum(x['boosted'] for x in w)} in all)")


if __name__ == "__main__":
    main()
