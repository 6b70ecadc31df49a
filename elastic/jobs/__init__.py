"""Example jobs for the runner: a model, a dataset whose sample id is its index, a loss.

``mlp`` is a small deterministic classification problem that trains in seconds on a CPU
(the tests use it); ``resnet`` is torchvision's ResNet-18 on FakeData or an ImageFolder.
"""

from __future__ import annotations

from .job import Job

JOBS = ("mlp", "resnet", "resnet50")


def build_job(name: str, *, seed: int, dataset_size: int | None = None, data: str | None = None,
              image_size: int = 64) -> Job:
    """Model weights come from ``seed``, so every rank (and every restart) builds the same one."""
    if name == "mlp":
        from .mlp import build
        return build(seed=seed, dataset_size=dataset_size)
    if name in ("resnet", "resnet50"):
        from .resnet import build as build_resnet
        return build_resnet(seed=seed, dataset_size=dataset_size, data=data, image_size=image_size,
                            depth=50 if name == "resnet50" else 18)
    raise ValueError(f"unknown job {name!r}; choose one of {', '.join(JOBS)}")


__all__ = ["JOBS", "Job", "build_job"]
