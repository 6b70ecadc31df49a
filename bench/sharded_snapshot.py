"""What do snapshots of a sharded (FSDP2) model cost, against a plain FSDP2 loop and DCP's async save?

Three loops train the same FSDP2 model (a 1-D mesh over two spawned ranks, gloo on the CPU,
AdamW) on the same data, in the same two processes, in blocks that alternate (A B C A B C
...), so outside load hits them alike:

* **plain**: the FSDP2 loop alone, no snapshots (the anchor);
* **dcp**: the same loop plus ``torch.distributed.checkpoint.async_save`` of model and
  optimizer every ``--every`` steps, waiting for the previous save before the next (DCP's
  documented pattern): what a torchrun job would do;
* **elastic**: ``ElasticRun`` on the same model, a snapshot every ``--every`` steps (every
  rank copies its own shards at the step and writes them in the background as DCP files,
  checksummed; rank 0 seals the manifest: ``elastic/sharded_snapshots.py``).

Prints the median step time of each, and each snapshot loop's stall per snapshot: the
extra time of its blocks over the plain loop's, divided by the snapshots they took. On
this machine's 2 shared cores the figures are noisy; say so wherever they are quoted.

    python bench/sharded_snapshot.py            # ~2 min
    python bench/sharded_snapshot.py --quick    # smoke run
    python bench/sharded_snapshot.py --loops plain,elastic,elastic-s3   # the same into s3:// (SeaweedFS here)
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
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.two_ranks import run_two_ranks, steady_allocator  # noqa: E402

IN, HIDDEN, OUT, BATCH = 256, 1024, 4, 32


def _model() -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                          nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUT))
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("shard",))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


class _Data(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(n, IN, generator=g), torch.randint(0, OUT, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class _Plain:
    def __init__(self, dcp_dir: str | None, every: int) -> None:
        self.model = _model()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.data, self.dcp_dir, self.every, self.step, self.saves = _Data(1 << 20), dcp_dir, every, 0, 0
        self.pending: Any = None
        # DCP's async save runs collectives from its own thread: on the training's group they
        # would interleave with the step's (gloo then aborts); DCP's docs give it a group of its own.
        self.group = torch.distributed.new_group(backend="gloo") if dcp_dir is not None else None

    def block(self, steps: int) -> float:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        t0 = time.perf_counter()
        for _ in range(steps):
            i = (self.step * BATCH * 2) % (len(self.data) - 2 * BATCH)
            x, y = self.data.x[i:i + BATCH], self.data.y[i:i + BATCH]
            self.opt.zero_grad()
            F.cross_entropy(self.model(x), y).backward()
            self.opt.step()
            self.step += 1
            if self.dcp_dir is not None and self.step % self.every == 0:
                if self.pending is not None:
                    self.pending.result()
                model_sd, opt_sd = get_state_dict(self.model, self.opt)
                self.pending = dcp.async_save({"model": model_sd, "optim": opt_sd},
                                              checkpoint_id=os.path.join(self.dcp_dir, f"step-{self.step}"),
                                              process_group=self.group)
                self.saves += 1
        return time.perf_counter() - t0


class _Elastic:
    def __init__(self, snapshot_dir: str, every: int) -> None:
        from elastic import ElasticRun, SnapshotConfig

        self.model = _model()
        self.run = ElasticRun(self.model, torch.optim.AdamW(self.model.parameters(), lr=1e-4), _Data(1 << 20),
                              global_batch_size=2 * BATCH, steps=10 ** 9, snapshot_dir=snapshot_dir, metrics=False,
                              handle_sigterm=False, snapshots=SnapshotConfig(every_steps=every, keep=2))
        self.it = iter(self.run)
        self.every, self.saves = every, 0

    def block(self, steps: int) -> float:
        t0 = time.perf_counter()
        for _ in range(steps):
            x, y = next(self.it)
            self.run.step(F.cross_entropy(self.run.model(x), y))
            if self.run.step_count % self.every == 1 and self.run.step_count > 1:
                self.saves += 1  # step k's snapshot is submitted during step k + 1
        return time.perf_counter() - t0


def _worker(rank: int, args: argparse.Namespace, tmp: str) -> dict[str, Any]:
    makers: dict[str, Any] = {"plain": lambda: _Plain(None, args.every),
                              "dcp": lambda: _Plain(os.path.join(tmp, "dcp"), args.every),
                              "elastic": lambda: _Elastic(os.path.join(tmp, "elastic"), args.every),
                              "elastic-s3": lambda: _Elastic(args.s3_url, args.every)}
    loops = {n: makers[n]() for n in args.loops.split(",")}
    for loop in loops.values():
        loop.block(args.every + 2)  # warm: first snapshot taken, writer started
        loop.saves = 0
    times: dict[str, list[float]] = {name: [] for name in loops}
    for _ in range(args.repeats):
        for name, loop in loops.items():
            times[name].append(loop.block(args.block))
    if "dcp" in loops and loops["dcp"].pending is not None:
        loops["dcp"].pending.result()
    for name in ("elastic", "elastic-s3"):
        if name in loops:
            loops[name].run.close()
    return {"times": times, "saves": {n: loops[n].saves for n in loops if n != "plain"},
            "state_mb": sum(p.numel() * 4 * 3 for p in loops["plain"].model.parameters()) * 2 / 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--block", type=int, default=40, help="steps per block")
    parser.add_argument("--repeats", type=int, default=8, help="blocks per loop")
    parser.add_argument("--every", type=int, default=10, help="steps between snapshots")
    parser.add_argument("--loops", default="plain,dcp,elastic",
                        help="which loops (plain always first); elastic-s3: ElasticRun into SeaweedFS on this host")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.block, args.repeats = 20, 2
    print(steady_allocator())
    with tempfile.TemporaryDirectory(prefix="sharded-bench-") as tmp:
        server = None
        if "elastic-s3" in args.loops.split(","):  # each rank uploads its own shards to a real S3 server
            from tests.support.s3server import SeaweedS3

            server = SeaweedS3(Path(tmp) / "s3")
            server.start()
            os.environ.update(server.env())  # the spawned ranks inherit them
            args.s3_url = f"s3://{server.bucket('sharded-bench')}/job"
        try:
            out = run_two_ranks(_worker, args, tmp)
        finally:
            if server is not None:
                server.stop()
    times, saves = out["times"], out["saves"]
    per_step = {n: statistics.median(t) / args.block for n, t in times.items()}
    print(f"FSDP2 over 2 ranks (gloo, CPU), state (params + AdamW) {out['state_mb']:.1f} MB, block {args.block} "
          f"steps x {args.repeats}, a snapshot every {args.every} steps")
    for name in times:
        line = f"  {name:10s} median step {per_step[name] * 1e3:7.2f} ms"
        if name != "plain":
            extra = sum(times[name]) - sum(times["plain"])
            n = max(1, saves[name])
            line += (f"  ({per_step[name] / per_step['plain'] - 1:+.1%} vs plain), stall per snapshot "
                     f"{extra / n * 1e3:7.1f} ms over {saves[name]} snapshots")
        print(line)


if __name__ == "__main__":
    main()
