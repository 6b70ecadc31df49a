"""What does the replica consistency check cost, against the steps it guards?

Two ranks (gloo, CPU, spawned, FileStore; no etcd) train ``two_ranks.make_model`` (an MLP,
AdamW) under ``ElasticRun`` with the periodic check off, and the benchmark calls the check
itself between blocks of steps: the real code path (fingerprint of parameters, optimizer
state and registered state with ``torch.hash_tensor``, the one small all-gather, the vote,
and the CPU copy of the whole state a passing check keeps). It then forces one rollback
(a bit flipped in rank 1's parameter) to time what a mismatch costs besides the retrain.

The anchor is the step time itself: the figure is the ratio

    check seconds / (interval x step seconds)     (goal: <= 0.5 % at the default interval, 100)

The ratio falls as the batch grows (a step's work grows with params x batch, the check's
with params only), so the figure is for the batch given; the default is the size the other
trainer benchmarks use.

    python bench/replica_check.py                 # ~1 min on 2 cores
    python bench/replica_check.py --hidden 2048   # a 4x larger model
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
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import two_ranks  # noqa: E402
from elastic.consistency.check import DEFAULT_EVERY_STEPS  # noqa: E402
from elastic.consistency.inject import flip_bit  # noqa: E402
from elastic.jobs.mlp import SyntheticClassification, as_batch  # noqa: E402
from elastic.run_config import DataConfig, SnapshotConfig  # noqa: E402
from elastic.trainer import ElasticRun  # noqa: E402

GOAL = 0.005


def worker(rank: int, args: argparse.Namespace, tmp: str) -> dict[str, Any]:
    model = two_ranks.make_model()
    run = ElasticRun(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                     SyntheticClassification(args.dataset_size, seed=0), device="cpu",
                     global_batch_size=args.global_batch_size, steps=10**9, snapshot_dir=os.path.join(tmp, "snap"),
                     snapshots=SnapshotConfig(every_steps=0), data=DataConfig(collate_fn=as_batch),
                     handle_sigterm=False, metrics=False,
                     check_every_steps=0)
    run.replica_check.every_steps = args.every  # driven by hand below, so that each call is timed alone
    run.register("ema", torch.zeros(4))
    steps = iter(run)
    block_s: list[float] = []
    check_s: list[float] = []

    def train(n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            x, y = next(steps)
            run.step(F.cross_entropy(run.model(x), y))
        return (time.perf_counter() - t0) / n

    train(args.warmup)
    run.replica_check.run(run)  # the first keep allocates the host copy; later ones reuse it
    for _ in range(args.repeats):
        block_s.append(train(args.block))
        t0 = time.perf_counter()
        went_back = run.replica_check.run(run)
        check_s.append(time.perf_counter() - t0)
        assert not went_back
    train(3)
    if rank == 1:
        flip_bit(next(run.state.module.parameters()), 0, 20)
    t0 = time.perf_counter()
    went_back = run.replica_check.run(run)
    rollback_s = time.perf_counter() - t0
    assert went_back
    params = sum(p.numel() for p in run.state.module.parameters())
    state_bytes = run.replica_check.kept_bytes
    run.close()
    return {"step_s": statistics.median(block_s), "check_s": statistics.median(check_s),
            "check_all": check_s, "rollback_s": rollback_s, "params": params, "state_bytes": state_bytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=two_ranks.HIDDEN)
    parser.add_argument("--global-batch-size", type=int, default=256)
    parser.add_argument("--dataset-size", type=int, default=100_000)
    parser.add_argument("--every", type=int, default=DEFAULT_EVERY_STEPS)
    parser.add_argument("--block", type=int, default=20, help="steps between two timed checks")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=10)
    args = parser.parse_args()
    two_ranks.HIDDEN = args.hidden
    print(two_ranks.steady_allocator())
    with tempfile.TemporaryDirectory() as tmp:
        r = two_ranks.run_two_ranks(worker, args, tmp)
    ratio = r["check_s"] / (args.every * r["step_s"])
    print(f"model: MLP hidden {args.hidden}, {r['params'] / 1e6:.2f} M parameters; state kept per check "
          f"{r['state_bytes'] / 2**20:.1f} MiB (parameters, AdamW moments, RNG, sampler, registered)")
    print(f"step (world 2, global batch {args.global_batch_size}): median {r['step_s'] * 1e3:.2f} ms")
    print(f"check (fingerprint + all-gather + vote + host copy): median {r['check_s'] * 1e3:.2f} ms "
          f"(all: {', '.join(f'{c * 1e3:.1f}' for c in sorted(r['check_all']))} ms)")
    verdict = "goal met" if ratio <= GOAL else "goal missed"
    print(f"check / ({args.every} x step) = {ratio * 100:.3f} % of step time -> {verdict} (goal <= {GOAL * 100:.1f} %)")
    print(f"a mismatch: vote, name, load the kept copy, verify = {r['rollback_s'] * 1e3:.1f} ms, then the steps since "
          f"the last agreed state are retrained: {args.every / 2:.0f} on average, {args.every} at most "
          f"({args.every / 2 * r['step_s']:.2f} s / {args.every * r['step_s']:.2f} s at this step time)")
    print(f"detection latency: at most {args.every} steps ({args.every * r['step_s']:.2f} s at this step time)")


if __name__ == "__main__":
    main()
