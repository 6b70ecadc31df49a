"""One etcd watch that cancels only itself, and where a broken one resumes.

python3-etcd3 numbers watches per gRPC stream, and a stream that broke (an etcd leader
lost, a channel rebuilt) is replaced by one that numbers its watches from 0 again.
Cancelling an old watch by its number on the client's current watcher therefore cancelled
whichever new watch took that number: another mirror's, or the store's, which then stayed
silent while looking healthy. A handle keeps the watcher it was made on (and is made on
that very watcher, not on whichever one the client holds a moment later) and cancels
nothing once its stream has ended: a watch on an ended stream is gone already.

python3-etcd3 also matches etcd's "created" confirmations to requests by arrival order
alone: a create that timed out (a loaded machine, a member changing leaders) is confirmed
later, and that late confirmation was taken for the *next* create on the stream, so the
next watch (the round record's, say) silently watched the previous key while the mirror
said healthy. After a timed-out create the client gets a fresh watcher (stream); the old
one, with no create pending, cancels the late confirmation, and its live watches go on.

:func:`resume_plan` is the decision a mirror makes after a watch broke: resume every watch
from the revision after the last one it applied, or read afresh where etcd's history is gone.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence

from etcd3 import exceptions as etcd_exc

from agent.etcd.chain import raised_from


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
            try:
                return watcher, watcher.add_callback(key, on_response, **kwargs)
            except etcd_exc.WatchTimedOut:
                _fresh_watcher(c, watcher)
                raise

        self._watcher, self.id = client.call(create, deadline=deadline)

    def cancel(self) -> None:
        """Cancel it on its own stream; nothing if that stream has ended."""
        if self.ended:
            return
        self.ended = True
        self._watcher.cancel(self.id)


def _fresh_watcher(c: Any, timed_out: Any) -> None:
    """Give the client a new watcher (a new stream on the same channel) after ``timed_out``
    left a create unconfirmed, unless another thread did already."""
    if c.watcher == timed_out:  # a view of the watcher (the simulation's) compares as the watcher
        c.watcher = c.get_watcher()


def resume_plan(seen: Sequence[int], compacted: bool) -> list[int] | None:
    """The start revision of each broken watch, from ``seen`` (the last revision each one
    applied, its read's revision at first); None: read everything afresh instead, because
    etcd compacted the history a watch would replay, or a watch has nothing to resume from."""
    if compacted or not seen or any(revision <= 0 for revision in seen):
        return None
    return [revision + 1 for revision in seen]


def is_compacted(error: BaseException | None) -> bool:
    """The watch's history is gone (etcd compacted past the revision it resumes from)."""
    return raised_from(error, etcd_exc.RevisionCompactedError) is not None
