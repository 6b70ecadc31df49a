"""Is this failure the world breaking? One answer for every collective the run makes.

A collective fails when a peer is lost (killed, partitioned, reconfigured away): the step is
abandoned and the world re-forms, so such a failure is turned into :class:`CollectiveFailure`
while any other error (a bug, a bad batch) still propagates. Torch types most of them
(``torch.distributed.DistError`` and its subclasses below), and the type decides. It does not
type them all: with torch 2.14.1 a gloo peer lost mid-collective raises a plain
``RuntimeError("[.../gloo/transport/tcp/pair.cc:561] Connection closed by peer ...")``, from
``all_reduce`` and from ``work.wait()`` alike. So for a ``RuntimeError`` that torch did not type,
and only then, the message is read (:data:`_UNTYPED_WORDS`). tests/elastic/test_collectives.py fails loudly if torch renames the
types or starts typing the gloo failure.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch.distributed as dist

# torch's types for a collective, its process group's transport or its store failing; a
# collective's timeout is one of them (NCCL's watchdog: DistBackendError; a store wait:
# DistStoreError). All subclass dist.DistError, which is checked too for any added later.
TORCH_TYPES: tuple[type[BaseException], ...] = (
    dist.DistError, dist.DistBackendError, dist.DistNetworkError, dist.DistStoreError,
)

# What gloo and NCCL say in the untyped RuntimeError described above.
_UNTYPED_WORDS = ("gloo", "nccl", "connection closed", "connection reset", "broken pipe", "timed out",
                  "timeout", "socket", "processgroup", "c10d", "peer", "aborted", "reconfigure")


class CollectiveFailure(RuntimeError):
    """A collective of this step failed: the world is broken, the step is abandoned."""


def is_collective_failure(exc: BaseException) -> bool:
    if isinstance(exc, (CollectiveFailure, *TORCH_TYPES)):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    text = str(exc).lower()
    return any(word in text for word in _UNTYPED_WORDS)


def first_line(exc: BaseException) -> str:
    """The error in one line for a log (its type's name when it says nothing)."""
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__


@contextlib.contextmanager
def collective_failures() -> Iterator[None]:
    """Around collectives: a failure that is the world breaking leaves as
    :class:`CollectiveFailure` (the cause chained); any other error leaves unchanged."""
    try:
        yield
    except CollectiveFailure:
        raise
    except RuntimeError as exc:
        if is_collective_failure(exc):
            raise CollectiveFailure(first_line(exc)) from exc
        raise
