"""Staging memory that the writer process can read: one anonymous shared file per layout.

The capture copies live tensors into these buffers; the writer process maps the same
pages and serialises from them, so the bytes cross the process boundary without a copy.
``memfd_create`` is used rather than ``/dev/shm``: it is not capped by a container's
small ``/dev/shm`` and leaves nothing behind when both processes die. Each tensor gets
its own storage (``torch.frombuffer`` with an offset), so ``torch.save`` of one view
writes that tensor's bytes, not the whole arena.
"""

from __future__ import annotations

import mmap
import os
from typing import Sequence

import torch

_ALIGN = 64

Spec = tuple[int, str, tuple[int, ...]]  # (offset, dtype name, shape)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def _view(buf: mmap.mmap, offset: int, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    numel = 1
    for n in shape:
        numel *= n
    if numel == 0:  # frombuffer refuses count=0; an empty tensor has no bytes to share
        return torch.empty(tuple(shape), dtype=dtype)
    return torch.frombuffer(buf, dtype=dtype, count=numel, offset=offset).view(tuple(shape))


class Arena:
    """Contiguous buffers for ``layout`` ((dtype, shape) per tensor) in one shared mapping."""

    def __init__(self, layout: Sequence[tuple[torch.dtype, tuple[int, ...]]]) -> None:
        specs: list[Spec] = []
        size = 0
        for dtype, shape in layout:
            size = -(-size // _ALIGN) * _ALIGN
            specs.append((size, dtype_name(dtype), tuple(shape)))
            numel = 1
            for n in shape:
                numel *= n
            size += numel * dtype.itemsize
        self.size = max(size, _ALIGN)  # mmap refuses an empty file
        self.specs = specs
        self.fd = os.memfd_create("snapshot-staging", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, self.size)
            self._map = mmap.mmap(self.fd, self.size)
        except BaseException:
            os.close(self.fd)
            raise
        self.views = [_view(self._map, off, parse_dtype(dt), shape) for off, dt, shape in specs]

    def close_fd(self) -> None:
        """The writer process has its own mapping now; the mapping here keeps the pages."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:  # an arena never sent to a writer (a host copy no snapshot took)
        try:
            self.close_fd()
        except (OSError, AttributeError, TypeError):  # (TypeError: at interpreter exit)
            pass


def map_arena(fd: int, size: int, specs: Sequence[Spec]) -> list[torch.Tensor]:
    """The writer process's side: views onto the pages behind ``fd`` (closed afterwards)."""
    try:
        buf = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    return [_view(buf, int(off), parse_dtype(dt), [int(n) for n in shape]) for off, dt, shape in specs]
