"""torch's untyped errors (a collective's failure above all), read in this module alone.

With torch 2.14.1 a gloo peer lost mid-collective raises a plain ``RuntimeError("[.../gloo/
transport/tcp/pair.cc:561] Connection closed by peer ...")`` (and a gloo wait past its timeout
``RuntimeError("[...] Timed out waiting ...")``), from ``all_reduce``, ``work.wait()`` and a DDP
backward alike: torch gives it no type. This module is the only place in ``elastic``
that reads a torch error's words to classify it (its other untyped errors too: how a collective
broke, for rank 0's line; a refused pin), as ``gloo_private.py`` is the only
place that touches a private interface. It is asked only about an untyped ``RuntimeError`` raised
inside torch's own code, or inside ``elastic``'s where it calls torch's C++ straight (a
``Work.wait()``; :func:`elastic.collectives.failure_kind` checks the origin first), so a
script's own ``RuntimeError("timeout")`` never reaches it. ``tests/elastic/test_collectives.py``
fails loudly once torch types these failures, and then this module goes.
"""

from __future__ import annotations

import re
from contextlib import suppress
from pathlib import Path
from types import TracebackType

from .contract import FailureKind, FaultCause
from .noticed import Noticed

# What gloo and NCCL say first in that error (its first line only: a longer message that wraps
# another error, such as the DataLoader's "Caught RuntimeError in DataLoader worker", is not theirs).
_TIMEOUT_WORDS = ("timed out", "timeout")
_BROKEN_WORDS = ("gloo", "nccl", "connection closed", "connection reset", "broken pipe", "socket", "processgroup",
                 "c10d", "peer", "aborted", "reconfigure")

_TORCH_DIR: Path | None = None
_OWN_DIR = Path(__file__).resolve().parent  # elastic/: it raises no untyped RuntimeError in gloo's words


def _torch_dir() -> Path:
    global _TORCH_DIR
    if _TORCH_DIR is None:
        import torch

        _TORCH_DIR = Path(torch.__file__).resolve().parent
    return _TORCH_DIR


def raised_in_torch(tb: TracebackType | None) -> bool:
    """Whether the innermost frame of ``tb`` is torch's own code (a collective, DDP's reducer,
    the autograd engine running it) or this package's calling straight into torch's C++ (a
    ``Work.wait()`` of its own, as the peer copies' exchange makes: no Python frame of torch's
    is left on that traceback), not the script's."""
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    with suppress(OSError, ValueError):
        where = Path(tb.tb_frame.f_code.co_filename).resolve()
        return where.is_relative_to(_torch_dir()) or where.is_relative_to(_OWN_DIR)
    return False


# How gloo and torch's stores word a closed connection and a wait past its timeout.
_CLOSED_WORDS = ("connection closed", "connection reset", "closed by peer", "read error", "broken pipe",
                 "end of file", "connection refused")
_WAITED_WORDS = ("timed out", "timeout", "deadline")


def untyped_noticed(text: str) -> Noticed:
    """How torch's untyped words say a collective broke: its connection closed, it timed out,
    or just failed (rank 0's line, :func:`elastic.log.how_noticed`)."""
    lowered = text.lower()
    if any(word in lowered for word in _CLOSED_WORDS):
        return Noticed.CLOSED
    if any(word in lowered for word in _WAITED_WORDS):
        return Noticed.TIMED_OUT
    return Noticed.FAILED


def pin_refused(exc: RuntimeError) -> bool:
    """Whether torch refused to pin a batch that is not on the CPU (a pinning DataLoader given a
    dataset already on the GPU): an untyped ``RuntimeError("cannot pin 'torch.cuda.FloatTensor'
    only dense CPU tensors can be pinned")`` raised in torch's own code. The guard:
    ``tests/elastic/test_plan.py`` (a meta tensor, refused with the same words)."""
    return type(exc) is RuntimeError and raised_in_torch(exc.__traceback__) and "cannot pin" in str(exc)


# How CUDA and NCCL word their failures in torch's errors: the most specific first (an NCCL
# error caused by CUDA says both, and is NCCL's).
_NCCL_WORDS = re.compile(r"\bNCCL error\b|\bnccl(UnhandledCuda|System|Internal|InvalidArgument|InvalidUsage|Remote)"
                         r"Error\b|ProcessGroupNCCL|NCCL communicator was aborted|NCCL WARN", re.I)
_CUDA_WORDS = re.compile(r"\bCUDA error\b|\bcudaError\w*|CUBLAS_STATUS_\w+|CUDNN_STATUS_\w+|device-side assert"
                         r"|illegal memory access|CUDA driver|\bXid\b", re.I)
_GPU_OOM_WORDS = re.compile(r"CUDA out of memory|CUBLAS_STATUS_ALLOC_FAILED|cudaErrorMemoryAllocation")


def untyped_cause(text: str) -> FaultCause | None:
    """What a torch error that is untyped for it (a ``RuntimeError``, a ``DistBackendError``, an
    ``AcceleratorError``) says ended the worker: the GPU out of memory, NCCL, CUDA; None: none."""
    if _GPU_OOM_WORDS.search(text):
        return FaultCause.GPU_OOM
    if _NCCL_WORDS.search(text):
        return FaultCause.NCCL
    if _CUDA_WORDS.search(text):
        return FaultCause.CUDA
    return None


def untyped_kind(exc: RuntimeError) -> FailureKind | None:
    """The kind gloo's or NCCL's untyped error says it is, or None (not theirs)."""
    text = str(exc).strip()
    first = text.splitlines()[0].lower() if text else ""
    if any(word in first for word in _TIMEOUT_WORDS):
        return FailureKind.TIMEOUT
    if any(word in first for word in _BROKEN_WORDS):
        return FailureKind.PEER_LOST
    return None


__all__ = ["pin_refused", "raised_in_torch", "untyped_cause", "untyped_kind", "untyped_noticed"]
