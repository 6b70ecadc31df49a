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

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Exports import their module on first use (as elastic/_lazy.py does for elastic; this package
# imports nothing of elastic): the agent's tools and the rendezvous import checkpoints.pids and
# checkpoints.signing, and must not pay for ``import torch`` that the store brings.
_EXPORTS = {
    "check_state_compatible": ".compat",
    "SnapshotCorruptError": ".errors", "SnapshotDirError": ".errors", "SnapshotDiskFullError": ".errors",
    "SnapshotError": ".errors", "SnapshotExistsError": ".errors", "SnapshotKeyError": ".errors",
    "SnapshotMismatchError": ".errors",
    "Fence": ".fence", "FenceToken": ".fence", "SnapshotFencedError": ".fence",
    "capture_rng_state": ".rng", "restore_rng_state": ".rng",
    "SnapshotInfo": ".store", "SnapshotStatus": ".store", "SnapshotStore": ".store", "TempDirStatus": ".store",
    "AsyncSnapshotWriter": ".writer", "WriterStats": ".writer",
}

if TYPE_CHECKING:
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


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip this hook
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


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
