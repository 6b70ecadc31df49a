"""A small MLP classifier on a synthetic dataset that is a pure function of the seed.

Labels come from a fixed random teacher network, so the loss really goes down; dropout and
AdamW are there on purpose: they make bitwise resume depend on RNG and optimizer state.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

from .job import Job

IN_FEATURES, HIDDEN, CLASSES = 16, 64, 4
DEFAULT_SIZE = 1024


class SyntheticClassification(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """``dataset[i]`` is sample id ``i``.

    ``__getitems__`` lets the DataLoader fetch a whole batch with one index operation; it
    returns ``(x, y)`` already stacked, so pair it with :func:`as_batch` as ``collate_fn``.
    """

    def __init__(self, size: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(size, IN_FEATURES, generator=gen)
        teacher = torch.randn(IN_FEATURES, CLASSES, generator=gen)
        self.y = (self.x @ teacher).argmax(dim=1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]

    def __getitems__(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.tensor(ids)
        return self.x[idx], self.y[idx]


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(IN_FEATURES, HIDDEN), nn.ReLU(), nn.Dropout(0.1),
        nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES),
    )


def loss(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def _adamw(params: Iterable[nn.Parameter], lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.01)


def as_batch(items: Any) -> Any:
    """The collate_fn for this dataset: ``__getitems__`` already returns ``(x, y)`` stacked."""
    return items


def build(*, seed: int, dataset_size: int | None = None) -> Job:
    torch.manual_seed(seed)
    model = make_model()
    dataset = SyntheticClassification(dataset_size or DEFAULT_SIZE, seed)
    return Job("mlp", model, dataset, loss, _adamw, default_lr=1e-3, collate_fn=as_batch)
