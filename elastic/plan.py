"""The data plan: which samples each rank trains on next, at whatever world size it now has.

It owns the elastic sampler (:mod:`elastic.sampler`: one global cursor per epoch) and turns
its state into this rank's batches, a ``DataLoader`` per stretch of an epoch at a fixed
world: when the world changes (a restart, or a re-formation in place) the loader is built
again from the cursor, so the rest of the epoch is re-split over the new ranks and no
sample is lost or repeated. It also keeps the sample ids of the last few committed steps,
which a new rank 0 needs to complete the ledger after a re-formation.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch.utils.data import DataLoader, Dataset

from .distributed import ElasticRunError
from .run_config import DataConfig
from .sampler import ElasticSampler, split_sizes
from .torch_untyped import pin_refused

RECENT_STEPS = 8  # ledger lines a new rank 0 may have to write after a re-formation


@dataclass(frozen=True)
class StepRecord:
    step: int
    epoch: int
    world_size: int
    samples: tuple[int, ...]


class _LocalBatches:
    """Batch sampler for one epoch from a given cursor: pure, so a DataLoader may prefetch."""

    def __init__(self, order: torch.Tensor, cursor: int, batch_size: int, rank: int, world: int) -> None:
        self.order, self.cursor, self.batch_size, self.rank, self.world = order, cursor, batch_size, rank, world

    def __iter__(self) -> Iterator[list[int]]:
        cursor, n = self.cursor, len(self.order)
        while cursor < n:
            batch = self.order[cursor:cursor + self.batch_size]
            sizes = split_sizes(len(batch), self.world)
            start = sum(sizes[:self.rank])
            local = batch[start:start + sizes[self.rank]]
            yield (local if len(local) else batch[:1]).tolist()  # stand-in sample, loss x 0
            cursor += len(batch)

    def __len__(self) -> int:
        return -(-(len(self.order) - self.cursor) // self.batch_size)


class DataPlan:
    """Sampler, batch policy and loader settings of one run."""

    def __init__(self, dataset: Dataset[Any], *, global_batch_size: int, seed: int,
                 config: DataConfig | None = None) -> None:
        config = config or DataConfig()
        self.dataset, self.global_batch_size, self.batch_policy = dataset, global_batch_size, config.batch_policy
        self.per_rank_batch_size, self.num_workers = config.per_rank_batch_size, config.num_workers
        self.collate_fn, self.pin_memory = config.collate_fn, config.pin_memory
        self.sampler = ElasticSampler(len(dataset), seed=seed)
        self.scale_lr = True  # fixed-per-rank: the linear scaling rule (elastic.prepare turns it off)
        self.recent: deque[StepRecord] = deque(maxlen=RECENT_STEPS)

    def batch_size(self, world_size: int) -> int:
        if self.batch_policy == "fixed-per-rank":
            return int(self.per_rank_batch_size) * world_size  # type: ignore[arg-type]  # DataConfig refuses the policy without it
        return self.global_batch_size

    def lr_scale(self, world_size: int) -> float:
        """fixed-per-rank: the linear scaling rule against the nominal global batch."""
        if self.batch_policy != "fixed-per-rank" or not self.scale_lr:
            return 1.0
        return self.batch_size(world_size) / self.global_batch_size

    def batches(self, rank: int, world_size: int, on_cuda: bool) -> Iterator[tuple[Any, list[int], int]]:
        """This rank's batches for the rest of the current epoch: (batch, global ids, local n).
        Pinned when training on CUDA unless the config says not to."""
        size = self.batch_size(world_size)
        pin = on_cuda and self.pin_memory is not False
        loader = DataLoader(self.dataset, batch_sampler=_LocalBatches(self.sampler.order(), self.sampler.cursor,
                                                                      size, rank, world_size),
                            num_workers=self.num_workers, collate_fn=self.collate_fn, pin_memory=pin)
        for batch in _pinned_or_why(loader, pin):
            ids = self.sampler.global_batch(size)  # the loader's batch is this rank's share of these
            start, stop = self.sampler.local_range(len(ids), rank, world_size)
            yield batch, ids, stop - start

    def next_ids(self, world_size: int) -> list[int]:
        return self.sampler.global_batch(self.batch_size(world_size))

    @staticmethod
    def loss_scale(local_n: int, global_n: int, world_size: int, ddp_averages: bool) -> float:
        """So that the sum over ranks is the mean over the global batch (uneven splits too)."""
        return local_n * (world_size if ddp_averages else 1) / global_n

    def commit(self, step: int, ids: list[int], world_size: int) -> None:
        """A step that consumed ``ids`` completed: move the cursor and remember the step."""
        self.recent.append(StepRecord(step, self.sampler.epoch, world_size, tuple(ids)))
        self.sampler.advance(len(ids))

    # ------------------------------------------------------------------ travels with a heal

    def recent_state(self) -> list[list[Any]]:
        return [[r.step, r.epoch, r.world_size, list(r.samples)] for r in self.recent]

    def load_recent(self, rows: list[list[Any]]) -> None:
        self.recent = deque((StepRecord(int(s), int(e), int(w), tuple(int(i) for i in ids)) for s, e, w, ids in rows),
                            maxlen=RECENT_STEPS)


def _pinned_or_why(loader: DataLoader[Any], pin: bool) -> Iterator[Any]:
    """The loader's batches; a dataset that yields CUDA tensors into a pinning loader gets one
    line saying how to fix it instead of the DataLoader's own "cannot pin" error."""
    try:
        yield from loader
    except RuntimeError as exc:
        if not pin or not pin_refused(exc):  # torch's untyped refusal, read in elastic/torch_untyped.py
            raise
        raise ElasticRunError("the dataset yields tensors that are already on the GPU, which cannot be pinned: "
                              "give DataLoader(pin_memory=False) (the prepare API keeps it) or "
                              "ElasticRun(data=DataConfig(pin_memory=False))") from exc
