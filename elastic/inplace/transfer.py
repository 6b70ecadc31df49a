"""Sending a whole training state from one live rank to another over the process group.

A joiner (or a rank that stands on another step) gets model, optimizer, scheduler, scaler,
sampler, progress and RNG state from a survivor: no disk. The structure travels as the
snapshot writer's tagged JSON (:mod:`checkpoints.wire`: dict vs OrderedDict, tuple vs
list and key types come back exactly, and nothing is unpickled), the tensors behind it.

The receiver needs nothing in advance: a fresh optimizer has no state tensors yet, so
shapes and dtypes come in the header. What costs time is copying, not framing, so:

* tensors of ``DIRECT_BYTES`` or more travel as they are: sent from the sender's own
  memory and received into their final tensor, no copy on either side;
* the many small ones (biases, norms, RNG states, step counters) are packed into a few
  buckets, so that they cost a handful of messages rather than hundreds;
* every send and receive is posted at once (``isend``/``irecv``), so packing the next
  bucket overlaps the wire, and gloo keeps the pair busy.

Both ends go over a :class:`~.heal_link.Wire`: the world's group by default, or a group of
the heal's own on the interface the operator chose (:mod:`.heal_link`).
"""

from __future__ import annotations

import json
from typing import Any

import torch

from checkpoints.wire import decode, encode
from .heal_link import GroupWire, Wire

BUCKET_BYTES = 32 << 20
DIRECT_BYTES = 1 << 20
_ALIGN = 64


def _padded(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def plan(sizes: list[int]) -> tuple[list[int], list[list[int]]]:
    """(indices sent directly, buckets of indices packed together), the same on both sides."""
    direct = [i for i, n in enumerate(sizes) if n >= DIRECT_BYTES]
    groups: list[list[int]] = [[]]
    filled = 0
    for index, nbytes in enumerate(sizes):
        if nbytes == 0 or nbytes >= DIRECT_BYTES:
            continue
        if groups[-1] and filled + _padded(nbytes) > BUCKET_BYTES:
            groups.append([])
            filled = 0
        groups[-1].append(index)
        filled += _padded(nbytes)
    return direct, [g for g in groups if g]


def send_state(state: Any, dst: int, device: torch.device, wire: Wire | None = None) -> int:
    """Send ``state`` to rank ``dst`` over ``wire`` (default: the world's group, tensors on
    ``device``); returns the tensor bytes sent."""
    wire = wire or GroupWire(device, "")
    device = wire.device
    tensors: list[torch.Tensor] = []

    def index(t: torch.Tensor) -> int:
        tensors.append(t.detach())
        return len(tensors) - 1

    tree = encode(state, index)
    header = json.dumps({"tree": tree, "tensors": [[str(t.dtype).removeprefix("torch."), list(t.shape)]
                                                    for t in tensors]}).encode()
    wire.send(torch.tensor([len(header)], dtype=torch.int64, device=device), dst)
    wire.send(torch.frombuffer(bytearray(header), dtype=torch.uint8).to(device), dst)
    sizes = [t.numel() * t.element_size() for t in tensors]
    direct, buckets = plan(sizes)
    works, keep = [], []  # keep: the buffers stay alive until their sends complete
    for group in buckets:
        buffer = torch.empty(sum(_padded(sizes[i]) for i in group), dtype=torch.uint8, device=device)
        offset = 0
        for i in group:
            buffer[offset:offset + sizes[i]].copy_(tensors[i].contiguous().reshape(-1).view(torch.uint8))
            offset += _padded(sizes[i])
        keep.append(buffer)
        works.append(wire.isend(buffer, dst))
    for i in direct:
        keep.append(tensors[i].contiguous().reshape(-1).to(device))
        works.append(wire.isend(keep[-1], dst))
    for work in works:
        work.wait()
    return sum(sizes)


def recv_state(src: int, device: torch.device, wire: Wire | None = None) -> Any:
    """Receive what :func:`send_state` sent; tensors land on the wire's device (default: the
    world's group, ``device``), each in its own storage."""
    wire = wire or GroupWire(device, "")
    device = wire.device
    length = torch.zeros(1, dtype=torch.int64, device=device)
    wire.recv(length, src)
    raw = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    wire.recv(raw, src)
    header = json.loads(raw.cpu().numpy().tobytes())
    specs = [(getattr(torch, dtype), tuple(shape)) for dtype, shape in header["tensors"]]
    tensors = [torch.empty(shape, dtype=dtype, device=device) for dtype, shape in specs]
    sizes = [t.numel() * t.element_size() for t in tensors]
    direct, buckets = plan(sizes)
    buffers = [torch.empty(sum(_padded(sizes[i]) for i in group), dtype=torch.uint8, device=device)
               for group in buckets]
    works = [wire.irecv(buffer, src) for buffer in buffers]
    works += [wire.irecv(tensors[i].reshape(-1), src) for i in direct]
    for work in works[:len(buffers)]:
        work.wait()
    for buffer, group in zip(buffers, buckets):  # unpacked while the large tensors still arrive
        offset = 0
        for i in group:
            tensors[i].reshape(-1).view(torch.uint8).copy_(buffer[offset:offset + sizes[i]])
            offset += _padded(sizes[i])
    for work in works[len(buffers):]:
        work.wait()
    return decode(header["tree"], tensors)
