"""Errors a user can cause, each carrying one line that names the problem and the fix.

The trainer prints ``str(err)`` and exits non-zero; a traceback is reserved for bugs,
so every message here must make sense on its own at 3 a.m.
"""

from __future__ import annotations

from enum import Enum

__all__ = [
    "Problem",
    "ProblemKind",
    "kind_of",
    "SnapshotError",
    "SnapshotCorruptError",
    "SnapshotMismatchError",
    "SnapshotDirError",
    "SnapshotDiskFullError",
    "SnapshotExistsError",
    "SnapshotKeyError",
    "JobKeyError",
]


class SnapshotError(Exception):
    """Base class; ``str(err)`` is a single line suitable for a log or a terminal."""

    def __init__(self, message: str) -> None:
        # Collapse accidental newlines so "one clear line" holds whatever the caller passed.
        super().__init__(" ".join(str(message).split()))


class SnapshotCorruptError(SnapshotError):
    """A snapshot's manifest or one of its files does not match what was written."""


class SnapshotMismatchError(SnapshotError):
    """A snapshot was written by a different model/optimizer (keys or shapes differ)."""


class SnapshotDirError(SnapshotError):
    """The snapshot directory is missing, not a directory, or not writable."""


class SnapshotDiskFullError(SnapshotError):
    """The filesystem ran out of space (ENOSPC/EDQUOT) while a snapshot was written."""


class SnapshotExistsError(SnapshotError):
    """A valid snapshot for this step already exists and the store was told not to skip it."""


class JobKeyError(SnapshotError, ValueError):
    """The job key (``--key-file``, ``ELASTIC_RDZV_HMAC_KEY_FILE``/``ELASTIC_RDZV_HMAC_KEY``) is unusable.

    One type for the snapshots and the rendezvous (``agent.rendezvous.HmacKeyError`` is this
    class), since both read the same key with one loader (:func:`checkpoints.signing.load_key`);
    a ``ValueError`` too, as the rendezvous' callers (torchrun's handler factory) expect."""


SnapshotKeyError = JobKeyError  # the name the snapshot store's callers know


class ProblemKind(str, Enum):
    """What is wrong with one snapshot, for a caller to decide on (the line is for people)."""

    DAMAGED = "damaged"  # a file missing, truncated or corrupt; the manifest unreadable or inconsistent
    SIGNATURE = "signature"  # refused for its signature alone under the job key: never deleted for it
    UNFINISHED = "unfinished"  # no manifest: a write in progress or one that never finished, not a snapshot
    ABSENT = "absent"  # no such snapshot (pruned meanwhile, or never written)
    FENCED = "fenced"  # committed by a writer a newer round had fenced off


class Problem(str):
    """One line saying what is wrong with a snapshot (it is the ``str``), with its :class:`ProblemKind`."""

    kind: ProblemKind

    def __new__(cls, text: str, kind: ProblemKind = ProblemKind.DAMAGED) -> "Problem":
        made = super().__new__(cls, text)
        made.kind = kind
        return made

    def __reduce__(self) -> tuple[type, tuple[str, ProblemKind]]:
        return Problem, (str(self), self.kind)


def kind_of(problem: str) -> ProblemKind:
    """A problem's kind; a plain line is damage (what every problem without a kind is)."""
    return problem.kind if isinstance(problem, Problem) else ProblemKind.DAMAGED
