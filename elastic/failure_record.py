"""Why a worker failed, written where the agent reads it: torchrun's error file, with the kind.

torch's format (``ErrorHandler``: ``{"message": {"message": ..., "extraInfo": {"py_callstack":
..., "timestamp": ...}}}``) so that torchrun-style reports still show it, plus the error's
:class:`~elastic.contract.FailureKind` under :data:`~elastic.contract.FAILURE_KIND_KEY`,
classified here, once, by :func:`elastic.collectives.failure_kind`. The agent's policy then
tells a broken world from the script's own error by that field, not by the line's words.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path

from . import contract, worker_env
from .atomic_file import write_atomically
from .contract import FailureKind


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
    data["message"].setdefault("extraInfo", {})[contract.FAILURE_KIND_KEY] = kind.value
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


def read(path: str) -> tuple[str, FailureKind | None]:
    """(the first line of the recorded error, its kind) from an error file; ('', None) for none.
    A kind the file does not hold or this build does not know is None: the script's own."""
    if not path or path == "/dev/null":
        return "", None
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8", errors="replace"))
        message = data["message"]
        text = message["message"] if isinstance(message, dict) else message
        extra = message.get("extraInfo", {}) if isinstance(message, dict) else {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return "", None
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    try:
        kind = FailureKind(extra.get(contract.FAILURE_KIND_KEY)) if isinstance(extra, dict) else None
    except ValueError:
        kind = None
    return (lines[0][:300] if lines else ""), kind


__all__ = ["read", "record"]
