"""torch's one untyped collective failure, read in this module alone.

With torch 2.14.1 a gloo peer lost mid-collective raises a plain ``RuntimeError("[.../gloo/
transport/tcp/pair.cc:561] Connection closed by peer ...")`` (and a gloo wait past its timeout
``RuntimeError("[...] Timed out waiting ...")``), from ``all_reduce``, ``work.wait()`` and a DDP
backward alike: torch gives it no type. This module is the only place in ``elastic``, ``agent``
and ``checkpoints`` that reads an error's words to classify it, as ``gloo_private.py`` is the only
place that touches a private interface. It is asked only about an untyped ``RuntimeError`` raised
inside torch's own code, or inside ``elastic``'s where it calls torch's C++ straight (a
``Work.wait()``; :func:`elastic.collectives.failure_kind` checks the origin first), so a
script's own ``RuntimeError("timeout")`` never reaches it. ``tests/elastic/test_collectives.py``
fails loudly once torch types these failures, and then this module goes.
"""

from __future__ import annotations

from contextlib import suppress
from pathlib import Path
from types import TracebackType

from .contract import FailureKind

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


def untyped_kind(exc: RuntimeError) -> FailureKind | None:
    """The kind gloo's or NCCL's untyped error says it is, or None (not theirs)."""
    text = str(exc).strip()
    first = text.splitlines()[0].lower() if text else ""
    if any(word in first for word in _TIMEOUT_WORDS):
        return FailureKind.TIMEOUT
    if any(word in first for word in _BROKEN_WORDS):
        return FailureKind.PEER_LOST
    return None


__all__ = ["raised_in_torch", "untyped_kind"]
