"""What a job is: the record the runner trains (apart from the package, which imports the
jobs, so that a job can import this without importing its package back)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable

if TYPE_CHECKING:  # the runner parses its flags before paying for ``import torch``
    import torch
    from torch import nn
    from torch.utils.data import Dataset

@dataclass(frozen=True)
class Job:
    name: str
    model: "nn.Module"
    dataset: "Dataset[Any]"
    loss: "Callable[[nn.Module, Any], torch.Tensor]"  # (model, batch) -> mean loss over the batch
    make_optimizer: "Callable[[Iterable[nn.Parameter], float], torch.optim.Optimizer]"
    default_lr: float
    collate_fn: Callable[[list[Any]], Any] | None = None
