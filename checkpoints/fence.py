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

A lock is waited for :data:`LOCK_WAIT_S` at most. Rank 0 commits a ledger line under it
every step, so a node frozen (SIGSTOP) inside that commit would hold it for as long as it
stays frozen, and the survivors' new rank 0, raising the fence for their round, would wait
with it: a frozen node stalling the survivors (seen as a 30 s hang and a timeout). Going on
without the lock is safe: its holder was admitted by the fence before the raise, and its
commit, if it ever completes, is one that came just before the raise (the step it records
was trained by its group); any commit that checks the fence after the raise is refused.

A round may only raise the fence, never lower it; a token of another run takes the
directory over (a new job on an old directory), and the old run's groups are then stale.
A commit refused raises :class:`SnapshotFencedError`: the group that holds it is stale
and must stop. Readers (``load_latest``, ``verify``) ignore both files.

With a job key the fence is signed like the manifests (``"hmac"`` over run and round): a
fence that does not verify (edited, written without the key) is ignored with one WARNING
naming the file, as if absent, and the next raise replaces it; so whoever can write the
directory but lacks the key cannot stop a signed job's snapshots with one edit. Without a
key an edited fence cannot be told from a newer round's: its refusal names ``.fence`` and
says what to do.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import hmac
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from . import signing
from .errors import SnapshotError

log = logging.getLogger(__name__)

FENCE_NAME = ".fence"
LOCK_NAME = ".fence.lock"
LOCK_WAIT_S = 0.5  # a commit takes milliseconds; longer, its holder is frozen or stuck (see above)
_DOMAIN = b"elastic-snapshot-fence/v1"
_warned: set[tuple[str, bytes]] = set()  # (fence path, content) already reported as not verifying


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


def _tag(key: bytes, token: FenceToken) -> str:
    return hmac.new(key, b"\0".join((_DOMAIN, token.run.encode(), str(token.round).encode())),
                    hashlib.sha256).hexdigest()


class Fence:
    """The fence of one snapshot directory (which must exist).

    ``key``: the job key (the default: from the environment, as :class:`SnapshotStore`
    reads it; None: unsigned). With a key the fence is written signed and read only if it
    verifies."""

    def __init__(self, root: str | os.PathLike[str],
                 key: bytes | None | signing._FromEnv = signing.FROM_ENV) -> None:
        self.root = Path(root)
        self.path = self.root / FENCE_NAME
        self._key = signing.load_key()[0] if key is signing.FROM_ENV else key

    def current(self) -> FenceToken | None:
        try:
            raw = self.path.read_bytes()
            meta = json.loads(raw)
        except (OSError, ValueError):
            return None
        token = FenceToken.from_meta(meta)
        if token is None or self._key is None:
            return token
        tag = meta.get("hmac") if isinstance(meta, dict) else None
        if isinstance(tag, str) and hmac.compare_digest(tag, _tag(self._key, token)):
            return token
        if (str(self.path), raw) not in _warned:
            _warned.add((str(self.path), raw))
            log.warning("ignoring the snapshot fence %s (round %d of run %r): it is %s, so it stops nothing; the "
                        "next group of this job replaces it", self.path, token.round, token.run,
                        "not signed with the job key (edited, or written without the key)" if tag is None
                        else "signed with another key, or edited")
        return None

    @contextlib.contextmanager
    def _locked(self, mode: int) -> Iterator[None]:
        """The lock in ``mode``, or after :data:`LOCK_WAIT_S` none (see the module's doc)."""
        fd = os.open(self.root / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if not _flock_within(fd, mode, LOCK_WAIT_S):
                log.warning("snapshot dir %s: the fence's lock was held by another process for %.1f s (a frozen or "
                            "stopped process of an older group, or a stuck disk); going on without it", self.root,
                            LOCK_WAIT_S)
            yield
        finally:
            os.close(fd)  # releases the lock

    def raise_to(self, token: FenceToken) -> None:
        """Stand the fence at ``token``; :class:`SnapshotFencedError` if a newer round of the
        same run already holds it."""
        with self._locked(fcntl.LOCK_EX):
            current = self.current()
            if current is not None and current.run == token.run and current.round > token.round:
                raise _fenced(token, current, self.path)
            if current == token:
                return
            if current is not None and current.run != token.run:
                log.warning("snapshot dir %s: run %r takes it over from run %r", self.root, token.run, current.run)
            tmp = self.root / f"{FENCE_NAME}.{os.getpid()}.tmp"
            meta = token.to_meta() if self._key is None else {**token.to_meta(), "hmac": _tag(self._key, token)}
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(meta, f)
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
                raise _fenced(token, current, self.path)
            yield


def _flock_within(fd: int, mode: int, seconds: float) -> bool:
    """``flock(fd, mode)`` if it can be had within ``seconds``; False otherwise."""
    deadline = time.monotonic() + seconds
    pause = 0.001
    while True:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(pause)
            pause = min(pause * 2, 0.02)


def _fenced(token: FenceToken, current: FenceToken, path: Path | None = None) -> SnapshotFencedError:
    where = f" (its fence {path})" if path is not None else ""
    if current.run != token.run:
        return SnapshotFencedError(f"run {current.run!r} now writes to this snapshot directory{where}; this group of "
                                   f"run {token.run!r} is stale and commits nothing more; if run {current.run!r} does "
                                   f"not use this directory, delete {path or FENCE_NAME}")
    return SnapshotFencedError(f"round {current.round} of this job now commits to this snapshot directory{where}; "
                               f"this group of round {token.round} is stale (cut off or written off) and commits "
                               f"nothing more; if no group of round {current.round} runs ({FENCE_NAME} edited, or etcd "
                               f"lost its data), stop the job, delete {path or FENCE_NAME} and start it again (with "
                               "--snapshot-dir, so that new rounds start above the fence)")
