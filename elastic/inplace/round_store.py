"""The process group's store, re-pointed at each round's store.

gloo runs its rendezvous for a reconfigure over the store the group was created with.
That store must outlive any one node, which a TCPStore hosted by one worker does not. But
it only has to serve one reconfigure at a time, under a fresh prefix: so this store
forwards to the store of the round being joined (a TCPStore hosted by the agent of that
round's first node, which lives exactly as long as that node) and is pointed at the next
round's before the next reconfigure.

A host that is frozen (SIGSTOP, a paused VM) keeps its sockets open and answers nothing,
and torch's TCPStore client then blocks in every call, its constructor included, far past
its timeout (checked with torch 2.14.1: ``check``, ``get``, ``add`` and a new client all
still blocked after 8 s with a 1 s timeout). So every call to the round's store runs on a
thread of its own (:class:`_Caller`), and the caller waits for it in short slices: a newer
round (:meth:`abandon`) or this store's own timeout ends the wait at once, and the client,
with its blocked thread, is dropped (never used again; the thread ends when the host thaws
or dies). A killed host refuses connects and resets its connections, so its calls fail
fast by themselves.

Blocking reads wait in short slices and give up at once when :meth:`abandon` is called
(a newer round came), so a reconfigure waiting for a member that died does not sit out a
timeout: it fails, and the worker moves on to the newer round. They are bounded by this
store's own timeout, never by the one gloo passes: the reconfigure's timeout is kept short
to bound its connect phase (:func:`.reconfigure.reconfigure_timeout`), and a member that is
only slow to reach its reconfigure must not fail the round.
"""

from __future__ import annotations

import queue
import threading
import time
from datetime import timedelta
from typing import Any, Callable, TypeVar

import torch.distributed as dist

_POLL_MAX_S = 0.01
_SLICE_S = 0.005  # how often a caller looks whether its round was abandoned
T = TypeVar("T")


class RoundAbandoned(RuntimeError):
    """A newer round came while this one's exchange was still waiting."""


class _Caller:
    """One daemon thread that makes the calls to one round store's client, in order.

    A caller that walks away from a call (abandoned, or past its bound) marks this caller
    broken: no further call is queued behind the blocked one, and the thread exits once the
    blocked call returns. A daemon thread, never a ``concurrent.futures`` pool, whose
    threads are joined at interpreter exit: a host frozen for good must not hold the
    process's exit."""

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], dict[str, Any], threading.Event] | None] = \
            queue.SimpleQueue()
        self.broken = False
        threading.Thread(target=self._serve, name="elastic-round-store", daemon=True).start()

    def _serve(self) -> None:
        while True:
            item = self._calls.get()
            if item is None:
                return
            call, box, done = item
            try:
                box["value"] = call()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, who raises it
                box["error"] = exc
            finally:
                done.set()

    def call(self, call: Callable[[], T], abandoned: threading.Event, seconds: float, what: str) -> T:
        if self.broken:
            raise RoundAbandoned("the round store stopped answering")
        box: dict[str, Any] = {}
        done = threading.Event()
        self._calls.put((call, box, done))
        end = time.monotonic() + seconds
        while not done.wait(_SLICE_S):
            if abandoned.is_set() or time.monotonic() > end:
                self.broken = True
                self._calls.put(None)  # the thread leaves once the blocked call returns
                if abandoned.is_set():
                    raise RoundAbandoned("a newer round came")
                raise dist.DistStoreError(f"the round store did not answer {what} within {seconds:.1f} s "
                                          "(its host frozen?)")
        if "error" in box:
            raise box["error"]
        return box["value"]

    def close(self) -> None:
        self.broken = True
        self._calls.put(None)


class RoundStore(dist.Store):
    def __init__(self, timeout: timedelta = timedelta(seconds=60)) -> None:
        super().__init__()  # required by the pybind trampoline
        self._timeout = timeout
        self._target: dist.Store | None = None
        self._caller: _Caller | None = None
        self._abandoned = threading.Event()
        self.address = ""

    # ------------------------------------------------------------------ ours

    def point_at(self, address: str, prefix: str, connect_timeout: float = 10.0) -> None:
        """Forward to ``host:port``'s TCPStore, under ``prefix``. The connect runs on the
        caller's thread (:class:`_Caller`), so a newer round (:meth:`abandon`) ends the wait
        for a store host that died or froze."""
        self._abandoned.clear()
        self._target = None
        if self._caller is not None:
            self._caller.close()
        self._caller = caller = _Caller()
        host, _, port = address.rpartition(":")
        client = caller.call(
            lambda: dist.TCPStore(host.strip("[]"), int(port), is_master=False, wait_for_workers=False,
                                  timeout=timedelta(seconds=connect_timeout)),
            self._abandoned, connect_timeout, f"a connect to {address}")
        self._target = dist.PrefixStore(prefix, client)
        self.address = address

    def abandon(self) -> None:
        self._abandoned.set()

    def close(self) -> None:
        """Drop the client and let its thread go (once a call it is blocked in returns)."""
        self._target = None
        if self._caller is not None:
            self._caller.close()
            self._caller = None

    @property
    def abandoned(self) -> bool:
        return self._abandoned.is_set()

    def _call(self, what: str, call: Callable[[dist.Store], T]) -> T:
        target, caller = self._target, self._caller
        if target is None or caller is None:
            raise RoundAbandoned("no round store yet")
        if self._abandoned.is_set():
            raise RoundAbandoned("a newer round came")
        return caller.call(lambda: call(target), self._abandoned, self._timeout.total_seconds(), what)

    def _wait(self, keys: list[str]) -> None:
        """Poll with ``check`` (a TCPStore ``wait`` that times out logs a warning each time)."""
        deadline = time.monotonic() + self._timeout.total_seconds()
        pause = 0.001
        while not self._call("a check", lambda s: s.check(keys)):
            if time.monotonic() > deadline:
                raise dist.DistStoreError(f"timed out waiting for round store keys {keys} at {self.address}")
            time.sleep(pause)
            pause = min(pause * 2, _POLL_MAX_S)

    # ------------------------------------------------------------------ the Store interface

    def set(self, key: str, value: str | bytes) -> None:
        self._call("a set", lambda s: s.set(key, value))

    def get(self, key: str) -> bytes:
        self._wait([key])
        return self._call("a get", lambda s: s.get(key))

    def add(self, key: str, amount: int) -> int:
        return int(self._call("an add", lambda s: s.add(key, amount)))

    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        return self._call("a compare_set", lambda s: s.compare_set(key, expected_value, desired_value))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._wait(list(keys))  # our own bound (the module's docstring), abandoned by a newer round

    def check(self, keys: list[str]) -> bool:
        return bool(self._call("a check", lambda s: s.check(keys)))

    def delete_key(self, key: str) -> bool:
        return bool(self._call("a delete", lambda s: s.delete_key(key)))

    def num_keys(self) -> int:
        return int(self._call("num_keys", lambda s: s.num_keys()))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self._wait(list(keys))
        return list(self._call("a multi_get", lambda s: s.multi_get(keys)))

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        self._call("a multi_set", lambda s: s.multi_set(keys, values))

    def append(self, key: str, value: str | bytes) -> None:
        self._call("an append", lambda s: s.append(key, value))

    def set_timeout(self, timeout: timedelta) -> None:
        """Ignored: gloo sets its reconfigure timeout here, which is short by design (see the
        module's docstring); the waits keep the timeout this store was made with."""
