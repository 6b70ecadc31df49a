"""Each step's RNG seed, from ``(seed, step, rank)``: dropout and augmentation do not depend on
restarts, re-formations or which process trains a rank."""

from __future__ import annotations

import random
import sys

import torch

from .sampler import epoch_seed


def step_seed(seed: int, step: int, rank: int) -> int:
    return epoch_seed(epoch_seed(seed, step), rank)


def seed_everything(seed: int) -> None:
    """torch (CPU and CUDA), Python's ``random`` and NumPy's global RNG, if NumPy is loaded.

    Not ``torch.manual_seed``: on a machine without CUDA it also queues a lazy CUDA, XPU and
    MTIA seeding, each with a formatted stack trace, every call (0.75 ms per step, 2 % of a
    small CPU step). Devices other than CPU and CUDA are not trained on here.
    """
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)  # immediate once CUDA is initialised, as it is by the first step
    random.seed(seed)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(seed % (1 << 32))


__all__ = ["seed_everything", "step_seed"]
