"""What do ElasticRun and the prepare API cost per step, against a plain hand-written DDP loop?

Three loops train the same model on the same data at world size 2 (gloo, CPU), in the same
two processes (spawned, FileStore rendezvous, no etcd): the plain loop, ``ElasticRun``, and
the same plain loop wrapped by ``elastic.Elastic`` (its added lines only: the issue's goal
for it is <= 2 % step time). ElasticRun runs as the runner does
under the agent: a snapshot every 50 steps through the background writer, the per-step
RNG reseed, and the worker metrics on (multiprocess mode, the timing comm hook).

Steady state, paired: each repeat keeps the three loops alive side by side in the same
processes and alternates blocks of ``--block`` steps between them (which goes first
rotates too), so outside load that comes and goes hits them alike. The
ElasticRun is built, its writer started and its first snapshot written before the clock
starts: a restart's start-up cost is the recovery benchmark's business, not this one.
glibc's mmap threshold is fixed for both loops (``two_ranks.steady_allocator``): left
dynamic, it gave one loop or the other ~900 page faults a step by chance of the order of
earlier frees, which swung the ratio by several percent from run to run.

    python bench/trainer_overhead.py                      # full run (~6 min on 2 idle cores)
    python bench/trainer_overhead.py --writer thread      # the writer thread instead of the process
    python bench/trainer_overhead.py --quick              # smoke run

Prints samples/s per loop, the ratio ElasticRun / plain per repeat and its median beside
the goal (<= 3 % slower), the same for the prepared loop (goal <= 2 %), and the verdict from the adjacent block pairs (median and a
distribution-free 95 % CI). Beside them, rank 0's CPU per step for both loops and the
writer's CPU per snapshot: CPU time hardly moves with outside load, so it shows where a
gap comes from even when the wall-clock figures swing.
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
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from elastic.jobs.mlp import IN_FEATURES, SyntheticClassification, as_batch  # noqa: E402
from elastic.run_config import DataConfig, SnapshotConfig  # noqa: E402
from elastic.trainer import ElasticRun  # noqa: E402
from two_ranks import HIDDEN, WORLD, make_model, pair_verdict, run_two_ranks, steady_allocator  # noqa: E402

GOAL = 0.03
PREPARED_GOAL = 0.02  # issue 27: the wrapped plain loop against the same loop unwrapped
LOOPS = ("plain", "elastic", "prepared")


def plain_steps(dataset: SyntheticClassification, global_batch: int) -> Iterator[None]:
    """The loop a user would write by hand (DistributedSampler, DataLoader, DDP, AdamW), one step per next()."""
    model = DistributedDataParallel(make_model())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sampler = DistributedSampler(dataset, seed=0)
    loader = DataLoader(dataset, batch_size=global_batch // WORLD, sampler=sampler, collate_fn=as_batch)
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            yield
        epoch += 1


def prepared_steps(dataset: SyntheticClassification, global_batch: int, snapshot_dir: str,
                   args: argparse.Namespace) -> Iterator[None]:
    """``plain_steps`` with the prepare API's lines added (as docs/training.md shows them)."""
    import elastic

    model = DistributedDataParallel(make_model())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sampler = DistributedSampler(dataset, seed=0)
    loader = DataLoader(dataset, batch_size=global_batch // WORLD, sampler=sampler, collate_fn=as_batch)
    ft = elastic.Elastic(snapshot_dir=snapshot_dir, handle_sigterm=False, snapshots=elastic.SnapshotConfig(  # added
        every_steps=args.snapshot_every or None, writer=args.writer))
    model, optimizer, loader = ft.prepare(model, optimizer, loader)                                  # added
    for epoch in ft.epochs(10**6):                                                                   # changed
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            yield


def elastic_steps(run: ElasticRun) -> Iterator[None]:
    for x, y in run:
        run.step(F.cross_entropy(run.model(x), y))
        yield


def block(steps: Iterator[None], n: int) -> tuple[float, float]:
    """n steps; (wall seconds, process CPU seconds: the writer thread's included)."""
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(n):
        next(steps)
    return time.perf_counter() - t0, time.process_time() - c0


def worker(rank: int, args: argparse.Namespace, tmp: str) -> list[dict[str, Any]]:
    dataset = SyntheticClassification(args.dataset_size, seed=0)
    results: list[dict[str, Any]] = []
    for repeat in range(args.repeats):
        model = make_model()
        run = ElasticRun(model, torch.optim.AdamW(model.parameters(), lr=1e-3), dataset, device="cpu",
                         global_batch_size=args.global_batch_size, steps=10**9,
                         snapshot_dir=os.path.join(tmp, f"snap-{repeat}"),
                         snapshots=SnapshotConfig(every_steps=args.snapshot_every or None, writer=args.writer),
                         data=DataConfig(collate_fn=as_batch), handle_sigterm=False)
        loops = {"plain": plain_steps(dataset, args.global_batch_size), "elastic": elastic_steps(run),
                 "prepared": prepared_steps(dataset, args.global_batch_size, os.path.join(tmp, f"prep-{repeat}"),
                                            args)}
        block(loops["plain"], args.warmup)
        # steady state: the writer is up and its first snapshot (which allocates the staging
        # buffers) is durable before the clock starts
        block(loops["elastic"], max(args.warmup, (args.snapshot_every or 0) + 1))
        block(loops["prepared"], max(args.warmup, (args.snapshot_every or 0) + 1))
        if run.writer is not None:
            run.writer.wait_writer_process()
            run.writer.flush()
        written0 = run.writer.stats.snapshots_written if run.writer is not None else 0
        cpu0 = run.writer.stats.total_write_cpu_s if run.writer is not None else 0.0
        times: dict[str, list[tuple[float, float]]] = {w: [] for w in LOOPS}
        for b in range(args.steps // args.block):
            shift = (b + repeat) % len(LOOPS)
            for which in LOOPS[shift:] + LOOPS[:shift]:
                dist.barrier()
                times[which].append(block(loops[which], args.block))
        out: dict[str, Any] = {"times": times}
        if run.writer is not None:
            run.writer.flush()  # the last write of the window is counted in the writer's CPU, not the clock
            st = run.writer.stats
            out["writer"] = {"written": st.snapshots_written - written0, "skipped": st.snapshots_skipped,
                             "boosted": st.boosted, "cpu": st.total_write_cpu_s - cpu0, "bytes": st.last_bytes}
        run.close()
        results.append(out)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smoke run: few steps, 2 repeats")
    p.add_argument("--steps", type=int, default=300, help="timed steps per loop and repeat")
    p.add_argument("--block", type=int, default=10, help="steps per block; blocks alternate between the loops")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--global-batch-size", type=int, default=256)
    p.add_argument("--dataset-size", type=int, default=8192)
    p.add_argument("--snapshot-every", type=int, default=50, help="ElasticRun snapshot interval in steps; 0: never")
    p.add_argument("--writer", choices=("process", "thread"), default="process",
                   help="ElasticRun's snapshot writer (its default: process)")
    p.add_argument("--glibc-malloc-default", action="store_true",
                   help="leave glibc's dynamic mmap threshold alone (see two_ranks.steady_allocator)")
    args = p.parse_args()
    if args.quick:
        args.steps, args.warmup, args.repeats = 60, 10, 2
    if args.steps % args.block:
        p.error("--steps must be a multiple of --block")
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        prom = Path(tmp, "prom")
        prom.mkdir()
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(prom)  # inherited by the spawned workers, as under the agent
        allocator = "glibc malloc: its defaults" if args.glibc_malloc_default else steady_allocator()
        load = os.getloadavg()[0]
        results = run_two_ranks(worker, args, tmp)

    def total(times: list[tuple[float, float]], i: int) -> float:
        return sum(t[i] for t in times)

    rate = {w: [args.steps * args.global_batch_size / total(r["times"][w], 0) for r in results] for w in LOOPS}
    ratios = [total(r["times"]["plain"], 0) / total(r["times"]["elastic"], 0) for r in results]
    cpu = {w: statistics.median(total(r["times"][w], 1) / args.steps for r in results) for w in LOOPS}
    print(f"trainer overhead: world {WORLD}, gloo on CPU, MLP {IN_FEATURES}-{HIDDEN}x3-4 + AdamW, "
          f"global batch {args.global_batch_size}, {args.repeats} repeats x {args.steps} timed steps per loop "
          f"in alternating blocks of {args.block}; load average {load:.1f} -> {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} cpus; {allocator}")
    print(f"  plain DDP loop : {statistics.median(rate['plain']):9.1f} samples/s  "
          f"(repeats: {', '.join(f'{r:.0f}' for r in rate['plain'])})")
    print(f"  ElasticRun     : {statistics.median(rate['elastic']):9.1f} samples/s  "
          f"(repeats: {', '.join(f'{r:.0f}' for r in rate['elastic'])}; snapshot every "
          f"{args.snapshot_every or 'never'} steps from the {args.writer} writer, metrics on)")
    ratio = statistics.median(ratios)
    print(f"  ratio ElasticRun/plain per repeat: {', '.join(f'{r:.4f}' for r in ratios)}; median {ratio:.4f} "
          f"({(1 - ratio) * 100:+.2f}% slower; goal <= {GOAL * 100:.0f}%)")
    pairs = sorted(p[0] / e[0] for r in results for p, e in zip(r["times"]["plain"], r["times"]["elastic"]))
    print(f"  {pair_verdict(pairs, GOAL)}")
    print(f"  prepared loop  : {statistics.median(rate['prepared']):9.1f} samples/s  "
          f"(repeats: {', '.join(f'{r:.0f}' for r in rate['prepared'])}; the plain loop + elastic.Elastic's lines)")
    prepared = [total(r["times"]["plain"], 0) / total(r["times"]["prepared"], 0) for r in results]
    ratio = statistics.median(prepared)
    print(f"  ratio prepared/plain per repeat: {', '.join(f'{r:.4f}' for r in prepared)}; median {ratio:.4f} "
          f"({(1 - ratio) * 100:+.2f}% slower; goal <= {PREPARED_GOAL * 100:.0f}%)")
    pairs = sorted(p[0] / e[0] for r in results for p, e in zip(r["times"]["plain"], r["times"]["prepared"]))
    print(f"  prepared: {pair_verdict(pairs, PREPARED_GOAL)}")
    line = (f"  rank 0 CPU per step (process, writer thread included): plain {cpu['plain'] * 1e3:.2f} ms, "
            f"ElasticRun {cpu['elastic'] * 1e3:.2f} ms, prepared {cpu['prepared'] * 1e3:.2f} ms")
    w = [r["writer"] for r in results if "writer" in r]
    if w:
        written = sum(x["written"] for x in w)
        per_snapshot = sum(x["cpu"] for x in w) / written if written else float("nan")
        line += (f"; writer CPU {per_snapshot * 1e3:.0f} ms per {w[0]['bytes'] / 1e6:.0f} MB snapshot, "
                 f"{written} written, {sum(x['skipped'] for x in w)} skipped, "
                 f"{sum(x['boosted'] for x in w)} raised to normal priority")
    print(line)


if __name__ == "__main__":
    main()
