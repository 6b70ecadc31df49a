"""Fault-tolerant elastic training for PyTorch.

Public API (imported lazily: torchrun loads ``agent.rendezvous.entrypoint`` while torch
itself is still importing, so this module must not import torch.distributed up front)::

    import elastic
    run = elastic.ElasticRun(model, optimizer, dataset, global_batch_size=64, epochs=10,
                             snapshot_dir="/shared/ckpt/job1")
    ft = elastic.Elastic(snapshot_dir="/shared/ckpt/job1")   # or keep your own loop:
    model, optimizer, loader = ft.prepare(model, optimizer, loader)
    elastic.report_progress(step)  # a loop of your own: tells the agent's hang watchdog
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from elastic import old_paths
from elastic._lazy import lazy_exports

old_paths.install()  # ``elastic.rendezvous`` & co. from before 0.1.0's folder split

_EXPORTS = {
    "ElasticRun": "elastic.trainer",
    "Elastic": "elastic.prepare",
    "prepare": "elastic.prepare",
    "StepInfo": "elastic.trainer",
    "SnapshotConfig": "elastic.run_config",
    "DataConfig": "elastic.run_config",
    "StepResult": "elastic.step_result",
    "Holder": "elastic.user_state",
    "ElasticSampler": "elastic.sampler",
    "split_sizes": "elastic.sampler",
    "ElasticRunError": "elastic.distributed",
    "DistInfo": "elastic.distributed",
    "init_distributed": "elastic.distributed",
    "Ledger": "elastic.ledger",
    "LedgerReport": "elastic.ledger",
    "check_ledger": "elastic.ledger",
    "read_ledger": "elastic.ledger",
    "report_progress": "elastic.progress",  # no torch import: any training loop may call it
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from .distributed import DistInfo, ElasticRunError, init_distributed
    from .ledger import Ledger, LedgerReport, check_ledger, read_ledger
    from .progress import report_progress
    from .run_config import DataConfig, SnapshotConfig
    from .sampler import ElasticSampler, split_sizes
    from .step_result import StepResult
    from .user_state import Holder
    from .trainer import ElasticRun, StepInfo
    from .prepare import Elastic, prepare


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
