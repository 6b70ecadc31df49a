"""Is this failure the world breaking? One answer for every collective the run makes.

A collective fails when a peer is lost (killed, partitioned, reconfigured away): the step is
abandoned and the world re-forms, so such a failure is turned into :class:`CollectiveFailure`
while any other error (a bug, a bad batch) still propagates. :func:`failure_kind` classifies an
error once, where it is caught, as a :class:`~elastic.contract.FailureKind`, and the kind travels
with it (``CollectiveFailure.kind``, and torchrun's error file for the agent): nothing downstream
reads its words again. Torch types most of these failures (``torch.distributed.DistError`` and its
subclasses below), and the type decides. It does not type them all: with torch 2.14.1 a gloo peer
lost mid-collective raises a plain ``RuntimeError``. So an untyped ``RuntimeError`` raised inside
torch's own code, and only then, is read by :mod:`elastic.torch_untyped`; one the script raised
itself is the script's, whatever it says. tests/elastic/test_collectives.py fails loudly if torch
renames the types or starts typing the gloo failure.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Iterator

import torch.distributed as dist

from .contract import FailureKind
from .noticed import Noticed
from .torch_untyped import raised_in_torch, untyped_kind, untyped_noticed

# torch's types for a collective, its process group's transport or its store failing; a
# collective's timeout is one of them (NCCL's watchdog: DistBackendError; a store wait:
# DistStoreError). All subclass dist.DistError, which is checked too for any added later.
TORCH_TYPES: tuple[type[BaseException], ...] = (
    dist.DistError, dist.DistBackendError, dist.DistNetworkError, dist.DistStoreError,
)


class CollectiveFailure(RuntimeError):
    """A collective of this step failed: the world is broken, the step is abandoned.

    ``kind`` says how (a peer lost unless the raiser knows better: a timeout, or this group
    abandoned for a newer round); ``noticed`` how this rank learnt it, for rank 0's line
    (given by a raiser that knows; else from ``kind``, or from torch's own words in ``message``
    read by :mod:`elastic.torch_untyped`, the message being a torch error's first line)."""

    def __init__(self, message: str = "", kind: FailureKind = FailureKind.PEER_LOST,
                 noticed: Noticed | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.noticed = noticed if noticed is not None else Noticed.TIMED_OUT if kind is FailureKind.TIMEOUT \
            else Noticed.BY_THE_AGENTS if kind is FailureKind.ABANDONED else untyped_noticed(message)


def failure_kind(exc: BaseException) -> FailureKind:
    """How ``exc`` happened, from its type and where it was raised; never from its words alone."""
    snapshots = sys.modules.get("elastic.snapshots")  # not imported: its fence cannot have raised
    if isinstance(exc, CollectiveFailure):
        return exc.kind
    if snapshots is not None and isinstance(exc, snapshots.StaleGroupError):  # a newer round commits
        return FailureKind.ABANDONED
    if isinstance(exc, dist.DistStoreError):  # torch raises it when a store wait passes its timeout
        return FailureKind.TIMEOUT
    if isinstance(exc, TORCH_TYPES):
        return FailureKind.PEER_LOST
    if type(exc) is RuntimeError and raised_in_torch(exc.__traceback__):
        return untyped_kind(exc) or FailureKind.USER
    return FailureKind.USER


def noticed_of(exc: BaseException) -> Noticed:
    """How a rank learnt from ``exc`` that its world broke, by its type (and only for an
    untyped error raised inside torch, by torch's words)."""
    if isinstance(exc, CollectiveFailure):
        return exc.noticed
    kind = failure_kind(exc)
    if kind is FailureKind.ABANDONED:
        return Noticed.BY_THE_AGENTS
    if kind is FailureKind.TIMEOUT:
        return Noticed.TIMED_OUT
    if isinstance(exc, dist.DistNetworkError):
        return Noticed.CLOSED
    if type(exc) is RuntimeError and raised_in_torch(exc.__traceback__):
        return untyped_noticed(str(exc))
    return Noticed.FAILED


def is_collective_failure(exc: BaseException) -> bool:
    """The world broke under ``exc`` (a peer lost, a timeout): the step is abandoned, not failed."""
    kind = failure_kind(exc)
    return kind.world_broke or (kind is FailureKind.ABANDONED and isinstance(exc, CollectiveFailure))


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
        kind = failure_kind(exc)
        if kind.world_broke:
            raise CollectiveFailure(first_line(exc), kind, noticed_of(exc)) from exc
        raise
