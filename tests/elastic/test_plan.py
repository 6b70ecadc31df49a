"""``elastic.plan``: how a rank's batches are loaded."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, default_collate
from torch.utils.data._utils.pin_memory import pin_memory

from elastic.distributed import ElasticRunError
from elastic.plan import _pinned_or_why


class _OnADevice(torch.utils.data.Dataset[torch.Tensor]):
    """Samples that live off the CPU. This machine has no GPU, so they are meta tensors,
    which torch refuses to pin with the same error as CUDA ones."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.empty(2, device="meta")


def _pinning(batch: list[Any]) -> Any:
    return pin_memory(default_collate(batch))  # what a pinning DataLoader does to each batch on CUDA


def test_samples_that_cannot_be_pinned_get_one_line_saying_how_to_fix_it() -> None:
    loader = DataLoader(_OnADevice(), batch_size=2, collate_fn=_pinning)
    with pytest.raises(ElasticRunError, match=r"already on the GPU.*pin_memory=False"):
        list(_pinned_or_why(loader, pin=True))


def test_other_loader_errors_pass_through_unchanged() -> None:
    def broken(batch: list[Any]) -> Any:
        raise RuntimeError("the user's collate_fn failed")

    with pytest.raises(RuntimeError, match="the user's collate_fn failed"):
        list(_pinned_or_why(DataLoader(_OnADevice(), batch_size=2, collate_fn=broken), pin=True))
