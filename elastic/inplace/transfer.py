"""Sending a whole training state from one live rank to another over the process group.

A joiner (or a rank that stands on another step) gets model, optimizer, scheduler, scaler,
sampler, progress and RNG state from a survivor: no disk. The structure travels as the
snapshot writer's tagged JSON (:mod:`checkpoints.wire`: dict vs OrderedDict, tuple vs
list and key types come back exactly, and nothing is unpickled), the tensors as a few
large flat byte buffers, so a 300 MB state costs a handful of sends rather than hundreds.

The receiver needs nothing in advance: a fresh optimizer has no state tensors yet, so
shapes and dtypes come in the header.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist

from checkpoints.wire import decode, encode

BUCKET_BYTES = 64 << 20
_ALIGN = 64


def _padded(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _buckets(sizes: list[int]) -> list[list[int]]:
    """Tensor indices grouped so that each group's padded bytes stay near ``BUCKET_BYTES``."""
    groups: list[list[int]] = [[]]
    filled = 0
    for index, nbytes in enumerate(sizes):
        if nbytes == 0:
            continue
        if groups[-1] and filled + _padded(nbytes) > BUCKET_BYTES:
            groups.append([])
            filled = 0
        groups[-1].append(index)
        filled += _padded(nbytes)
    return [g for g in groups if g]


def send_state(state: Any, dst: int, device: torch.device) -> int:
    """Send ``state`` to rank ``dst``; returns the tensor bytes sent."""
    tensors: list[torch.Tensor] = []

    def index(t: torch.Tensor) -> int:
        tensors.append(t.detach())
        return len(tensors) - 1

    tree = encode(state, index)
    header = json.dumps({"tree": tree, "tensors": [[str(t.dtype).removeprefix("torch."), list(t.shape)]
                                                    for t in tensors]}).encode()
    dist.send(torch.tensor([len(header)], dtype=torch.int64, device=device), dst)
    dist.send(torch.frombuffer(bytearray(header), dtype=torch.uint8).to(device), dst)
    sizes = [t.numel() * t.element_size() for t in tensors]
    sent = 0
    for group in _buckets(sizes):
        buffer = torch.empty(sum(_padded(sizes[i]) for i in group), dtype=torch.uint8, device=device)
        offset = 0
        for i in group:
            flat = tensors[i].contiguous().reshape(-1).view(torch.uint8)
            buffer[offset:offset + sizes[i]].copy_(flat, non_blocking=True)
            offset += _padded(sizes[i])
        dist.send(buffer, dst)
        sent += sum(sizes[i] for i in group)
    return sent


def recv_state(src: int, device: torch.device) -> Any:
    """Receive what :func:`send_state` sent; tensors land on ``device``."""
    length = torch.zeros(1, dtype=torch.int64, device=device)
    dist.recv(length, src)
    raw = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    dist.recv(raw, src)
    header = json.loads(raw.cpu().numpy().tobytes())
    specs = [(getattr(torch, dtype), tuple(shape)) for dtype, shape in header["tensors"]]
    sizes = [torch.empty(0, dtype=dtype).element_size() * _numel(shape) for dtype, shape in specs]
    tensors: list[torch.Tensor] = [torch.empty(shape, dtype=dtype, device=device) for dtype, shape in specs]
    for group in _buckets(sizes):
        buffer = torch.empty(sum(_padded(sizes[i]) for i in group), dtype=torch.uint8, device=device)
        dist.recv(buffer, src)
        offset = 0
        for i in group:
            dtype, shape = specs[i]
            # its own storage: some consumers (torch.set_rng_state) misread a view into a larger buffer
            tensors[i] = buffer[offset:offset + sizes[i]].view(dtype).reshape(shape).clone()
            offset += _padded(sizes[i])
    return decode(header["tree"], tensors)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
