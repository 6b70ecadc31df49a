"""Atomic, checksummed training snapshots with a background writer.

Typical use on rank 0::

    store = SnapshotStore("/ckpt/run1", keep=3)
    writer = AsyncSnapshotWriter(store)           # overlap_policy="skip"
    writer.attach_optimizer(optimizer)            # optimizer.step() waits for the capture
    ...
    writer.submit(step, {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                         "rng": capture_rng_state(), "step": step}, world_size=world)

and on (re)start, every rank::

    found = store.load_latest()                   # newest snapshot that fully verifies
"""

from .compat import check_state_compatible
from .errors import (
    SnapshotCorruptError,
    SnapshotDirError,
    SnapshotDiskFullError,
    SnapshotError,
    SnapshotExistsError,
    SnapshotKeyError,
    SnapshotMismatchError,
)
from .fence import Fence, FenceToken, SnapshotFencedError
from .rng import capture_rng_state, restore_rng_state
from .store import SnapshotInfo, SnapshotStatus, SnapshotStore, TempDirStatus
from .writer import AsyncSnapshotWriter, WriterStats

__all__ = [
    "SnapshotStore",
    "SnapshotInfo",
    "SnapshotStatus",
    "TempDirStatus",
    "AsyncSnapshotWriter",
    "WriterStats",
    "SnapshotError",
    "SnapshotCorruptError",
    "SnapshotMismatchError",
    "SnapshotDirError",
    "SnapshotDiskFullError",
    "SnapshotExistsError",
    "SnapshotKeyError",
    "SnapshotFencedError",
    "Fence",
    "FenceToken",
    "capture_rng_state",
    "restore_rng_state",
    "check_state_compatible",
]
