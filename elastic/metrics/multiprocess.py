"""The agent's side of multiprocess mode: prepare the directory, collect it, forget dead pids.

Workers started with ``PROMETHEUS_MULTIPROC_DIR=<dir>`` write their values to per-pid mmap
files there. The agent (one per node) serves :func:`collector_registry` on its endpoint and,
whenever it reaps a worker, calls :func:`mark_dead` so that the dead pid's ``live*`` gauges
(rank, loss, world size, ...) disappear. Counters and histograms of dead pids stay in the
sum on purpose: they never go back after a restart, which is what ``rate()`` needs.

This module does not import torch: the agent should stay light.
"""

from __future__ import annotations

import os
from pathlib import Path

from prometheus_client import CollectorRegistry
from prometheus_client import multiprocess as _mp


def prepare_dir(path: str | os.PathLike[str]) -> Path:
    """Create ``path`` or empty it of old ``*.db`` files; call once before starting workers.

    Files left by an earlier run would otherwise be summed into this one's counters.
    Only ``*.db`` files are removed, so a mistyped path does not wipe someone's directory.
    """
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    for f in root.glob("*.db"):
        f.unlink(missing_ok=True)
    return root


def collector_registry(path: str | os.PathLike[str]) -> CollectorRegistry:
    """A registry that merges every worker's files under ``path`` at each scrape."""
    registry = CollectorRegistry()
    _mp.MultiProcessCollector(registry, path=str(path))
    return registry


def mark_dead(pid: int, path: str | os.PathLike[str]) -> None:
    """Drop the ``live*`` gauges of worker ``pid``; its counters and histograms stay summed."""
    _mp.mark_process_dead(pid, str(path))
