"""The agent's side of multiprocess mode: prepare the directory, collect it, forget dead pids.

Workers started with ``PROMETHEUS_MULTIPROC_DIR=<dir>`` write their values to per-pid mmap
files there. The agent (one per node) serves :func:`collector_registry` on its endpoint and,
whenever it reaps a worker, calls :func:`mark_dead` so that the dead pid's ``live*`` gauges
(rank, loss, world size, ...) disappear. Counters and histograms of dead pids stay in the
sum on purpose: they never go back after a restart, which is what ``rate()`` needs.

Two things prometheus_client's own merge cannot do happen here, at each scrape:

* samples a live worker retired when its rank changed in place (``RETIRED`` values in
  :mod:`elastic.metrics.catalogue`) are left out;
* ``elastic_rank_info`` is one series per live rank: what each worker says of itself, and
  the agent's own account (``stand_in``) of workers that say nothing (scripts that do not
  use ``ElasticRun``). A worker's word wins from its first claim on, even a retired one;
* a file a worker has just created (empty until its first value) is skipped: prometheus_client
  raises ``struct.error`` on it, which once crashed an agent whose straggler watch read the
  directory as a new worker started on a loaded machine (:func:`merged`).

This module does not import torch: the agent should stay light.
"""

from __future__ import annotations

import glob
import os
import struct
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping

from prometheus_client import CollectorRegistry
from prometheus_client import multiprocess as _mp
from prometheus_client.metrics_core import Metric
from prometheus_client.samples import Sample

from .catalogue import RANK_INFO, RANK_INFO_HELP, RETIRED
from .rank_info import LABELS, RankInfo

StandIn = Callable[[], Mapping[int, RankInfo]]  # worker pid -> what the agent knows of it


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


def rank_info_samples(written: Iterable[Sample], stand_in: Mapping[int, RankInfo]) -> list[Sample]:
    """One ``elastic_rank_info`` sample per live rank, without the ``pid`` label.

    ``written`` are the workers' own samples as the ``liveall`` merge gives them (one per
    live pid and label set, labelled ``pid``; 0 = retired). A stand-in entry is used for a
    pid that never wrote one, unless a worker already claims its rank.
    """
    spoken: set[str] = set()
    claims: dict[tuple[tuple[str, str], ...], dict[str, str]] = {}
    for s in written:
        spoken.add(s.labels.get("pid", ""))
        if s.value == RETIRED[RANK_INFO]:
            continue
        labels = {k: v for k, v in s.labels.items() if k != "pid"}
        claims[tuple(sorted(labels.items()))] = labels
    claimed_ranks = {labels.get("rank") for labels in claims.values()}
    for pid, info in sorted(stand_in.items()):
        if str(pid) in spoken or str(info.rank) in claimed_ranks:
            continue
        labels = dict(zip(LABELS, info.labels()))
        claims[tuple(sorted(labels.items()))] = labels
        claimed_ranks.add(str(info.rank))
    return [Sample(RANK_INFO, labels, 1.0) for _, labels in sorted(claims.items())]


_HEADER = 8  # an mmap file's used-bytes word and padding: a shorter file has no value yet


def merged(path: str | os.PathLike[str]) -> list[Metric]:
    """Every worker's values under ``path``, merged by prometheus_client (counters summed over
    pids); files with no value yet are left out, and a file cut short while read (a worker
    creating it at that moment) makes this look return nothing rather than raise."""
    files = []
    for name in glob.glob(os.path.join(str(path), "*.db")):
        try:
            if os.path.getsize(name) >= _HEADER:
                files.append(name)
        except OSError:
            continue  # gone meanwhile
    try:
        return list(_mp.MultiProcessCollector.merge(files, accumulate=True))
    except (struct.error, OSError, ValueError):
        return []


class WorkerFiles:
    """A collector: the workers' files merged by prometheus_client, then the fixes above."""

    def __init__(self, path: str | os.PathLike[str], stand_in: StandIn | None = None) -> None:
        self._path = path
        self._stand_in: StandIn = stand_in or dict

    def collect(self) -> Iterator[Metric]:
        info_seen = False
        for metric in merged(self._path):
            if metric.name == RANK_INFO:
                info_seen = True
                metric.samples = rank_info_samples(metric.samples, self._stand_in())
            elif metric.name in RETIRED:
                retired = RETIRED[metric.name]
                metric.samples = [s for s in metric.samples if s.value != retired]
            yield metric
        if not info_seen:
            metric = Metric(RANK_INFO, RANK_INFO_HELP, "gauge")
            metric.samples = rank_info_samples((), self._stand_in())
            if metric.samples:
                yield metric


def collector_registry(path: str | os.PathLike[str], stand_in: StandIn | None = None) -> CollectorRegistry:
    """A registry that merges every worker's files under ``path`` at each scrape.

    ``stand_in`` (the agent's) names the live workers by pid, for those that do not
    export ``elastic_rank_info`` themselves.
    """
    registry = CollectorRegistry()
    registry.register(WorkerFiles(path, stand_in))
    return registry


def mark_dead(pid: int, path: str | os.PathLike[str]) -> None:
    """Drop the ``live*`` gauges of worker ``pid``; its counters and histograms stay summed."""
    _mp.mark_process_dead(pid, str(path))
