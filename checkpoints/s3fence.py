"""The fence (:mod:`.fence`) of a snapshot location in an object store.

The same tokens and the same rule as on a directory; only the mechanics differ, because an
object store has no lock:

* ``.fence`` is one object, raised by compare-and-swap: ``If-Match`` on the ETag read (or
  ``If-None-Match: *`` when there is none), retried when another raiser got there first.
  A server that ignores conditional writes degrades to last-writer-wins between two
  raisers, which are both newer than any stale group anyway.
* A commit (the manifest PUT) checks the fence before, and again after: a commit that finds
  the fence moved past it meanwhile deletes its manifest and reports itself stale. What is
  left is the moment between a stale writer's PUT and its second check; if it dies exactly
  there, readers still refuse its snapshot: a manifest whose token is of an older round of
  the fence's run and that the server stamped after the fence itself is never read
  (:func:`stale_commit`).
* With a job key the fence object is signed as a directory's fence is (``"hmac"`` over run
  and round, :mod:`.fence`): one that does not verify (forged, edited, written without the
  key) is ignored with one WARNING naming it, as if absent, and the next raise replaces it;
  so whoever can write the bucket but lacks the key cannot stop a signed job's snapshots.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hmac
import json
import logging
from typing import Any, Iterator

from .fence import FENCE_NAME, FenceToken, _fenced, _tag, _warned
from .s3client import PreconditionFailed, S3Objects

log = logging.getLogger(__name__)


class S3Fence:
    def __init__(self, objects: S3Objects, key: bytes | None = None) -> None:
        self.objects = objects
        self._key = key
        self.root = str(objects.loc)
        self.path = f"{self.root.rstrip('/')}/{FENCE_NAME}"  # named in lines, as a directory's fence file is

    def _read(self) -> tuple[FenceToken | None, str | None]:
        try:
            data, etag = self.objects.get(FENCE_NAME)
        except FileNotFoundError:
            return None, None
        try:
            meta = json.loads(data)
        except ValueError:
            return None, etag
        token = FenceToken.from_meta(meta)
        if token is None or self._key is None:
            return token, etag
        tag = meta.get("hmac") if isinstance(meta, dict) else None
        if isinstance(tag, str) and hmac.compare_digest(tag, _tag(self._key, token)):
            return token, etag
        if (self.path, data) not in _warned:
            _warned.add((self.path, data))
            log.warning("ignoring the snapshot fence %s (round %d of run %r): it is %s, so it stops nothing; the "
                        "next group of this job replaces it", self.path, token.round, token.run,
                        "not signed with the job key (edited, or written without the key)" if tag is None
                        else "signed with another key, or edited")
        return None, etag  # as if absent; the ETag lets the next raise replace it

    def current(self) -> FenceToken | None:
        return self._read()[0]

    def stamped(self) -> tuple[FenceToken | None, dt.datetime | None]:
        """The fence and when the server last wrote it (for :func:`stale_commit`)."""
        try:
            r = self.objects.call(lambda: self.objects.client.head_object(
                Bucket=self.objects.loc.bucket, Key=self.objects.loc.key(FENCE_NAME)))
        except Exception:  # noqa: BLE001 - no fence (or unreadable): nothing to judge by
            return None, None
        return self.current(), r.get("LastModified")

    def raise_to(self, token: FenceToken) -> None:
        for _ in range(20):
            current, etag = self._read()
            if current is not None and current.run == token.run and current.round > token.round:
                raise _fenced(token, current)
            if current == token:
                return
            if current is not None and current.run != token.run:
                log.warning("snapshot location %s: run %r takes it over from run %r", self.root, token.run,
                            current.run)
            meta = token.to_meta() if self._key is None else {**token.to_meta(), "hmac": _tag(self._key, token)}
            body = json.dumps(meta).encode()
            try:
                if etag is None:
                    self.objects.put(FENCE_NAME, body, if_none_match=True)
                else:
                    self.objects.put(FENCE_NAME, body, if_match=etag)
                return
            except PreconditionFailed:
                continue  # another raiser wrote it between our read and write: judge again
        raise PreconditionFailed(f"{self.root}: the fence kept changing while round {token.round} raised it")

    @contextlib.contextmanager
    def holding(self, token: FenceToken) -> Iterator[None]:
        """Refused (SnapshotFencedError) if the fence stands past ``token``; the caller checks
        again after its commit (:meth:`admits`), since nothing is locked in between."""
        self.check(token)
        yield

    def check(self, token: FenceToken) -> None:
        current = self.current()
        if not token.admits(current):
            assert current is not None
            raise _fenced(token, current)


def stale_commit(meta: Any, fence: FenceToken | None, fence_time: dt.datetime | None,
                 manifest_time: dt.datetime | None) -> str | None:
    """Why a manifest must not be read as a snapshot (None if it may): written under a token
    the fence had already moved past when the server stored it."""
    token = FenceToken.from_meta(meta)
    if token is None or fence is None or fence_time is None or manifest_time is None:
        return None
    if token.run == fence.run and token.round < fence.round and manifest_time > fence_time:
        return (f"written by round {token.round} after round {fence.round} took the location over "
                "(a stale group's commit)")
    return None
