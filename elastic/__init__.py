"""Fault-tolerant elastic training for PyTorch.

Public API (imported lazily: torchrun loads ``elastic.rendezvous.entrypoint`` while torch
itself is still importing, so this module must not import torch.distributed up front)::

    import elastic
    run = elastic.ElasticRun(model, optimizer, dataset, global_batch_size=64, epochs=10,
                             snapshot_dir="/shared/ckpt/job1")
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "ElasticRun": "elastic.trainer",
    "StepInfo": "elastic.trainer",
    "ElasticSampler": "elastic.sampler",
    "split_sizes": "elastic.sampler",
    "ElasticRunError": "elastic.distributed",
    "DistInfo": "elastic.distributed",
    "init_distributed": "elastic.distributed",
    "Ledger": "elastic.ledger",
    "LedgerReport": "elastic.ledger",
    "check_ledger": "elastic.ledger",
    "read_ledger": "elastic.ledger",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from .distributed import DistInfo, ElasticRunError, init_distributed
    from .ledger import Ledger, LedgerReport, check_ledger, read_ledger
    from .sampler import ElasticSampler, split_sizes
    from .trainer import ElasticRun, StepInfo


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'elastic' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
