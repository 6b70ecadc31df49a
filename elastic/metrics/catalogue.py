"""Every worker metric: name, type, labels and multiprocess mode, defined once per process.

The names are an interface: Prometheus rules, the Grafana dashboard and ``elastic top``
query them, so add, never rename, and describe each in ``docs/metrics.md``. Labels stay
bounded: ``rank`` (< world size), ``op``, ``backend``, the build-info labels and, on the
one info series ``elastic_rank_info``, the rank's node, host and GPU (for DCGM joins).

The gauges' ``multiprocess_mode`` decides what the agent's endpoint shows when several
worker pids (live and dead) wrote the same series: ``live*`` modes drop a pid's value once
the agent calls ``mark_dead(pid)``, so a gone rank's gauges vanish, while counters and
histograms of dead pids keep counting so that they never go back after a restart.

A live process whose rank changes in place (:meth:`WorkerMetrics.rank_changed`) cannot
delete its old labelled samples: prometheus_client's ``remove()`` only forgets the child
in memory and leaves the value in the process's mmap file (0.26 warns "not implemented in
multi-process mode"). It writes :data:`RETIRED` values instead, which the agent's
collector (:mod:`elastic.metrics.multiprocess`) leaves out; each sentinel loses to any
real value in the family's merge, so a rank another process now holds shows that value.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from .rank_info import LABELS as RANK_INFO_LABELS

RANK = ("rank",)
COLLECTIVE = ("op", "backend")
BUILD = ("version", "torch_version", "backend", "device")

# Histogram observe() scans the bounds linearly, so each set stays short.
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
WAIT_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
COLLECTIVE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                      1.0, 2.5, 10.0, 30.0)
STALL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, 30.0)
WRITE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)

# What a process writes over a rank-labelled gauge sample it no longer owns. Each is a value
# the family never takes for real and loses its merge: max (livemax) or, for the info
# series (liveall), it is simply dropped. The loss (livemostrecent) has no such value;
# -inf is one no training loss reaches, and the new owner's next write (newer) wins.
RANK_INFO = "elastic_rank_info"
RANK_INFO_HELP = "Always 1: a live rank's local rank, node, host and GPU uuid (DCGM's Hostname and UUID)."
RETIRED = {
    RANK_INFO: 0.0,
    "elastic_rank": -1.0,
    "elastic_last_step_timestamp_seconds": 0.0,
    "elastic_loss": float("-inf"),
    "elastic_step_compute_seconds": -1.0,
    "elastic_step_collective_wait_seconds": -1.0,
}


@dataclass(frozen=True)
class Families:
    """The metric objects, unbound; :class:`elastic.metrics.worker.WorkerMetrics` binds labels."""

    registry: CollectorRegistry
    steps: Counter
    samples: Counter
    tokens: Counter
    step_duration: Histogram
    data_wait: Histogram
    step_compute: Gauge
    step_collective_wait: Gauge
    last_step_timestamp: Gauge
    loss: Gauge
    world_size: Gauge
    rank: Gauge
    rank_info: Gauge
    worker_restarts: Gauge
    build_info: Gauge
    collective_duration: Histogram
    collective_bytes: Counter
    collective_errors: Counter
    snapshot_stall: Histogram
    snapshot_write: Histogram
    snapshot_bytes: Counter
    snapshots_skipped: Counter
    snapshot_last_durable: Gauge
    restore: Gauge
    time_to_first_step: Gauge
    heal: Gauge
    heal_bytes: Counter
    restores: Counter
    sdc_mismatches: Counter
    peer_copy: Gauge
    peer_copy_bytes: Counter
    peer_copy_lag: Gauge
    peer_copy_host: Gauge


@functools.cache
def families() -> Families:
    """Create the families once per process, on a private registry.

    Private so that a second ``ElasticRun`` in one process (tests, benchmarks) reuses them
    instead of failing on duplicate registration in prometheus_client's global registry.
    In multiprocess mode unlabeled series open their file here, so
    ``PROMETHEUS_MULTIPROC_DIR`` must exist first (``export.start_export`` sees to it).
    """
    r = CollectorRegistry(auto_describe=True)
    return Families(
        registry=r,
        steps=Counter("elastic_steps_total", "Training steps this rank completed.", RANK, registry=r),
        samples=Counter("elastic_samples_total", "Samples this rank processed (its share of each global batch).",
                        RANK, registry=r),
        tokens=Counter("elastic_tokens_total", "Tokens this rank processed (jobs that define tokens only).",
                       RANK, registry=r),
        step_duration=Histogram("elastic_step_duration_seconds",
                                "Host wall time of one step, data wait included.", RANK,
                                buckets=STEP_BUCKETS, registry=r),
        data_wait=Histogram("elastic_data_wait_seconds", "Time a step waited for its batch from the data loader.",
                            RANK, buckets=WAIT_BUCKETS, registry=r),
        # Gauges of a recent median (elastic.metrics.step_split): the rank's pace now, in one sample.
        step_compute=Gauge("elastic_step_compute_seconds",
                           "Median over the last 20 steps of this rank's own work per step: step time less its "
                           "data wait and collective wait (a straggler's is high, its peers' collective wait is).",
                           RANK, multiprocess_mode="livemax", registry=r),
        step_collective_wait=Gauge("elastic_step_collective_wait_seconds",
                                   "Median over the last 20 steps of the time a step spent in the gradient "
                                   "all-reduce (waiting for the slowest rank included).",
                                   RANK, multiprocess_mode="livemax", registry=r),
        last_step_timestamp=Gauge("elastic_last_step_timestamp_seconds",
                                  "Unix time at which this rank last completed a step.", RANK,
                                  multiprocess_mode="livemax", registry=r),
        loss=Gauge("elastic_loss", "This rank's training loss at its latest step (mean over its local batch).",
                   RANK, multiprocess_mode="livemostrecent", registry=r),
        world_size=Gauge("elastic_world_size", "Number of ranks in the current world.",
                         multiprocess_mode="livemostrecent", registry=r),
        rank=Gauge("elastic_rank", "Global rank of a live worker (value = rank; presence = the rank is live).",
                   RANK, multiprocess_mode="livemax", registry=r),
        # liveall: the agent's endpoint sees which pid claims which rank (so it can stand in
        # for workers that never report, and drop retired claims), then strips the pid.
        rank_info=Gauge(RANK_INFO, RANK_INFO_HELP, RANK_INFO_LABELS, multiprocess_mode="liveall", registry=r),
        worker_restarts=Gauge("elastic_worker_restarts",
                              "Times torchrun restarted this node's worker group (TORCHELASTIC_RESTART_COUNT).",
                              multiprocess_mode="livemax", registry=r),
        build_info=Gauge("elastic_build_info", "Always 1; labels describe the running build.", BUILD,
                         multiprocess_mode="livemax", registry=r),
        collective_duration=Histogram("elastic_collective_duration_seconds",
                                      "Time of one collective, enqueue to completion (CUDA events on NCCL).",
                                      COLLECTIVE, buckets=COLLECTIVE_BUCKETS, registry=r),
        collective_bytes=Counter("elastic_collective_bytes_total", "Payload bytes of collectives this rank issued.",
                                 COLLECTIVE, registry=r),
        collective_errors=Counter("elastic_collective_errors_total", "Collectives that failed on this rank.",
                                  COLLECTIVE, registry=r),
        snapshot_stall=Histogram("elastic_snapshot_stall_seconds",
                                 "Time training was blocked by one snapshot (submit and capture wait).",
                                 buckets=STALL_BUCKETS, registry=r),
        snapshot_write=Histogram("elastic_snapshot_write_seconds",
                                 "Background time of one snapshot: capture copy, serialise, fsync, rename.",
                                 buckets=WRITE_BUCKETS, registry=r),
        snapshot_bytes=Counter("elastic_snapshot_bytes_total", "Bytes of snapshots made durable.", registry=r),
        snapshots_skipped=Counter("elastic_snapshots_skipped_total",
                                  "Due snapshots skipped because the previous one was still being written.",
                                  registry=r),
        snapshot_last_durable=Gauge("elastic_snapshot_last_durable_timestamp_seconds",
                                    "Unix time at which the newest snapshot became durable.",
                                    multiprocess_mode="max", registry=r),
        restore=Gauge("elastic_restore_seconds",
                      "Time this worker spent finding and loading the newest snapshot at start.",
                      multiprocess_mode="livemax", registry=r),
        time_to_first_step=Gauge("elastic_time_to_first_step_seconds",
                                 "Worker process start to its first completed step (0 until then).",
                                 multiprocess_mode="livemax", registry=r),
        heal=Gauge("elastic_heal_seconds",
                   "In place: this worker's last re-formation, from the failure (or its start, for a joiner) "
                   "to standing on the agreed step with its group reconfigured.",
                   multiprocess_mode="livemax", registry=r),
        restores=Counter("elastic_restores_total",
                         "Times this worker took its state from somewhere: a snapshot on disk, a live replica "
                         "(healed in place), peer copies in memory (FSDP across every node, re-cut in place), "
                         "its own copy in its node agent's memory (a restart), or nowhere (a fresh start).", ("source",), registry=r),
        sdc_mismatches=Counter("elastic_sdc_mismatches_total",
                               "Replica consistency checks that named this node (rank 0 counts, labelled by the "
                               "node named): silent data corruption suspected.", ("node",), registry=r),
        heal_bytes=Counter("elastic_heal_bytes_total",
                           "State bytes this worker sent to or received from a live replica when healing.",
                           registry=r),
        # peer copies (elastic.inplace.peer_copies): each rank's state in a buddy's host memory
        peer_copy=Gauge("elastic_peer_copy_seconds",
                        "This worker's last peer copy: its state copied to host memory and exchanged with its "
                        "buddies on another node (the time it took out of the step).",
                        multiprocess_mode="livemax", registry=r),
        peer_copy_bytes=Counter("elastic_peer_copy_bytes_total",
                                "State bytes this worker sent to its buddy and received from the ranks it keeps "
                                "copies for.", registry=r),
        peer_copy_lag=Gauge("elastic_peer_copy_lag_steps",
                            "Steps this worker trained since its newest complete copy reached its buddy.",
                            multiprocess_mode="livemax", registry=r),
        peer_copy_host=Gauge("elastic_peer_copy_host_bytes",
                             "Host memory this worker holds in peer copies (its own and its buddies').",
                             multiprocess_mode="livesum", registry=r),
    )
