"""What does looking at each step's gradients for a NaN or an Inf cost, against the plain step?

``ElasticRun`` looks at every step's all-reduced gradients before the optimizer applies
them (:mod:`elastic.consistency.nonfinite`): no collective of its own (DDP's all-reduce
already makes a NaN on any rank a NaN in every rank's sum), one sum per gradient and
one host sync. Two ranks (gloo, CPU, spawned, FileStore; no etcd) train
``two_ranks.make_model`` (an MLP, AdamW) under ``ElasticRun`` in alternating blocks with
the guard on and off, in the same processes; the anchor is the unguarded step, and the
figure is the ratio

    (guarded step - plain step) / plain step          (goal: <= 1 %)

with the look itself timed alone on the same gradients beside it (the block difference is
within the noise of a shared machine; the look alone is not).

    python bench/nonfinite_guard.py                  # ~1 min on 2 cores
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
from elastic.consistency.nonfinite import grads_finite  # noqa: E402
from elastic.jobs.mlp import SyntheticClassification, as_batch  # noqa: E402
from elastic.run_config import DataConfig, SnapshotConfig  # noqa: E402
from elastic.trainer import ElasticRun  # noqa: E402

GOAL = 0.01


def worker(rank: int, args: argparse.Namespace, tmp: str) -> dict[str, Any]:
    model = two_ranks.make_model()
    run = ElasticRun(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                     SyntheticClassification(args.dataset_size, seed=0), device="cpu",
                     global_batch_size=args.global_batch_size, steps=10**9, snapshot_dir=os.path.join(tmp, "snap"),
                     snapshots=SnapshotConfig(every_steps=0), data=DataConfig(collate_fn=as_batch),
                     handle_sigterm=False, metrics=False, check_every_steps=0)
    steps = iter(run)
    on_s: list[float] = []
    off_s: list[float] = []
    look_s: list[float] = []

    def train(n: int, guarded: bool) -> float:
        run.guards_nonfinite = guarded
        t0 = time.perf_counter()
        for _ in range(n):
            x, y = next(steps)
            run.step(F.cross_entropy(run.model(x), y))
        return (time.perf_counter() - t0) / n

    train(args.warmup, True)
    for i in range(args.repeats):  # alternating, so that the machine's load falls on both alike
        for guarded in ((True, False) if i % 2 == 0 else (False, True)):
            (on_s if guarded else off_s).append(train(args.block, guarded))
    x, y = next(steps)  # one more backward, its gradients looked at alone
    loss = F.cross_entropy(run.model(x), y)
    loss.backward()
    params = list(run.state.module.parameters())
    for _ in range(args.looks):
        t0 = time.perf_counter()
        assert grads_finite(params)
        look_s.append(time.perf_counter() - t0)
    n = sum(p.numel() for p in params)
    run.close()
    return {"on_s": statistics.median(on_s), "off_s": statistics.median(off_s), "look_s": statistics.median(look_s),
            "params": n}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=two_ranks.HIDDEN)
    parser.add_argument("--global-batch-size", type=int, default=256)
    parser.add_argument("--dataset-size", type=int, default=100_000)
    parser.add_argument("--block", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--looks", type=int, default=50)
    args = parser.parse_args()
    two_ranks.HIDDEN = args.hidden
    print(two_ranks.steady_allocator())
    with tempfile.TemporaryDirectory() as tmp:
        r = two_ranks.run_two_ranks(worker, args, tmp)
    print(f"model: MLP hidden {args.hidden}, {r['params'] / 1e6:.2f} M parameters; world 2, global batch "
          f"{args.global_batch_size}")
    print(f"plain step (the anchor): median {r['off_s'] * 1e3:.2f} ms; guarded step: median {r['on_s'] * 1e3:.2f} ms "
          f"-> {(r['on_s'] - r['off_s']) / r['off_s'] * 100:+.2f} % (block medians: noisy on a shared machine)")
    ratio = r["look_s"] / r["off_s"]
    verdict = "goal met" if ratio <= GOAL else "goal missed"
    print(f"the look alone (a sum per gradient, one sync): median {r['look_s'] * 1e3:.3f} ms = "
          f"{ratio * 100:.2f} % of the plain step -> {verdict} (goal <= {GOAL * 100:.0f} %)")


if __name__ == "__main__":
    main()
