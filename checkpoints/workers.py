"""A tiny daemon thread pool that keeps working while the interpreter exits.

``concurrent.futures.ThreadPoolExecutor`` refuses new work once interpreter shutdown
starts, which is before ``atexit`` handlers run; the writer's exit-time flush would then
fail to write the very snapshot it is flushing. These threads are daemons and take work
until the process is gone.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable


class DaemonPool:
    def __init__(self, threads: int, name: str, initializer: Callable[[], None] | None = None) -> None:
        self._q: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]]] = (
            queue.SimpleQueue()
        )
        self._initializer = initializer
        for i in range(threads):
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True).start()

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future[Any]:
        fut: Future[Any] = Future()
        self._q.put((fut, fn, args, kwargs))
        return fut

    def _work(self) -> None:
        if self._initializer is not None:
            self._initializer()
        while True:
            fut, fn, args, kwargs = self._q.get()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args, **kwargs))
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
                fut.set_exception(e)
