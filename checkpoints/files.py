"""One snapshot file: torch.save'd with its sha256 computed on the bytes as they hit the disk.

Hashing the stream being written (rather than re-reading the file) avoids a second pass
over hundreds of MB; the hash runs on a helper thread in parallel with the write, since
both release the GIL, so it costs little on top of the disk (see docs/checkpoints.md).

Writeback starts as the bytes arrive (``sync_file_range(SYNC_FILE_RANGE_WRITE)`` on each
piece, Linux): otherwise the kernel holds the whole file dirty until the final fsync, and
the disk idles while the CPU serialises and hashes, then the CPU idles while the disk
writes. The fsync at the end is unchanged, so durability does not depend on it.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import io
import os
from pathlib import Path
from typing import Any, Iterator

from .layout import set_thread_nice
from .workers import DaemonPool

_READ_CHUNK = 8 << 20
_PARALLEL_HASH_MIN = 256 << 10
_PIECE = 8 << 20  # hash, write and start writeback in pieces this size
_SYNC_FILE_RANGE_WRITE = 2


def _load_sync_file_range() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _load_sync_file_range()


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing this range now, without waiting (best effort)."""
    if _sync_file_range is not None:
        _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


def torch_version() -> str:
    """The running torch's version, for a manifest (torch imported only by whoever writes one:
    the store's readers, ``elastic local``'s view among them, never pay for it)."""
    import torch

    return str(torch.__version__)


def save_into(obj: Any, sink: Any) -> None:
    """``torch.save`` into ``sink`` without the zip records' CRC32 (:func:`_without_zip_crc32`)."""
    import torch

    with _without_zip_crc32():
        torch.save(obj, sink)


@contextlib.contextmanager
def _without_zip_crc32() -> Iterator[None]:
    """torch.save without its per-record CRC32: a sixth of the writer's CPU, for nothing.

    torch.load never checks those CRCs, and the manifest's sha256 covers every byte. The
    setting is per thread (a ContextVar in torch's config), so it is made here, on the
    thread that saves, not once per process.
    """
    import torch

    get = getattr(torch.serialization, "get_crc32_options", None)
    set_ = getattr(torch.serialization, "set_crc32_options", None)
    if get is None or set_ is None:  # torch < 2.5 always computes them
        yield
        return
    prior = get()
    set_(False)
    try:
        yield
    finally:
        set_(prior)


class _HashingWriter:
    """File-like sink for torch.save that hashes and writes each chunk, remembering OS errors.

    torch.save wraps an exception from ``write`` in a RuntimeError; we keep the original
    OSError so ENOSPC can be reported as a full disk rather than an enforce failure.
    """

    def __init__(self, fd: int, hasher_pool: DaemonPool, nice: int | None) -> None:
        self._fd = fd
        self._nice = nice
        self._pool = hasher_pool
        self.sha = hashlib.sha256()
        self.size = 0
        self.os_error: OSError | None = None

    def write(self, data: Any) -> int:
        mv = memoryview(data).cast("B")
        for start in range(0, mv.nbytes, _PIECE):
            self._write_piece(mv[start : start + _PIECE])
        return mv.nbytes

    def _write_piece(self, mv: memoryview) -> None:
        fut = self._pool.submit(self._hash, mv) if mv.nbytes >= _PARALLEL_HASH_MIN else None
        try:
            if fut is None:
                self.sha.update(mv)
            off = 0
            while off < mv.nbytes:
                off += os.write(self._fd, mv[off:])
        except OSError as e:
            self.os_error = e
            raise
        finally:
            if fut is not None:
                fut.result()  # the chunk's memory is only valid until we return
        if mv.nbytes >= _PARALLEL_HASH_MIN:
            start_writeback(self._fd, self.size, mv.nbytes)
        self.size += mv.nbytes

    def _hash(self, mv: memoryview) -> None:
        if self._nice is not None:
            set_thread_nice(self._nice)
        self.sha.update(mv)

    def flush(self) -> None:
        pass


def write_file(
    path: Path, obj: Any, hasher_pool: DaemonPool, nice: int | None = 0, *, overwrite: bool = False
) -> tuple[int, str]:
    """Write ``obj`` to a new file at ``path``, fsync it; return (size, sha256 hex).

    ``nice`` is the submitting thread's niceness, applied to the pool threads doing the
    work, so a background writer's deprioritisation is not lost in a thread pool; None
    leaves thread priorities alone (the writer process, whose priority is set from outside).

    ``overwrite`` writes over the file already at ``path`` (a recycled spare's, in a temp
    dir only this save can see) instead of insisting on a new one: its disk blocks, and
    its pages if still cached, are reused rather than allocated, then the surplus is cut.
    """
    if nice is not None:
        set_thread_nice(nice)
    exclusive = 0 if overwrite else os.O_EXCL
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | exclusive | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        w = _HashingWriter(fd, hasher_pool, nice)
        try:
            save_into(obj, w)
        except RuntimeError:
            if w.os_error is not None:
                raise w.os_error from None
            raise
        if overwrite and os.fstat(fd).st_size != w.size:
            os.ftruncate(fd, w.size)
        os.fsync(fd)
    finally:
        os.close(fd)
    return w.size, w.sha.hexdigest()


def hash_file(path: Path) -> tuple[int, str]:
    sha = hashlib.sha256()
    size = 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(_READ_CHUNK)
        mv = memoryview(buf)
        while n := f.readinto(buf):
            sha.update(mv[:n])
            size += n
    return size, sha.hexdigest()


def read_bytes(path: Path) -> bytes:
    with open(path, "rb", buffering=0) as f:
        return f.read()


def load_bytes(data: bytes, map_location: Any) -> Any:
    # weights_only=True: the unpickler only rebuilds tensors and plain containers, so a
    # tampered snapshot cannot run code. BytesIO(bytes) shares the buffer, no copy.
    import torch

    return torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
