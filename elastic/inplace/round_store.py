"""The process group's store, re-pointed at each round's store.

gloo runs its rendezvous for a reconfigure over the store the group was created with.
That store must outlive any one node, which a TCPStore hosted by one worker does not. But
it only has to serve one reconfigure at a time, under a fresh prefix: so this store
forwards to the store of the round being joined (a TCPStore hosted by the agent of that
round's first node, which lives exactly as long as that node) and is pointed at the next
round's before the next reconfigure.

Blocking reads wait in short slices and give up at once when :meth:`abandon` is called
(a newer round came), so a reconfigure waiting for a member that died does not sit out a
timeout: it fails, and the worker moves on to the newer round. They are bounded by this
store's own timeout, never by the one gloo passes: the reconfigure's timeout is kept short
to bound its connect phase (:func:`.reconfigure.reconfigure_timeout`), and a member that is
only slow to reach its reconfigure must not fail the round.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import torch.distributed as dist

_POLL_MAX_S = 0.01


class RoundAbandoned(RuntimeError):
    """A newer round came while this one's exchange was still waiting."""


class RoundStore(dist.Store):
    def __init__(self, timeout: timedelta = timedelta(seconds=60)) -> None:
        super().__init__()  # required by the pybind trampoline
        self._timeout = timeout
        self._target: dist.Store | None = None
        self._abandoned = threading.Event()
        self.address = ""

    # ------------------------------------------------------------------ ours

    def point_at(self, address: str, prefix: str, connect_timeout: float = 10.0) -> None:
        """Forward to ``host:port``'s TCPStore, under ``prefix``. Connects in short tries so
        that a newer round (:meth:`abandon`) ends the wait for a store host that died."""
        self._abandoned.clear()
        self._target = None
        host, _, port = address.rpartition(":")
        deadline = time.monotonic() + connect_timeout
        while True:
            try:
                client = dist.TCPStore(host.strip("[]"), int(port), is_master=False, wait_for_workers=False,
                                       timeout=timedelta(seconds=1))
                break
            except (RuntimeError, dist.DistError) as exc:  # type: ignore[misc]
                if self._abandoned.is_set():
                    raise RoundAbandoned("a newer round came") from exc
                if time.monotonic() > deadline:
                    raise
        self._target = dist.PrefixStore(prefix, client)
        self.address = address

    def abandon(self) -> None:
        self._abandoned.set()

    def _store(self) -> dist.Store:
        if self._target is None:
            raise RoundAbandoned("no round store yet")
        if self._abandoned.is_set():
            raise RoundAbandoned("a newer round came")
        return self._target

    def _wait(self, keys: list[str]) -> None:
        """Poll with ``check`` (a TCPStore ``wait`` that times out logs a warning each time)."""
        deadline = time.monotonic() + self._timeout.total_seconds()
        pause = 0.001
        while not self._store().check(keys):
            if time.monotonic() > deadline:
                raise dist.DistStoreError(f"timed out waiting for round store keys {keys} at {self.address}")
            time.sleep(pause)
            pause = min(pause * 2, _POLL_MAX_S)

    # ------------------------------------------------------------------ the Store interface

    def set(self, key: str, value: str | bytes) -> None:
        self._store().set(key, value)

    def get(self, key: str) -> bytes:
        self._wait([key])
        return self._store().get(key)

    def add(self, key: str, amount: int) -> int:
        return int(self._store().add(key, amount))

    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        return self._store().compare_set(key, expected_value, desired_value)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:  # type: ignore[override]
        self._wait(list(keys))  # our own bound (the module's docstring), abandoned by a newer round

    def check(self, keys: list[str]) -> bool:
        return bool(self._store().check(keys))

    def delete_key(self, key: str) -> bool:
        return bool(self._store().delete_key(key))

    def num_keys(self) -> int:
        return int(self._store().num_keys())

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self._wait(list(keys))
        return list(self._store().multi_get(keys))

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        self._store().multi_set(keys, values)

    def append(self, key: str, value: str | bytes) -> None:
        self._store().append(key, value)

    def set_timeout(self, timeout: timedelta) -> None:
        """Ignored: gloo sets its reconfigure timeout here, which is short by design (see the
        module's docstring); the waits keep the timeout this store was made with."""
