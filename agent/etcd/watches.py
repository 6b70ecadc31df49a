"""One etcd watch that cancels only itself.

python3-etcd3 numbers watches per gRPC stream, and a stream that broke (an etcd leader
lost, a channel rebuilt) is replaced by one that numbers its watches from 0 again.
Cancelling an old watch by its number on the client's current watcher therefore cancelled
whichever new watch took that number: another mirror's, or the store's, which then stayed
silent while looking healthy. A handle keeps the watcher it was made on and cancels nothing
once its stream has ended: a watch on an ended stream is gone already.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol


class Calls(Protocol):
    """What a handle needs of :class:`.client.EtcdClient` (which makes handles itself)."""

    def call(self, request: Callable[[Any], Any], *, deadline: float | None = None) -> Any: ...


class OwnWatch:
    """``callback`` gets each response, or the error (None: the stream ended without one)."""

    def __init__(self, client: Calls, key: str | bytes, callback: Callable[[Any], None],
                 deadline: float | None = None, **kwargs: Any) -> None:
        self.ended = False

        def on_response(response: Any) -> None:
            if response is None or isinstance(response, BaseException):
                self.ended = True  # etcd3 tells every watch of a stream before it opens the next
            callback(response)

        def create(c: Any) -> tuple[Any, Any]:
            watcher = c.watcher
            return watcher, c.add_watch_callback(key, on_response, **kwargs)

        self._watcher, self.id = client.call(create, deadline=deadline)

    def cancel(self) -> None:
        """Cancel it on its own stream; nothing if that stream has ended."""
        if self.ended:
            return
        self.ended = True
        self._watcher.cancel(self.id)
