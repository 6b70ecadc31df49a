"""Prometheus metrics of the training workers (catalogue: ``docs/metrics.md``).

Workers::

    metrics = TrainingMetrics(dist_info)      # ElasticRun does this unless metrics=False
    metrics.attach(ddp_model)                 # DDP all-reduce timing, bytes and errors (averaging;
                                              # ElasticRun passes average=False and scales its loss)
    metrics.rank_changed(rank, world_size)    # in-place recovery gave this process another rank

The node agent (multiprocess mode; no torch import on this path)::

    from elastic.metrics import prepare_dir, collector_registry, mark_dead
    root = prepare_dir(dir)                   # before workers start with PROMETHEUS_MULTIPROC_DIR=dir
    registry = collector_registry(root, stand_in)  # serve it on the node's /metrics; stand_in():
                                              # {pid: RankInfo} for workers that export no rank info
    mark_dead(pid, root)                      # for every worker pid that exited

Names are imported lazily so that the agent does not pay for torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from elastic._lazy import lazy_exports

_EXPORTS = {
    "Export": "elastic.metrics.export",
    "MetricsConfigError": "elastic.metrics.export",
    "start_export": "elastic.metrics.export",
    "families": "elastic.metrics.catalogue",
    "WorkerMetrics": "elastic.metrics.worker",
    "prepare_dir": "elastic.metrics.multiprocess",
    "collector_registry": "elastic.metrics.multiprocess",
    "mark_dead": "elastic.metrics.multiprocess",
    "CollectiveTimer": "elastic.metrics.comm_hook",
    "allreduce_hook": "elastic.metrics.comm_hook",
    "register_comm_hook": "elastic.metrics.comm_hook",
    "TrainingMetrics": "elastic.metrics.training",
    "RankInfo": "elastic.metrics.rank_info",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from .catalogue import families
    from .comm_hook import CollectiveTimer, allreduce_hook, register_comm_hook
    from .export import Export, MetricsConfigError, start_export
    from .multiprocess import collector_registry, mark_dead, prepare_dir
    from .rank_info import RankInfo
    from .training import TrainingMetrics
    from .worker import WorkerMetrics


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
