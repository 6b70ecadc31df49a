"""What a node believes of a key whose value fails verification: its last good value, for a while.

A value that fails the job's HMAC check, or does not parse, was not written by an agent of
this job (or was damaged): it is never a decision. Read as *absent*, though, one unsigned
write over a live node's registry key looks like that node's death, and every forgery
starts a new round in place. So a key whose value stops verifying keeps the value it last
verified with, for ``grace`` seconds: long enough for its owner (a live agent rewrites its
own registry key; a member of the round rewrites the round record) to put a signed value
back. A key still forged after the grace counts as absent, as if its lease had expired: an
owner that does not repair its key within a lease TTL is not alive to do so. A key that
is deleted is gone at once, as before.

Pure and clock-injected, like :mod:`.rounds`: unit-tested in milliseconds.
"""

from __future__ import annotations

import threading
from typing import Collection, Generic, TypeVar

T = TypeVar("T")


class LastGood(Generic[T]):
    """Per key: the last value that verified, and since when the current one has not."""

    def __init__(self, grace: float) -> None:
        self.grace = grace
        self._good: dict[str, T] = {}
        self._forged_since: dict[str, float] = {}
        self._lock = threading.Lock()  # the monitor loop and the rendezvous read from two threads

    def resolve(self, key: str, verified: T | None, now: float) -> T | None:
        """The value to act on for ``key``: ``verified`` if the current value verified, else
        the last good one while the forgery is younger than the grace, else None (absent)."""
        with self._lock:
            if verified is not None:
                self._good[key] = verified
                self._forged_since.pop(key, None)
                return verified
            since = self._forged_since.setdefault(key, now)
            if key in self._good and now - since < self.grace:
                return self._good[key]
            return None

    def forged_for(self, key: str, now: float) -> float | None:
        """How long ``key``'s current value has failed verification (None: it verifies)."""
        with self._lock:
            since = self._forged_since.get(key)
        return None if since is None else now - since

    def last(self, key: str) -> T | None:
        with self._lock:
            return self._good.get(key)

    def keep_only(self, present: Collection[str]) -> None:
        """Forget keys that are gone from etcd: a deleted key is absent, not forged."""
        present = present if isinstance(present, (set, frozenset, dict)) else set(present)  # a list made it O(N^2)
        with self._lock:
            for gone in [k for k in self._good if k not in present]:
                del self._good[gone]
            for gone in [k for k in self._forged_since if k not in present]:
                del self._forged_since[gone]
