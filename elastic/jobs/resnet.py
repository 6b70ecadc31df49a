"""ResNet-18 + SGD (``resnet``) or ResNet-50 + Adam (``resnet50``: 307 MB of training state,
the size the heal benchmarks move), torchvision, random init, on FakeData or an ImageFolder.

FakeData draws image ``i`` from a generator seeded by ``i``, so sample ``i`` is the same
picture on every rank and after every restart, and nothing is downloaded.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn
from torch.nn import functional as F

from .job import Job

DEFAULT_SIZE, CLASSES = 2048, 10


def loss(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def _sgd(params: Iterable[nn.Parameter], lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=1e-4)


def _adam(params: Iterable[nn.Parameter], lr: float) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=lr)


def build(*, seed: int, dataset_size: int | None = None, data: str | None = None, image_size: int = 64,
          depth: int = 18) -> Job:
    from torchvision import datasets, models, transforms

    to_tensor = transforms.Compose([
        transforms.Resize(image_size), transforms.CenterCrop(image_size), transforms.ToTensor(),
    ])
    if data:
        dataset: Any = datasets.ImageFolder(data, transform=to_tensor)
        classes = len(dataset.classes)
    else:
        classes = CLASSES
        dataset = datasets.FakeData(
            size=dataset_size or DEFAULT_SIZE, image_size=(3, image_size, image_size),
            num_classes=classes, transform=transforms.ToTensor(), random_offset=seed,
        )
    torch.manual_seed(seed)
    if depth == 50:
        return Job("resnet50", models.resnet50(weights=None, num_classes=classes), dataset, loss, _adam,
                   default_lr=1e-3)
    model = models.resnet18(weights=None, num_classes=classes)
    return Job("resnet", model, dataset, loss, _sgd, default_lr=0.1)
