"""A stand-in worker whose rank changes in place, driven line by line from its stdin.

    PROMETHEUS_MULTIPROC_DIR=DIR python -m tests.elastic.metrics._rank_worker RANK WORLD LOCAL_RANK [GPU_UUID]

Commands: ``step`` (one step with loss = 1 + rank), ``rank R W`` (``rank_changed``). It
answers ``ok`` once the values are on disk, and exits when its stdin closes. No torch:
``WorkerMetrics`` does not need it (``ElasticRun`` passes the GPU uuid it reads from CUDA).
"""

from __future__ import annotations

import sys

from elastic.metrics import RankInfo, WorkerMetrics


def main() -> None:
    rank, world, local_rank = (int(a) for a in sys.argv[1:4])
    gpu = sys.argv[4] if len(sys.argv) > 4 else ""
    identity = RankInfo(rank, local_rank, "node-a", "host-a", gpu)
    metrics = WorkerMetrics(rank, world, backend="gloo", device="cpu", torch_version="test", identity=identity)
    print("ok", flush=True)
    for line in sys.stdin:
        words = line.split()
        if words == ["step"]:
            metrics.step_done(local_samples=8, step_seconds=0.01, data_wait_seconds=0.001, loss=1.0 + metrics.rank)
        elif words[:1] == ["rank"]:
            metrics.rank_changed(int(words[1]), int(words[2]))
        print("ok", flush=True)


if __name__ == "__main__":
    main()
