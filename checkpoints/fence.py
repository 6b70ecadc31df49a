"""The snapshot directory's fence: only the newest round of a job may commit steps to it.

Two groups of one job must never commit steps at the same time (a split brain): a stale
group (its members written off, its agent cut from etcd) would otherwise write ledger
lines and snapshots beside the group that replaced it, and the newest snapshot could be
the stale one. Every group that forms raises the fence to its **token**, the job's run id
and the rendezvous round number (which etcd makes strictly increasing per job), and
every commit (a ledger line, a snapshot's final rename) first checks that the fence still
stands at its own token:

* ``.fence``: JSON ``{"run": ..., "round": ...}``, replaced whole (write, fsync, rename);
* ``.fence.lock``: ``flock``: raising takes it exclusively, a commit shared, so a commit
  and a raise never interleave and the commit order on disk is the fence order.

A round may only raise the fence, never lower it; a token of another run takes the
directory over (a new job on an old directory), and the old run's groups are then stale.
A commit refused raises :class:`SnapshotFencedError`: the group that holds it is stale
and must stop. Readers (``load_latest``, ``verify``) ignore both files.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from .errors import SnapshotError

log = logging.getLogger(__name__)

FENCE_NAME = ".fence"
LOCK_NAME = ".fence.lock"


class SnapshotFencedError(SnapshotError):
    """A newer round (or another job) writes to this snapshot directory now: this group is stale."""


@dataclass(frozen=True)
class FenceToken:
    run: str
    round: int

    def admits(self, current: "FenceToken | None") -> bool:
        """Whether a group holding ``self`` may commit while the fence stands at ``current``."""
        return current is None or (current.run == self.run and current.round <= self.round)

    def to_meta(self) -> dict[str, object]:
        return {"run": self.run, "round": self.round}

    @classmethod
    def from_meta(cls, meta: object) -> "FenceToken | None":
        if not isinstance(meta, dict):
            return None
        try:
            return cls(str(meta["run"]), int(meta["round"]))
        except (KeyError, TypeError, ValueError):
            return None


class Fence:
    """The fence of one snapshot directory (which must exist)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def current(self) -> FenceToken | None:
        try:
            return FenceToken.from_meta(json.loads((self.root / FENCE_NAME).read_bytes()))
        except (OSError, ValueError):
            return None

    @contextlib.contextmanager
    def _locked(self, mode: int) -> Iterator[None]:
        fd = os.open(self.root / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, mode)
            yield
        finally:
            os.close(fd)  # releases the lock

    def raise_to(self, token: FenceToken) -> None:
        """Stand the fence at ``token``; :class:`SnapshotFencedError` if a newer round of the
        same run already holds it."""
        with self._locked(fcntl.LOCK_EX):
            current = self.current()
            if current is not None and current.run == token.run and current.round > token.round:
                raise _fenced(token, current)
            if current == token:
                return
            if current is not None and current.run != token.run:
                log.warning("snapshot dir %s: run %r takes it over from run %r", self.root, token.run, current.run)
            tmp = self.root / f"{FENCE_NAME}.{os.getpid()}.tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(token.to_meta(), f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.root / FENCE_NAME)

    @contextlib.contextmanager
    def holding(self, token: FenceToken) -> Iterator[None]:
        """Commit under the fence: no raise can happen meanwhile; refused if it moved past us."""
        with self._locked(fcntl.LOCK_SH):
            current = self.current()
            if not token.admits(current):
                assert current is not None
                raise _fenced(token, current)
            yield


def _fenced(token: FenceToken, current: FenceToken) -> SnapshotFencedError:
    if current.run != token.run:
        return SnapshotFencedError(f"run {current.run!r} now writes to this snapshot directory; this group of run "
                                   f"{token.run!r} is stale and commits nothing more")
    return SnapshotFencedError(f"round {current.round} of this job now commits to this snapshot directory; this "
                               f"group of round {token.round} is stale (cut off or written off) and commits nothing "
                               "more (if etcd lost its data, start the agents with --snapshot-dir so that new rounds "
                               "start above the fence)")
