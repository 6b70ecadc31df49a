"""The elastic sampler: which samples each rank trains on, for any sequence of world sizes.

An epoch's order is a permutation fixed by ``(seed, epoch)``. The only mutable state is the
*global cursor*: how many samples of this epoch completed steps have consumed. A step takes
the next ``global_batch_size`` samples after the cursor and splits them over the ranks of
the current world, **contiguously**, in rank order, the first ``n % world`` ranks taking
one extra (10 over 3 -> 4, 3, 3). Because the cursor is global, a restart at any world size
re-splits the rest of the epoch over the new ranks: within an epoch, committed steps consume
every sample exactly once, whatever the sequence of world sizes.

The tail: the last global batch of an epoch is short (``len % global_batch_size``
samples; there is no ``drop_last``). When it holds fewer samples than there are ranks, the
last ranks get zero samples. Rank 0 always gets at least one sample of a non-empty batch.
How a rank with zero samples still joins DDP's all-reduce is the trainer's business
(``elastic.trainer``).

State is three plain numbers (``epoch``, ``cursor``, ``seed``), never a pickle.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads (seed, epoch) over the seed space


def split_sizes(n: int, world_size: int) -> list[int]:
    """Contiguous split of ``n`` samples over ``world_size`` ranks, first ranks take the rest."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    base, extra = divmod(n, world_size)
    return [base + (1 if r < extra else 0) for r in range(world_size)]


def epoch_seed(seed: int, epoch: int) -> int:
    return (seed * _MIX + epoch) % (1 << 63)


class ElasticSampler:
    """Global-cursor sampler; ``advance()`` is called once per *committed* step."""

    def __init__(self, dataset_size: int, *, seed: int = 0, shuffle: bool = True) -> None:
        if dataset_size < 1:
            raise ValueError(f"dataset is empty (size {dataset_size}); nothing to train on")
        self.dataset_size = dataset_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.cursor = 0
        self._order: tuple[int, torch.Tensor] | None = None

    def order(self, epoch: int | None = None) -> torch.Tensor:
        """The epoch's permutation of sample ids (cached for the current epoch)."""
        epoch = self.epoch if epoch is None else epoch
        if self._order is not None and self._order[0] == epoch:
            return self._order[1]
        if self.shuffle:
            gen = torch.Generator().manual_seed(epoch_seed(self.seed, epoch))
            perm = torch.randperm(self.dataset_size, generator=gen)
        else:
            perm = torch.arange(self.dataset_size)
        self._order = (epoch, perm)
        return perm

    def global_batch(self, global_batch_size: int) -> list[int]:
        """Sample ids of the next global batch (short at the epoch's tail)."""
        if global_batch_size < 1:
            raise ValueError(f"global batch size must be >= 1, got {global_batch_size}")
        end = min(self.cursor + global_batch_size, self.dataset_size)
        return self.order()[self.cursor:end].tolist()

    def local_range(self, global_n: int, rank: int, world_size: int) -> tuple[int, int]:
        """[start, stop) of ``rank``'s share within a global batch of ``global_n`` samples."""
        sizes = split_sizes(global_n, world_size)
        start = sum(sizes[:rank])
        return start, start + sizes[rank]

    def local_batch(self, global_batch_size: int, rank: int, world_size: int) -> list[int]:
        batch = self.global_batch(global_batch_size)
        start, stop = self.local_range(len(batch), rank, world_size)
        return batch[start:stop]

    def advance(self, n: int) -> None:
        """Commit a step that consumed ``n`` samples; rolls over to the next epoch at its end."""
        if n < 1 or self.cursor + n > self.dataset_size:
            raise ValueError(f"cannot advance by {n} at cursor {self.cursor} of {self.dataset_size}")
        self.cursor += n
        if self.cursor == self.dataset_size:
            self.epoch += 1
            self.cursor = 0

    def steps_left_in_epoch(self, global_batch_size: int) -> int:
        return -(-(self.dataset_size - self.cursor) // global_batch_size)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "cursor": self.cursor, "seed": self.seed, "dataset_size": self.dataset_size}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        size = int(state["dataset_size"])
        if size != self.dataset_size:
            raise ValueError(
                f"sampler state is for a dataset of {size} samples but this dataset has "
                f"{self.dataset_size}; resume with the same data or start a new snapshot directory"
            )
        cursor = int(state["cursor"])
        if not 0 <= cursor < size:
            raise ValueError(f"sampler cursor {cursor} is outside the dataset (size {size})")
        self.epoch, self.cursor, self.seed = int(state["epoch"]), cursor, int(state["seed"])
        self._order = None
