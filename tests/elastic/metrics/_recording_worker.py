"""A stand-in worker for the multiprocess tests: record STEPS steps as RANK, then wait.

    PROMETHEUS_MULTIPROC_DIR=DIR python -m tests.elastic.metrics._recording_worker RANK WORLD STEPS RESTART

Prints ``ready`` once its values are on disk and exits when its stdin closes, so a test
decides exactly when it dies. No torch: the catalogue does not need it.
"""

from __future__ import annotations

import sys

from elastic.metrics import WorkerMetrics


def main() -> None:
    rank, world, steps, restart = (int(a) for a in sys.argv[1:5])
    metrics = WorkerMetrics(rank, world, backend="gloo", device="cpu", torch_version="test", restart_count=restart)
    for _ in range(steps):
        metrics.step_done(local_samples=8, step_seconds=0.01, data_wait_seconds=0.001, loss=1.0 + rank)
    print("ready", flush=True)
    sys.stdin.read()


if __name__ == "__main__":
    main()
