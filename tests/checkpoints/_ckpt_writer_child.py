"""Child for the writer tests: submits snapshots back to back and says what it does.

``python _ckpt_writer_child.py ROOT [--writer-process]``. With ``--writer-process`` it
first waits for the writer process and prints ``writer <pid>``. Then it prints
``submitted <step>`` per snapshot. On SIGTERM it flushes, prints
``flushed pending=<step>`` and exits 0.
"""

from __future__ import annotations

import signal
import sys

import torch

from checkpoints import AsyncSnapshotWriter, SnapshotStore

root = sys.argv[1]
writer = AsyncSnapshotWriter(SnapshotStore(root, keep=2), overlap_policy="wait")  # a write is always in flight
base = torch.randn(4 << 20, generator=torch.Generator().manual_seed(0))  # 16 MB


def on_sigterm(signum: int, frame: object) -> None:
    pending = writer.pending_step
    writer.flush()
    print(f"flushed pending={pending}", flush=True)
    sys.exit(0)


signal.signal(signal.SIGTERM, on_sigterm)
if "--writer-process" in sys.argv[2:]:
    assert writer.wait_writer_process(), "the writer process did not start"  # so the process, not a thread, writes
    print(f"writer {writer.writer_pid}", flush=True)
step = 0
while True:
    step += 1
    writer.submit(step, {"model": {"w": base, "marker": torch.tensor(step)}, "step": step}, world_size=1)
    print(f"submitted {step}", flush=True)
