"""Why a worker failed, written where the agent reads it: torchrun's error file, with the kind.

torch's format (``ErrorHandler``: ``{"message": {"message": ..., "extraInfo": {"py_callstack":
..., "timestamp": ...}}}``) so that torchrun-style reports still show it, plus the error's
:class:`~elastic.contract.FailureKind` under :data:`~elastic.contract.FAILURE_KIND_KEY`,
classified here, once, by :func:`elastic.collectives.failure_kind`. The agent's policy then
tells a broken world from the script's own error by that field, not by the line's words.
"""

from __future__ import annotations

import errno
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from . import contract, worker_env
from .atomic_file import write_atomically
from .contract import FailureKind, FaultCause
from .torch_untyped import raised_in_torch, untyped_cause


def record(exc: BaseException, message: str | None = None, kind: FailureKind | None = None) -> None:
    """Write why this worker fails (``message``, else ``Type: text``) and its kind (``kind``,
    else classified from ``exc``). A file already there (a script's own ``@record``) keeps
    its words and gains the kind. Whole or not at all: the agent may read it while a SIGKILL
    ends the worker mid-write; a file that cannot be written leaves the worker's log to say it."""
    path = worker_env.read().error_file or ""
    if not path or path == "/dev/null":
        return
    if kind is None and "torch" not in sys.modules:
        kind = FailureKind.USER  # torch not even imported: no collective can have failed
    if kind is None:
        from .collectives import failure_kind

        kind = failure_kind(exc)
    target = Path(path)
    data = _existing(target)
    if data is None:
        stack = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        data = {"message": {"message": message or f"{type(exc).__name__}: {exc}",
                            "extraInfo": {"py_callstack": stack, "timestamp": str(int(time.time()))}}}
    extra = data["message"].setdefault("extraInfo", {})
    extra[contract.FAILURE_KIND_KEY] = kind.value
    cause = fault_cause(exc)
    if cause is not None:
        extra[contract.FAULT_CAUSE_KEY] = cause.value
    try:
        write_atomically(target, json.dumps(data).encode())
    except OSError:
        pass


def _existing(path: Path) -> dict | None:
    """A record already written in torch's format (with a dict message), or None."""
    try:
        data = json.loads(path.read_text(encoding="utf-8", errors="replace"))
    except (OSError, ValueError):
        return None
    if isinstance(data, dict) and isinstance(data.get("message"), dict) and isinstance(
            data["message"].get("extraInfo", {}), dict):
        return data
    return None


def fault_cause(exc: BaseException) -> FaultCause | None:
    """What ended the worker, by the type of ``exc`` or of an error it was raised from (a
    :class:`~elastic.collectives.CollectiveFailure` chains torch's); torch's untyped CUDA and
    NCCL errors by their words, in :mod:`elastic.torch_untyped` alone. None: an ordinary error."""
    torch = sys.modules.get("torch")
    seen: BaseException | None = exc
    for _ in range(5):
        if seen is None:
            break
        cause = _typed_cause(seen, torch)
        if cause is not None:
            return cause
        seen = seen.__cause__ or seen.__context__
    return None


def _typed_cause(exc: BaseException, torch: Any) -> FaultCause | None:
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return FaultCause.DISK_FULL
    errors = sys.modules.get("checkpoints.errors")
    if errors is not None and isinstance(exc, errors.SnapshotDiskFullError):
        return FaultCause.DISK_FULL
    if isinstance(exc, MemoryError):
        return FaultCause.OOM
    snapshots = sys.modules.get("elastic.snapshots")
    if snapshots is not None and isinstance(exc, snapshots.StaleGroupError):
        return FaultCause.LEASE_LOST
    if torch is None:
        return None
    if isinstance(exc, torch.OutOfMemoryError):
        return FaultCause.GPU_OOM
    accelerator = getattr(torch, "AcceleratorError", None)
    if accelerator is not None and isinstance(exc, accelerator):
        return FaultCause.NCCL if untyped_cause(str(exc)) is FaultCause.NCCL else FaultCause.CUDA
    if isinstance(exc, torch.distributed.DistBackendError) or (
            type(exc) is RuntimeError and raised_in_torch(exc.__traceback__)):
        return untyped_cause(str(exc))
    return None


def read(path: str) -> tuple[str, FailureKind | None]:
    """(the first line of the recorded error, its kind) from an error file; ('', None) for none.
    A kind the file does not hold or this build does not know is None: the script's own."""
    line, kind, _ = read_all(path)
    return line, kind


def read_all(path: str) -> tuple[str, FailureKind | None, FaultCause | None]:
    """:func:`read`, and the error's :class:`~elastic.contract.FaultCause` (None: none named)."""
    if not path or path == "/dev/null":
        return "", None, None
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8", errors="replace"))
        message = data["message"]
        text = message["message"] if isinstance(message, dict) else message
        extra = message.get("extraInfo", {}) if isinstance(message, dict) else {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return "", None, None
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    try:
        kind = FailureKind(extra.get(contract.FAILURE_KIND_KEY)) if isinstance(extra, dict) else None
    except ValueError:
        kind = None
    try:
        cause = FaultCause(extra.get(contract.FAULT_CAUSE_KEY)) if isinstance(extra, dict) else None
    except ValueError:
        cause = None  # none named, or a newer build's name
    return (lines[0][:300] if lines else ""), kind, cause


__all__ = ["fault_cause", "read", "read_all", "record"]
