"""Consistent capture of training state into reusable staging buffers.

The expensive part of a snapshot's blocking phase is not memcpy (~10 GB/s here) but
allocating fresh memory (a plain ``clone()`` of 300 MB runs at ~0.9 GB/s because every
page faults). So buffers are kept while the state's layout (dtype, shape, device of each
tensor, in order) stays the same, and reused; big CPU tensors are copied on the writer
thread while the next forward/backward runs; small tensors (BatchNorm running stats,
Adam's ``step``) are copied right away because forward mutates them; CUDA tensors go to
pinned buffers with non_blocking copies on one side stream plus one event.

With ``shared=True`` the buffers live in an :class:`~checkpoints.arena.Arena` that the
writer process maps, so nothing is copied again to hand the state over.

``frozen`` tensors are taken as they are, not copied: a complete host copy that nothing
writes to again (a peer copy's, :mod:`elastic.inplace.peer_copies`), so a snapshot of
its step needs no second copy of its bytes. With ``shared=True`` only the views of the
``donor`` arena (a host copy made in shared memory) can be taken so; any other is copied.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from .arena import Arena
from .errors import SnapshotError
from .tree import map_state

Layout = tuple[tuple[torch.dtype, tuple[int, ...], bool], ...]  # (dtype, shape, is_cuda) per tensor


@dataclass
class Capture:
    staged: dict[str, Any]  # same structure as the submitted state, tensors replaced by buffers
    pending: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (dst, src)
    hops: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (arena, pinned) after the device copies
    cuda_event: Any = None  # torch.cuda.Event recorded after the device->host copies
    nbytes: int = 0
    arena: Arena | None = None
    donor: Arena | None = None  # a host copy's own shared memory, whose views are taken as they are
    frozen_bytes: int = 0  # of nbytes, those taken without a copy

    def finish_copies(self) -> None:
        """Run on the writer thread: the CPU copies, then wait for the device copies."""
        for dst, src in self.pending:
            copy_tensor(dst, src)
        self.pending.clear()  # drop references to live tensors as soon as they are copied
        if self.cuda_event is not None:
            self.cuda_event.synchronize()
        for dst, src in self.hops:
            copy_tensor(dst, src)
        self.hops.clear()


# Below torch's parallel grain size (32768 elements) a copy runs inline on the calling
# thread. A big copy_ from the writer thread would otherwise start a second OpenMP team
# that fights the training thread's team for the same cores (both spin-wait), which
# slows training far more than the copy's own CPU time.
_SERIAL_CHUNK = 32768


def copy_tensor(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy on this thread alone, holding the GIL as little as possible.

    A dense CPU tensor goes in one ``memmove`` through ctypes, which releases the GIL for
    the whole copy (a chunked ``copy_`` takes the GIL back ~30 times per MB, and each time
    the training thread may have to wait for it). Anything else is copied in chunks below
    torch's parallel grain size.
    """
    nbytes = src.numel() * src.element_size()
    if (
        nbytes
        and src.device.type == "cpu"
        and src.dtype == dst.dtype
        and src.is_contiguous()
        and dst.is_contiguous()
        and not (src.is_conj() or src.is_neg())
    ):
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes)
        return
    if not (dst.is_contiguous() and src.is_contiguous()) or src.numel() <= _SERIAL_CHUNK:
        dst.copy_(src)
        return
    d, s = dst.view(-1), src.view(-1)
    for i in range(0, d.numel(), _SERIAL_CHUNK):
        d[i : i + _SERIAL_CHUNK].copy_(s[i : i + _SERIAL_CHUNK])


class Stager:
    """Owns the staging buffers; ``shared`` puts them where a writer process can read them."""

    def __init__(self, sync_copy_max_bytes: int = 1 << 20, *, shared: bool = False) -> None:
        self.sync_copy_max_bytes = sync_copy_max_bytes
        self.shared = shared
        self._layout: Layout | None = None
        self._buffers: list[torch.Tensor] = []  # what the capture hands on (arena views when shared)
        self._pinned: list[torch.Tensor | None] = []  # device->host landing buffers when shared
        self._arena: Arena | None = None
        self._stream: Any = None
        self._lock = threading.Lock()

    def release(self) -> None:
        with self._lock:
            self._set_buffers(None, [], [], None)

    def _set_buffers(
        self, layout: Layout | None, buffers: list[torch.Tensor], pinned: list[torch.Tensor | None], arena: Arena | None
    ) -> None:
        if self._arena is not None and self._arena is not arena:
            self._arena.close_fd()  # its pages go when the last view does
        self._layout, self._buffers, self._pinned, self._arena = layout, buffers, pinned, arena

    def _allocate(self, layout: Layout) -> None:
        if layout == self._layout:
            return
        pinned: list[torch.Tensor | None] = []
        arena = None
        if self.shared:
            arena = Arena([(dtype, shape) for dtype, shape, _ in layout])
            buffers = arena.views
            pinned = [torch.empty(shape, dtype=dtype, pin_memory=True) if cuda else None for dtype, shape, cuda in layout]
        else:  # pinned host memory makes the device->host copy truly async
            buffers = [torch.empty(shape, dtype=dtype, pin_memory=cuda) for dtype, shape, cuda in layout]
        self._set_buffers(layout, buffers, pinned, arena)

    def stage(self, state: Mapping[str, Any], frozen: Sequence[torch.Tensor] = (),
              donor: Arena | None = None) -> Capture:
        """Blocking part of a snapshot: fresh containers, small copies, CUDA copy launches;
        ``frozen`` tensors (see the module's doc) taken as they are."""
        for k in state:
            if not isinstance(k, str):
                raise SnapshotError(f"top-level state key {k!r} is not a str; name each part, e.g. {{'model': ...}}")
        takeable = {id(t) for t in frozen if t.device.type == "cpu"}
        if self.shared:  # the writer process reads only shared memory: the donor's views
            takeable &= {id(v) for v in donor.views} if donor is not None else set()
        sources: list[torch.Tensor] = []
        taken: list[torch.Tensor | None] = []  # per tensor: itself when frozen, else None

        def collect(t: torch.Tensor, where: str) -> None:
            if t.layout != torch.strided or t.is_quantized:
                raise SnapshotError(f"{where} has layout {t.layout}; only dense tensors are supported")
            taken.append(t if id(t) in takeable else None)
            if id(t) not in takeable:
                sources.append(t.detach())

        map_state(dict(state), collect)
        capture = Capture(staged={})
        if any(t is not None for t in taken):
            capture.donor = donor if self.shared else None
        device_copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        with self._lock:
            self._allocate(tuple((t.dtype, tuple(t.shape), t.is_cuda) for t in sources))
            capture.arena = self._arena
            index = iter(range(len(sources)))
            each = iter(taken)

            def leaf(_t: torch.Tensor, _where: str) -> torch.Tensor:
                as_is = next(each)
                if as_is is not None:
                    size = as_is.numel() * as_is.element_size()
                    capture.nbytes += size
                    capture.frozen_bytes += size
                    return as_is
                i = next(index)
                src, buf = sources[i], self._buffers[i]
                size = src.numel() * src.element_size()
                capture.nbytes += size
                if src.is_cuda:
                    landing = self._pinned[i] if self.shared else buf
                    assert landing is not None
                    device_copies.append((landing, src))
                    if self.shared:
                        capture.hops.append((buf, landing))
                elif size <= self.sync_copy_max_bytes:
                    buf.copy_(src)
                else:
                    capture.pending.append((buf, src))
                return buf

            capture.staged = {k: map_state(v, leaf, f"state[{k!r}]") for k, v in state.items()}
            if device_copies:
                capture.cuda_event = self._launch_device_copies(device_copies)
        return capture

    def _launch_device_copies(self, copies: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        stream = self._stream
        # The copies must see every kernel already queued on the training stream...
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for dst, src in copies:
                dst.copy_(src, non_blocking=True)
                src.record_stream(stream)  # ...and the allocator must not reuse src meanwhile
            event = torch.cuda.Event()
            event.record(stream)
        return event
