"""Healing a joiner from a live replica: our state transfer beside a raw gloo broadcast.

Three gloo processes on this machine (loopback). Each builds ResNet-50 and Adam and takes
one optimizer step on random data, so the optimizer holds its full state: 102 MB of
parameters and buffers plus 205 MB of Adam moments, the 307 MB the issue names. Then,
alternating, ``--repeats`` times each:

* **ours**: rank 0 sends its whole training state (``elastic.inplace.transfer``: the state
  tree's structure as tagged JSON, tensors in 64 MB buckets) to rank 2, which rebuilds it
  and loads it into its own model and optimizer, as a joiner does;
* **raw broadcast**: rank 0 broadcasts one flat tensor of exactly as many bytes to the
  other two (``dist.broadcast``), the fastest gloo can move those bytes here.

It prints each figure beside its anchor, as a ratio (the goal: ours at >= 50 % of the raw
broadcast's throughput), and whether the healed state is bitwise rank 0's.

    .venv/bin/python bench/heal_transfer.py --repeats 5
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

WORLD = 3


def _state_bytes(state: object) -> int:
    from checkpoints.tree import tensor_bytes

    return tensor_bytes(state)


def _worker(rank: int, store_path: str, repeats: int, results: str) -> None:
    import torchvision

    from elastic.inplace.transfer import recv_state, send_state
    from elastic.train_state import TrainState
    from elastic.sampler import ElasticSampler

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, WORLD), rank=rank, world_size=WORLD)
    torch.manual_seed(rank)  # different replicas: a heal must really change rank 2's state
    model = torchvision.models.resnet50()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, 3, 64, 64)).sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    state = TrainState(model, optimizer, ElasticSampler(1000))
    nbytes = _state_bytes(state.capture())
    device = torch.device("cpu")
    ours: list[float] = []
    raw: list[float] = []
    flat = torch.empty(nbytes, dtype=torch.uint8)
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            send_state(state.capture(), 2, device)
        elif rank == 2:
            state.load(recv_state(0, device))
        dist.barrier()
        ours.append(time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        dist.broadcast(flat, 0)
        dist.barrier()
        raw.append(time.perf_counter() - t0)
    sha = hashlib.sha256()
    for p in list(model.parameters()) + [t for s in optimizer.state.values() for t in s.values()
                                         if isinstance(t, torch.Tensor)]:
        sha.update(p.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    digest = torch.tensor([int.from_bytes(sha.digest()[:7], "big")], dtype=torch.int64)
    gathered = [torch.zeros_like(digest) for _ in range(WORLD)]
    dist.all_gather(gathered, digest)
    if rank == 0:
        torch.save({"ours": ours, "raw": raw, "bytes": nbytes, "same": gathered[0].item() == gathered[2].item()},
                   results)
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-heal-"))
    results = str(work / "results.pt")
    mp.spawn(_worker, args=(str(work / "store"), args.repeats, results), nprocs=WORLD, join=True)
    out = torch.load(results)
    mb = out["bytes"] / 1e6
    ours, raw = statistics.median(out["ours"]), statistics.median(out["raw"])
    print(f"state: {mb:.1f} MB (ResNet-50 + Adam, one step taken); {args.repeats} repeats, medians")
    print(f"{'':28s} {'median s':>9s} {'GB/s':>6s}  trials (s)")
    for name, values, med in (("ours: send + rebuild + load", out["ours"], ours),
                              ("raw gloo broadcast", out["raw"], raw)):
        print(f"{name:28s} {med:9.3f} {out['bytes'] / med / 1e9:6.2f}  {', '.join(f'{v:.3f}' for v in values)}")
    print(f"ours / raw throughput: {raw / ours:.0%} (goal >= 50%); healed state bitwise rank 0's: {out['same']}")
    print(f"load average {os.getloadavg()[0]:.1f}; work dir {work}")
    return 0 if out["same"] else 1


if __name__ == "__main__":
    sys.exit(main())
