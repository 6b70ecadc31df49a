"""The job's newest snapshot, for ``elastic local``'s view: a directory or an object store alike.

The view once globbed ``step-*`` in the run directory's ``snapshots/``, so a job with
``--snapshot-dir s3://...`` (or any other directory) showed "last snapshot: none yet" to its
end. This reads the location the workers were given, through the store's public reading
API (``open_store(...).list()``: manifests only, no file read, nothing logged), in a short
background thread at most every few seconds: a slow or absent server never stalls the view,
which shows the last answer.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from checkpoints.location import is_remote, split_tiers

NONE_YET = "none yet"


class NewestSnapshot:
    """``text()``: the newest committed snapshot's name (``step-000000000040``), or none yet."""

    def __init__(self, location: str, every_s: float = 2.0) -> None:
        tiers = split_tiers(location)
        self.location = tiers[1] if tiers is not None else location  # counted as saved once in the object store
        self.every_s = every_s
        self._newest = NONE_YET
        self._problem = ""  # why the last look failed ('': it answered)
        self._next = 0.0
        self._store: Any = None  # a SnapshotStore, S3SnapshotStore: open_store's
        self._thread: threading.Thread | None = None

    def text(self) -> str:
        """The last answer; asks again in the background when it is older than ``every_s``."""
        if time.monotonic() >= self._next and not (self._thread is not None and self._thread.is_alive()):
            self._next = time.monotonic() + self.every_s
            self._thread = threading.Thread(target=self._look, name="newest-snapshot", daemon=True)
            self._thread.start()
        return f"{self._newest} (cannot look now: {self._problem})" if self._problem else self._newest

    def settle(self, timeout_s: float = 20.0) -> None:
        """Once the job is over, for the last view: one more look, waited for (up to ``timeout_s``),
        so the summary names the final snapshot, not an answer from before it was written (the
        first look imports torch in its thread, which a loaded machine makes slow)."""
        deadline = time.monotonic() + timeout_s
        if self._thread is not None:
            self._thread.join(timeout_s)
        if self._thread is not None and self._thread.is_alive():
            return  # the last answer stands; the view says nothing new
        self._thread = threading.Thread(target=self._look, name="newest-snapshot", daemon=True)
        self._thread.start()
        self._thread.join(max(0.0, deadline - time.monotonic()))
        self._next = time.monotonic() + self.every_s

    def _look(self) -> None:
        from checkpoints import SnapshotError
        from checkpoints.stores import open_store  # torch, in this thread, at the view's first look

        remote = is_remote(self.location)
        try:
            if self._store is None:  # an object store answers within seconds here, or the view says so
                options = {"retry_for_s": 5.0, "timeout_s": 5.0} if remote else {}
                self._store = open_store(self.location, create=False, key=None, **options)
            found = self._store.list()
        except SnapshotError as e:
            # a directory the workers have not made yet is no problem; a store that does not answer is
            self._problem = "" if not remote and self._newest == NONE_YET else type(e).__name__
            return
        except Exception as e:  # noqa: BLE001 - the view goes on whatever the store's client raises
            self._problem = type(e).__name__
            return
        self._newest, self._problem = (found[-1].path.name if found else NONE_YET), ""
