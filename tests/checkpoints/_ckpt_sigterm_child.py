"""Child for the SIGTERM test: keeps submitting snapshots until SIGTERM, whose handler flushes."""

from __future__ import annotations

import signal
import sys

import torch

from checkpoints import AsyncSnapshotWriter, SnapshotStore

root = sys.argv[1]
store = SnapshotStore(root, keep=2)
writer = AsyncSnapshotWriter(store, overlap_policy="wait")  # so a write is always in flight
base = torch.randn(4 << 20, generator=torch.Generator().manual_seed(0))  # 16 MB


def on_sigterm(signum: int, frame: object) -> None:
    pending = writer.pending_step
    writer.flush()
    print(f"flushed pending={pending}", flush=True)
    sys.exit(0)


signal.signal(signal.SIGTERM, on_sigterm)
step = 0
while True:
    step += 1
    writer.submit(step, {"model": {"w": base, "marker": torch.tensor(step)}, "step": step}, world_size=1)
    print(f"submitted {step}", flush=True)
